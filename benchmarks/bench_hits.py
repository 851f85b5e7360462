# Copyright (c) MONAI Consortium
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#     http://www.apache.org/licenses/LICENSE-2.0
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
The hits section's jobs: per-hit and fill timings of each path, the first read of an item, the breakdown of a hit,
and the kernel's floor of a first read. ``micro_fork`` runs paths 1, 2, 5 (and 6) in the fork's
tree, and, as its ``portable`` variant in a process with ``MONAI_CACHE_FAST_PATH=0``, paths 1, 2 and 5b (the store
without its Linux fast path); ``micro_upstream`` runs paths 3 and 4 in the upstream tree.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from bench_common import (
    FAST_PATH_ENV,
    PATHS,
    PORTABLE,
    UPSTREAM_PATHS,
    DeepcopyCounter,
    collate_copy,
    compute_times,
    hit,
    inputs,
    item_arrays,
    job_setup,
    median,
    minflt,
    plain_write,
    transforms,
)


def job_micro_fork(cfg: dict) -> dict[str, Any]:
    """
    The fork tree's paths, timed in one process: fill, raw write vs plain write, and hits interleaved path by path (so
    that their ratios see the same load), the first read of an item, the breakdown of a hit.

    ``cfg["variant"]`` ``"full"`` (the default): paths 1, 2, 5 (the store with its Linux fast path) and, with
    ``--store-root``, 6; and the kernel's floor of a first read. ``"portable"``:
    paths 1, 2 and 5b, the store without its fast path; the driver runs this job with ``MONAI_CACHE_FAST_PATH=0``
    (read at the import of monai, so it cannot be switched inside one process), and it fails if the fast path is on.
    """
    info = job_setup()
    from monai.data import CacheDataset, SharedCacheStore

    portable = cfg.get("variant", "full") == "portable"
    if info.get("fast_path") is None:
        raise RuntimeError("this tree has no monai_sharedcache._pool: not the fork's tree")
    if portable and info["fast_path"]:
        raise RuntimeError(
            f"{FAST_PATH_ENV}=0 did not turn the fast path off (monai_sharedcache._pool.ENABLED is True)"
        )
    store_name = PORTABLE if portable else "store"
    reps, fill_n, warmup = cfg["reps"], cfg["fill_n"], 2
    data = inputs(cfg, fill_n)
    compute, nbytes = compute_times(cfg, False, cfg["compute_n"])
    tr, first_random = transforms(cfg["roi"], False)
    res: dict[str, Any] = {"info": info, "variant": cfg.get("variant", "full"), "run": cfg.get("run"), "paths": {}}
    res["item_nbytes"] = nbytes
    roots: dict[str, str | None] = {store_name: None}
    if cfg.get("store_root") and not portable:
        roots["store_root"] = cfg["store_root"]

    # fill: eager (the constructor computes every item) and store (the first read of each item is a miss)
    start = time.perf_counter()
    eager = CacheDataset(data, tr, copy_cache=False, progress=False, num_workers=1)
    fills: dict[str, list[float]] = {"private": [(time.perf_counter() - start) / fill_n]}
    stores: dict[str, Any] = {}
    for name, root in roots.items():
        cache = "process" if root is None else SharedCacheStore(root=root)
        stores[name] = CacheDataset(data, tr, runtime_cache=cache, progress=False)
        fills[name] = []
        for i in range(fill_n):
            start = time.perf_counter()
            hit(stores[name], i)
            fills[name].append(time.perf_counter() - start)

    # raw write of one computed item: list assignment / store.put, against a plain os.write of the same bytes
    item = tr(inputs(cfg, 1)[0], end=first_random)
    arrays = item_arrays(item)
    lst: list[Any] = [None]
    writes: dict[str, list[float]] = {"private": []}
    plains: dict[str, list[float]] = {}
    file_bytes = 0
    for _ in range(cfg["compute_n"] + 2):
        start = time.perf_counter()
        lst[0] = item
        writes["private"].append(time.perf_counter() - start)
        lst[0] = None
    for name, root in roots.items():
        store = SharedCacheStore(root=root)
        writes[name], plains[name] = [], []
        for r in range(cfg["compute_n"] + 2):
            key = f"write-{r}"
            start = time.perf_counter()
            stored = store.put(key, item)
            writes[name].append(time.perf_counter() - start)
            if not stored:
                raise RuntimeError(f"store.put refused an item of {nbytes / 2**20:.1f} MiB in {store.path}")
            file_bytes = store.stats()["nbytes"]
            plains[name].append(plain_write(os.path.dirname(store.path), arrays))
            store.discard([key])
        store.close()
    plains["private"] = plains[store_name]
    del arrays

    # hits, interleaved: private no-copy, private copy (same list, copy_cache toggled), store(s)
    counter = DeepcopyCounter()
    datasets = {"private_nocopy": (eager, False), "private_copy": (eager, True)}
    datasets.update({name: (ds, True) for name, ds in stores.items()})
    hits: dict[str, list[float]] = {p: [] for p in datasets}
    faults: dict[str, int] = dict.fromkeys(datasets, 0)
    copies: dict[str, int] = dict.fromkeys(datasets, 0)
    # the deepcopy path in a loop of its own: its deepcopy of the whole item evicts the CPU caches before whatever hit
    # comes next, which costs a store hit (it builds new objects) more than the floor's: interleaved with it, the store
    # measured 1.49-1.60x the floor against 1.27-1.30x without it (benchmarks/README.md)
    groups = [[n for n in datasets if n != "private_copy"], ["private_copy"]]
    for group in groups:
        for r in range(warmup + reps):
            for name in group:
                ds, copy_cache = datasets[name]
                ds.copy_cache = copy_cache
                f0, c0 = minflt(), counter.count
                start = time.perf_counter()
                hit(ds)
                elapsed = time.perf_counter() - start
                if r >= warmup:
                    hits[name].append(elapsed)
                    faults[name] += minflt() - f0
                    copies[name] += counter.count - c0
    counter.restore()

    # first read of an item in this process: the computed item is published under as many new keys as there are
    # timed reads, and each key is read once (nothing this process kept from an earlier read can serve it); the
    # floor is timed in between, so that the ratio sees the same load
    n_first = cfg["first_reps"]
    first: dict[str, list[float]] = {name: [] for name in ["private_nocopy", *stores]}
    first_faults: dict[str, int] = dict.fromkeys(stores, 0)
    first_sets = {}
    for name, root in roots.items():
        cache = "process" if root is None else SharedCacheStore(root=root)
        ds = CacheDataset(inputs(cfg, n_first, start=10_000), tr, runtime_cache=cache, progress=False)
        for i in range(n_first):
            if not _slots_store(ds).put(ds._runtime_keys[i], item):
                raise RuntimeError(f"store.put refused an item of {nbytes / 2**20:.1f} MiB")
        first_sets[name] = ds
    del item
    eager.copy_cache = False
    for i in range(n_first):
        start = time.perf_counter()
        hit(eager)
        first["private_nocopy"].append(time.perf_counter() - start)
        for name, ds in first_sets.items():
            f0 = minflt()
            start = time.perf_counter()
            hit(ds, i)
            first[name].append(time.perf_counter() - start)
            first_faults[name] += minflt() - f0
    for ds in first_sets.values():
        _slots_store(ds).discard(ds._runtime_keys)
    del first_sets

    for name in datasets:
        kind = "private" if name.startswith("private") else name
        res["paths"][name] = {
            "compute_s": compute,
            "fill_s": fills[kind],
            "write_s": writes[kind],
            "plain_write_s": plains[kind],
            "hit_s": hits[name],
            "minflt_per_hit": faults[name] / reps,
            "deepcopies_per_hit": copies[name] / reps,
        }
    for name in stores:
        res["paths"][name]["first_read_s"] = first[name]
        res["paths"][name]["first_read_floor_s"] = first["private_nocopy"]
        res["paths"][name]["first_read_minflt"] = first_faults[name] / n_first
    import monai.data.dataset as dataset_module

    slots_class = getattr(dataset_module, "_StoreSlots", None)  # the dataset skips the deepcopy of these reads
    res["paths"][store_name]["reads_are_private"] = slots_class is not None and isinstance(
        stores[store_name]._runtime, slots_class
    )
    res["paths"][store_name]["file_bytes_per_item"] = file_bytes
    try:  # uses private functions of the store: informative only
        res["breakdown"] = _breakdown(eager, stores[store_name], store_name, tr, first_random, reps)
    except Exception as err:
        res["breakdown_error"] = f"{type(err).__name__}: {err}"
    if not portable:  # the kernel's work does not depend on the store's fast path
        res["kernel_floor"] = {name: _kernel_floor(cfg, eager, ds) for name, ds in stores.items()}
    for ds in stores.values():
        _slots_store(ds).close()
    return res


def _slots_store(ds: Any) -> Any:
    """The ``SharedCacheStore`` of a dataset whose runtime cache is one (its slots, ``_StoreSlots``, hold it)."""
    return cast(Any, ds._runtime).store


def _item_file(store_ds: Any) -> str:
    """The file of the first item of a dataset's store (by the store's ``_file``, else its largest item file)."""
    store = _slots_store(store_ds)
    try:
        path = os.path.join(store.path, store._file(store_ds._runtime_keys[0], ".item"))
        if os.path.isfile(path):
            return str(path)
    except Exception:  # a private function of the store: fall back on the directory
        pass
    files = [os.path.join(root, n) for root, _, names in os.walk(store.path) for n in names if n.endswith(".item")]
    if not files:
        raise FileNotFoundError(f"no item file under {store.path}")
    return max(files, key=os.path.getsize)


def _kernel_floor(cfg: dict, eager: Any, store_ds: Any) -> dict[str, Any]:
    """
    The kernel's floor of a first read, on the item file of ``store_ds``, interleaved with the floor's hit (medians;
    never raises): what mapping the file costs the kernel alone, with no Python object made. ``touch``: open + a fresh
    ``MAP_PRIVATE`` mapping of the whole file + one byte read in each page of the crop region of each array (exactly
    the pages a crop of ``roi`` reads; a random crop position at each repetition) + munmap. The arrays are located in
    the file by its buffer table (``monai/data/_cache_format.py``: a fixed prefix, the key, then ``(offset, length)``
    per out-of-band buffer), each array being the buffer of its byte size.
    """
    try:
        path = _item_file(store_ds)
        eager.copy_cache = False
        arrays = [((4, *cfg["shape"]), 4), ((1, *cfg["shape"]), 1)]  # the image (float32) and the label (uint8)
        res = kernel_measure(path, arrays, cfg["roi"], cfg["first_reps"], lambda: hit(eager))
        res["store_dir"] = os.path.dirname(_slots_store(store_ds).path)
        return res
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


_PREFIX = struct.Struct("<8sHHIQIIQ")  # magic, version, flags, header_len, total_len, key_len, n_buffers, pickle_len
_ENTRY = struct.Struct("<QQ")  # offset, length of an out-of-band buffer
_MAGIC = b"\x89MONAI\r\n"


def buffer_table(path: str) -> list[tuple[int, int]]:
    """The ``(offset, length)`` of the out-of-band buffers of an item file."""
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        magic, _, _, header_len, _, key_len, n_buffers, _ = _PREFIX.unpack(head)
        if magic != _MAGIC:
            raise ValueError(f"{path}: not an item file")
        f.seek(_PREFIX.size + key_len)
        table = f.read(_ENTRY.size * n_buffers)
    return [_ENTRY.unpack_from(table, i * _ENTRY.size) for i in range(n_buffers)]


def locate_arrays(path: str, arrays: Sequence[tuple[Sequence[int], int]]) -> list[int]:
    """The file offset of each array ``(shape, itemsize)``: the first unused buffer of its byte size."""
    table = buffer_table(path)
    used: set[int] = set()
    offsets = []
    for shape, itemsize in arrays:
        nbytes = itemsize
        for s in shape:
            nbytes *= int(s)
        found = next((i for i, (_, length) in enumerate(table) if length == nbytes and i not in used), None)
        if found is None:
            raise ValueError(f"{path}: no buffer of {nbytes} bytes")
        used.add(found)
        offsets.append(table[found][0])
    return offsets


def crop_pages(
    offset: int, shape: Sequence[int], itemsize: int, start: Sequence[int], roi: Sequence[int], page: int
) -> Any:
    """The page numbers (of the file) that a crop of ``roi`` at ``start`` (spatial) of a C-order array reads."""
    import numpy as np

    c, x, y, z = (int(s) for s in shape)
    x0, y0, z0 = (int(s) for s in start)
    rx, ry, rz = (int(s) for s in roi)
    cc, xx, yy = np.meshgrid(np.arange(c), np.arange(x0, x0 + rx), np.arange(y0, y0 + ry), indexing="ij")
    first = offset + itemsize * (((cc * x + xx) * y + yy) * z + z0)
    last = first + rz * itemsize - 1
    first, last = (first // page).ravel(), (last // page).ravel()
    span = int((last - first).max()) if first.size else 0
    pages = [first + k for k in range(span + 1)]
    return np.unique(np.concatenate([p[p <= last] for p in pages]))


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _map(libc: Any, path: str) -> tuple[int, int]:
    """A fresh private read-only mapping of the whole file ``path``: (address, size); the descriptor is closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
    finally:
        os.close(fd)
    return addr, size


def kernel_measure(
    path: str,
    arrays: Sequence[tuple[Sequence[int], int]],
    roi: Sequence[int],
    reps: int,
    floor_hit: Callable[[], None],
    seed: int = 0,
) -> dict[str, Any]:
    """
    Time ``touch`` (see :func:`_kernel_floor`) on the item file ``path`` of the ``arrays`` (``(shape, itemsize)`` with
    shape ``(C, X, Y, Z)``), ``reps`` times, each interleaved with one ``floor_hit()``.
    """
    import numpy as np

    res: dict[str, Any] = {"path": path, "floor_s": [], "touch_s": [], "touch_minflt": []}
    try:
        libc = _libc()
        offsets = locate_arrays(path, arrays)
        res["file_bytes"] = os.path.getsize(path)
    except (OSError, AttributeError, ValueError, struct.error) as err:
        return {"path": path, "error": f"{type(err).__name__}: {err}"}
    page = mmap.PAGESIZE
    rng = np.random.default_rng(seed)
    n_pages = []
    for _ in range(reps):
        start = [int(rng.integers(0, int(s) - int(r) + 1)) for s, r in zip(arrays[0][0][1:], roi)]
        pages = np.concatenate(
            [crop_pages(off, shape, size, start, roi, page) for off, (shape, size) in zip(offsets, arrays)]
        )
        n_pages.append(int(pages.size))
        touch_at = pages * page
        t0 = time.perf_counter()
        floor_hit()
        res["floor_s"].append(time.perf_counter() - t0)
        try:
            f0 = minflt()
            t0 = time.perf_counter()
            addr, size = _map(libc, path)
            view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
            int(view[touch_at].sum())  # one byte per page: each page of the crop is faulted in
            del view
            libc.munmap(addr, size)
            res["touch_s"].append(time.perf_counter() - t0)
            res["touch_minflt"].append(minflt() - f0)
        except OSError as err:
            res["touch_error"] = str(err)
    res["crop_pages"] = median(n_pages)
    return res


def kernel_summary(res: dict[str, Any]) -> dict[str, Any]:
    """Medians and the ratio to the floor (``None`` where not available) of one :func:`kernel_measure` result."""
    floor, touch, faults = median(res.get("floor_s", [])), res.get("touch_s") or [], res.get("touch_minflt") or []
    out: dict[str, Any] = {"error": res.get("error"), "floor_s": floor, "crop_pages": res.get("crop_pages")}
    out["touch_s"] = median(touch) if touch else None
    out["touch_x_floor"] = out["touch_s"] / floor if touch and floor == floor and floor > 0 else None
    out["touch_error"] = res.get("touch_error")
    out["touch_minflt"] = median(faults) if faults else None
    return out


def _breakdown(eager: Any, store_ds: Any, store_name: str, tr: Any, first_random: int, reps: int) -> dict[str, Any]:
    """
    Where the time of one hit goes, for the floor and for the store: read, crop, copy, release; page faults. The
    store's read is ``_cache_format.read_file``: a mapping of the pool (fast path) or a fresh mapping (portable).
    """
    from monai.data import _cache_format

    store, key = _slots_store(store_ds), store_ds._runtime_keys[0]
    item_name = os.path.basename(_item_file(store_ds))  # read_file opens a name in the store's checked directory
    steps: dict[str, dict[str, list[float]]] = {"private_nocopy": {}, store_name: {}}

    def record(path: str, step: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        f0 = minflt()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        elapsed = time.perf_counter() - start
        steps[path].setdefault(step, []).append(elapsed)
        steps[path].setdefault(step + " faults", []).append(float(minflt() - f0))
        return out

    cached = eager._cache
    for _ in range(reps):
        data = record("private_nocopy", "read", cached.__getitem__, 0)
        out = record("private_nocopy", "crop", tr, data, start=first_random)
        record("private_nocopy", "copy", collate_copy, out)
        del data, out

        raw = record(store_name, "open+mmap", _cache_format.read_file, store._dir, item_name)[0]
        data = record(store_name, "unpickle", _cache_format.decode, raw, key)
        del raw
        out = record(store_name, "crop", tr, data, start=first_random)
        record(store_name, "copy", collate_copy, out)
        start = time.perf_counter()
        del data, out  # the last views of the mapping: munmap, or back to the pool (fast path)
        steps[store_name].setdefault("release", []).append(time.perf_counter() - start)
        record(store_name, "get() total", store.get, key)
    return {path: {step: median(v) for step, v in d.items()} for path, d in steps.items()}


def job_micro_upstream(cfg: dict) -> dict[str, Any]:
    """Paths 3 and 4 (upstream tree), one after the other: fill, ``ListProxy`` write vs plain write, hits."""
    info = job_setup()
    res: dict[str, Any] = {"info": info, "paths": {}}
    for name in UPSTREAM_PATHS:
        res["paths"][name] = _micro_upstream_path(cfg, name)
        gc.collect()
    return res


def _micro_upstream_path(cfg: dict, name: str) -> dict[str, Any]:
    from multiprocessing import Manager

    from monai.data import CacheDataset

    spec = PATHS[name]
    reps, fill_n, warmup = cfg["reps"], cfg["fill_n"], 2
    compute, _ = compute_times(cfg, spec["numpy"], cfg["compute_n"])
    tr, first_random = transforms(cfg["roi"], spec["numpy"])

    # upstream 1.6.1 makes a Manager().list() for runtime_cache="process"
    ds = CacheDataset(inputs(cfg, fill_n), tr, runtime_cache="process", copy_cache=spec["copy_cache"], progress=False)
    fill = []
    for i in range(fill_n):
        start = time.perf_counter()
        hit(ds, i)
        fill.append(time.perf_counter() - start)

    item = tr(inputs(cfg, 1)[0], end=first_random)
    arrays = item_arrays(item)
    manager = Manager()
    lst: Any = manager.list([None])
    write, plain = [], []
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for _ in range(cfg["compute_n"] + 2):
        # a fresh copy each time: sending a tensor moves its storage to shared memory, once
        fresh = dict(item)
        for key in ("image", "label"):
            fresh[key] = item[key].clone() if hasattr(item[key], "clone") else item[key].copy()
        start = time.perf_counter()
        lst[0] = fresh
        write.append(time.perf_counter() - start)
        del fresh
        plain.append(plain_write(shm, arrays))
    lst[0] = None
    manager.shutdown()
    del item, arrays

    counter = DeepcopyCounter()
    hits, faults = [], 0
    for r in range(warmup + reps):
        f0 = minflt()
        start = time.perf_counter()
        hit(ds)
        elapsed = time.perf_counter() - start
        if r >= warmup:
            hits.append(elapsed)
            faults += minflt() - f0
    counter.restore()
    manager_of_ds = getattr(ds._cache, "_manager", None)
    del ds
    if manager_of_ds is not None:
        manager_of_ds.shutdown()
    return {
        "compute_s": compute,
        "fill_s": fill,
        "write_s": write,
        "plain_write_s": plain,
        "hit_s": hits,
        "minflt_per_hit": faults / reps,
        "deepcopies_per_hit": counter.count / reps,
    }
