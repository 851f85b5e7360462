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
Benchmark of the ``CacheDataset`` runtime caches: the fork's shared-memory store against private lists and against
upstream MONAI 1.6.1's ``runtime_cache="process"`` (a ``multiprocessing.Manager`` ``ListProxy``).

Every measurement runs in a subprocess of its own, with ``PYTHONPATH`` set to the fork's laid-out tree
(``build/tree``) or to a pristine upstream 1.6.1 tree that this script unpacks under the output directory. The paths
of the fork tree are timed hit by hit in one process, interleaved, so that their ratios see the same load; the
numbers that matter are the RATIOS of one run (the machine may be shared), each a median over repetitions.

Run from the repository root::

    python benchmarks/bench_cache.py            # full size, about 3-5 minutes on 2 cores
    python benchmarks/bench_cache.py --small    # quick run, under 2 minutes

Results go to ``benchmarks/output/`` (``results.json``, ``results.md``, ``bench_cache.png``). The exit code is 0 even
when a target fails, unless ``--strict`` is given. Linux only (``/proc``, ``/dev/shm``). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import gc
import hashlib
import json
import os
import platform
import re
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
FORK_TREE = REPO / "build" / "tree"
BUILD_SCRIPT = REPO / "build_backend" / "monai_sharedcache_build.py"
DEFAULT_OUT = REPO / "benchmarks" / "output"
MIB = 1024 * 1024

# the compared paths: label, tree, runtime_cache, copy_cache, whether the cached items are numpy arrays
PATHS: dict[str, dict[str, Any]] = {
    "private_nocopy": {
        "label": "1. private list, eager, copy_cache=False (floor)",
        "short": "private no-copy",
        "tree": "fork",
        "runtime_cache": False,
        "copy_cache": False,
        "numpy": False,
    },
    "private_copy": {
        "label": "2. private list, eager, copy_cache=True",
        "short": "private copy",
        "tree": "fork",
        "runtime_cache": False,
        "copy_cache": True,
        "numpy": False,
    },
    "upstream_tensor": {
        "label": "3. upstream 1.6.1 'process' ListProxy, tensors",
        "short": "upstream ListProxy tensor",
        "tree": "upstream",
        "runtime_cache": "process",
        "copy_cache": True,
        "numpy": False,
    },
    "upstream_numpy": {
        "label": "4. upstream 1.6.1 'process' ListProxy, numpy",
        "short": "upstream ListProxy numpy",
        "tree": "upstream",
        "runtime_cache": "process",
        "copy_cache": False,
        "numpy": True,
    },
    "store": {
        "label": "5. fork 'process' SharedCacheStore",
        "short": "fork store",
        "tree": "fork",
        "runtime_cache": "process",
        "copy_cache": True,
        "numpy": False,
    },
}
# measured only with --store-root DIR (e.g. a tmpfs mounted with huge=within_size): per-hit and fill
OPTIONAL_PATHS: dict[str, dict[str, Any]] = {
    "store_root": {
        "label": "6. fork SharedCacheStore(root=--store-root)",
        "short": "fork store, --store-root",
        "tree": "fork",
        "runtime_cache": "store",
        "copy_cache": True,
        "numpy": False,
    },
}
UPSTREAM_PATHS = ("upstream_tensor", "upstream_numpy")
ALL_PATHS = {**PATHS, **OPTIONAL_PATHS}

TARGETS = {
    "hit_vs_floor": 2.0,  # store hit + crop <= 2x the private no-copy floor
    "speedup_vs_copy": 5.0,  # store >= 5x faster than private copy_cache=True
    "speedup_vs_upstream_numpy": 20.0,  # store >= 20x faster than upstream ListProxy with numpy items
    "fill_ratio": 1.5,  # store write <= 1.5x a plain os.write of the same bytes to /dev/shm
    "pss_ratio": 1.15,  # footprint of main + 2 workers with the store <= 1.15x one copy of the data
    "small_flat": 1.5,  # 20,000 small items: median hit of the last 1,000 <= 1.5x that of the first 1,000
}


# ---------------------------------------------------------------------------------------------------------------------
# helpers shared by the jobs (they import torch and monai lazily: the driver needs neither)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _data_files(data_dir: str, shape: Sequence[int]) -> tuple[str, str]:
    """
    Write (once) a synthetic 4-channel float32 image and its 1-channel uint8 label of spatial ``shape`` as ``.npy``
    files in ``data_dir``; return their paths. Every input item loads these files (the items differ by their key).
    """
    import numpy as np

    tag = "x".join(str(int(s)) for s in shape)
    image, label = os.path.join(data_dir, f"image-4x{tag}.npy"), os.path.join(data_dir, f"label-1x{tag}.npy")
    if not (os.path.exists(image) and os.path.exists(label)):
        os.makedirs(data_dir, exist_ok=True)
        img = np.random.default_rng(0).standard_normal((4, *[int(s) for s in shape]), dtype=np.float32)
        for path, arr in ((image, img), (label, (img[:1] > 1.0).astype(np.uint8))):
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, arr)
            os.replace(tmp, path)
    return image, label


def _inputs(cfg: dict, n: int, start: int = 0, shape: Sequence[int] | None = None) -> list[dict]:
    """``n`` input items (file names and a case number, which makes each item's content key distinct)."""
    image, label = _data_files(cfg["data_dir"], shape or cfg["shape"])
    return [{"image": image, "label": label, "case": start + i} for i in range(n)]


def _transforms(roi: Sequence[int], numpy_items: bool) -> tuple[Any, int]:
    """
    The transform chain: deterministic (cached) steps as in a segmentation pipeline, then a random crop.

    Args:
        roi: size of the random crop.
        numpy_items: append ``EnsureTyped(data_type="numpy")`` as the last cached step (numpy items in the cache).

    Returns:
        the ``Compose`` and the index of its first random transform.
    """
    import numpy as np

    from monai.transforms import Compose, EnsureTyped, LoadImaged, NormalizeIntensityd, RandSpatialCropd

    keys = ["image", "label"]
    cached: list[Any] = [
        LoadImaged(keys="image", reader="NumpyReader", channel_dim=0, image_only=True, dtype=np.float32),
        LoadImaged(keys="label", reader="NumpyReader", channel_dim=0, image_only=True, dtype=np.uint8),
        NormalizeIntensityd(keys="image", channel_wise=True),
    ]
    if numpy_items:
        cached.append(EnsureTyped(keys=keys, data_type="numpy"))
    crop = RandSpatialCropd(keys=keys, roi_size=tuple(roi), random_size=False)
    return Compose([*cached, crop]), len(cached)


_BATCH_BUFFERS: dict[tuple, Any] = {}


def _collate_copy(item: dict) -> dict:
    """
    A collate-like copy of the crop: ``torch.stack`` of each array into a batch buffer (a copy of the cropped region).

    The buffers are allocated once per shape and reused, so that what the allocator does (a new mapping to fault in,
    or reused heap memory, which varies from run to run) does not blur the cost of reading the cache.
    """
    import numpy as np
    import torch

    out = {}
    for key in ("image", "label"):
        value = item[key]
        value = torch.from_numpy(value) if isinstance(value, np.ndarray) else value.as_subclass(torch.Tensor)
        spec = (key, tuple(value.shape), value.dtype)
        buffer = _BATCH_BUFFERS.get(spec)
        if buffer is None:
            buffer = _BATCH_BUFFERS[spec] = torch.empty((1, *value.shape), dtype=value.dtype)
        out[key] = torch.stack([value], out=buffer)
    return out


def _item_arrays(item: dict) -> list[Any]:
    """The numpy views of the arrays of a cached item (what a plain file write writes)."""
    import numpy as np
    import torch

    arrays = []
    for key in ("image", "label"):
        value = item[key]
        if isinstance(value, torch.Tensor):
            value = value.as_subclass(torch.Tensor).contiguous().numpy()
        arrays.append(np.ascontiguousarray(value))
    return arrays


def _item_nbytes(item: dict) -> int:
    return int(sum(a.nbytes for a in _item_arrays(item)))


def _expected_nbytes(shape: Sequence[int]) -> int:
    """The nbytes of one item: a 4-channel float32 image and a 1-channel uint8 label of spatial ``shape``."""
    voxels = 1
    for s in shape:
        voxels *= int(s)
    return voxels * (4 * 4 + 1)


def _plain_write(directory: str, arrays: Sequence[Any]) -> float:
    """Seconds to write ``arrays`` to a new file in ``directory`` with ``os.write`` (the file is then removed)."""
    path = os.path.join(directory, f"bench-plain-{os.getpid()}-{secrets.token_hex(4)}")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for arr in arrays:
            view = memoryview(arr).cast("B")
            while view.nbytes:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return elapsed


def _malloc_trim() -> None:
    """Give the free memory of the malloc heaps back to the system (glibc), so that it is not counted as used."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _DeepcopyCounter:
    """Counts the ``deepcopy`` calls made by ``monai.data.dataset`` (to check that a read path skips it)."""

    def __init__(self) -> None:
        import monai.data.dataset as dataset_module

        self.module = dataset_module
        self.original = dataset_module.deepcopy
        self.count = 0

        def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.original(obj, *args, **kwargs)

        dataset_module.deepcopy = counting  # type: ignore[assignment]

    def restore(self) -> None:
        self.module.deepcopy = self.original


def _hit(ds: Any, index: int = 0) -> None:
    """One cache hit as a training step sees it: read + random crop (``ds[index]``) + a collate-like copy."""
    _collate_copy(ds[index])


# -- process memory ----------------------------------------------------------------------------------------------------

_VMA_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+\s")


def _children(pid: int) -> list[int]:
    """The pids of the children of ``pid`` (from the ppid field of ``/proc/*/stat``)."""
    kids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid:
            kids.append(int(name))
    return sorted(kids)


def _rollup_kib(pid: int) -> dict[str, int]:
    """The ``Pss*`` fields (KiB) of ``/proc/<pid>/smaps_rollup``."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss"):
                name, value = line.split()[:2]
                out[name.rstrip(":")] = int(value)
    return out


_SHM_PREFIXES = ("/dev/shm/", "/memfd:", "/SYSV")


def _file_key(path: str) -> tuple[tuple[int, int], int] | None:
    """``((st_dev, st_ino), allocated bytes)`` of the file behind ``path`` (e.g. ``/proc/<pid>/fd/<n>``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino), st.st_blocks * 512


def _shm_usage(pid: int, files: dict[tuple[int, int], int]) -> int | None:
    """
    Find the shared-memory files (``/dev/shm``, memfd, SysV) that ``pid`` maps or holds open, adding their allocated
    size to ``files`` (deduplicated by inode); return the PSS (KiB) of their file pages mapped by ``pid``, which the
    caller replaces by the files' whole size so that each page counts once, mapped or not. ``None`` if the process
    has no mappings any more (it is exiting).
    """
    mapped = n_vmas = 0
    current: str | None = None
    vma_range = ""
    pss = anon = 0

    def close_vma() -> None:
        nonlocal mapped
        if current is None:
            return
        mapped += pss - anon
        found = _file_key(f"/proc/{pid}/map_files/{vma_range}")
        if found is not None:
            files[found[0]] = found[1]

    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _VMA_HEADER.match(line):
                close_vma()
                n_vmas += 1
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                current = path if path.startswith(_SHM_PREFIXES) else None
                vma_range = parts[0]
                pss = anon = 0
            elif current is not None and line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif current is not None and line.startswith("Anonymous:"):
                anon = int(line.split()[1])
    close_vma()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(_SHM_PREFIXES):
            found = _file_key(f"/proc/{pid}/fd/{fd}")
            if found is not None:
                files[found[0]] = found[1]
    return mapped if n_vmas else None


def _memory_snapshot(store_dir: str | None) -> dict[str, Any]:
    """
    Memory of this process and its children (DataLoader workers, a Manager server).

    ``pss_bytes`` is the sum of their ``Pss:`` (``/proc/<pid>/smaps_rollup``). The footprint counts what the cache
    can change: the PSS of anonymous and shared-memory pages (``Pss_Anon + Pss_Shmem``; the file pages of libraries
    are left out: they are the same in every path, and their PSS depends on the unrelated processes of the machine
    that map the same libraries), where the PSS of the mapped pages of shared-memory files is replaced by the whole
    allocated size of every shared-memory file these processes map or hold open, and of every file of the store:
    such pages exist, mapped or not (the store's files, torch's shared-memory segments held by a descriptor only).
    """
    me = os.getpid()
    files: dict[tuple[int, int], int] = {}
    pss = anon_shmem = mapped = 0
    per_process = {}
    complete = True  # False if a process exited while it was being read (its numbers would not add up)
    for pid in [me] + _children(me):
        try:
            mapped_kib = _shm_usage(pid, files)  # the mappings first: an exiting process loses them first
            rollup = _rollup_kib(pid)
        except OSError:  # the process just exited
            complete = False
            continue
        if mapped_kib is None or "Pss" not in rollup:
            complete = False
            continue
        pss += rollup.get("Pss", 0)
        anon_shmem += rollup.get("Pss_Anon", 0) + rollup.get("Pss_Shmem", 0)
        mapped += mapped_kib
        per_process[str(pid)] = rollup
    if store_dir:
        for root, _, names in os.walk(store_dir):
            for name in names:
                found = _file_key(os.path.join(root, name))
                if found is not None:
                    files[found[0]] = found[1]
    shm = sum(files.values())
    return {
        "complete": complete,
        "n_processes": len(per_process),
        "pss_bytes": pss * 1024,
        "pss_anon_shmem_bytes": anon_shmem * 1024,
        "shm_mapped_pss_bytes": mapped * 1024,
        "shm_file_bytes": shm,
        "footprint_bytes": (anon_shmem - mapped) * 1024 + shm,
        "per_process_pss_kib": per_process,
    }


# ---------------------------------------------------------------------------------------------------------------------
# jobs (each runs in its own subprocess, with PYTHONPATH set to one tree)


def _job_setup() -> dict[str, Any]:
    import torch

    import monai

    torch.set_num_threads(1)  # as in DataLoader workers; also keeps timings stable on a shared 2-core machine
    info = {"monai_version": monai.__version__, "monai_file": monai.__file__, "torch_version": torch.__version__}
    store_file = Path(monai.__file__).parent / "data" / "cache_store.py"
    if store_file.exists():  # which version of the store was measured (it may be edited between runs)
        info["cache_store_sha256"] = hashlib.sha256(store_file.read_bytes()).hexdigest()[:16]
    return info


def _compute_times(cfg: dict, numpy_items: bool, n: int) -> tuple[list[float], int]:
    """Seconds to run the cached (deterministic) transforms on one input, ``n`` times; and the item's nbytes."""
    tr, first_random = _transforms(cfg["roi"], numpy_items)
    times, nbytes = [], 0
    for i in range(n):
        start = time.perf_counter()
        item = tr(_inputs(cfg, 1, start=1000 + i)[0], end=first_random)
        times.append(time.perf_counter() - start)
        nbytes = _item_nbytes(item)
        del item
    return times, nbytes


def job_micro_fork(cfg: dict) -> dict[str, Any]:
    """
    Paths 1, 2 and 5 (fork tree), and 6 with ``--store-root``: fill, raw write vs plain write, and hits interleaved
    path by path (so that their ratios see the same load).
    """
    info = _job_setup()
    from monai.data import CacheDataset
    from monai.data.cache_store import SharedCacheStore

    reps, fill_n, warmup = cfg["reps"], cfg["fill_n"], 2
    inputs = _inputs(cfg, fill_n)
    compute, nbytes = _compute_times(cfg, False, cfg["compute_n"])
    tr, first_random = _transforms(cfg["roi"], False)
    res: dict[str, Any] = {"info": info, "item_nbytes": nbytes, "paths": {}}
    roots = {"store": None}
    if cfg.get("store_root"):
        roots["store_root"] = cfg["store_root"]

    # fill: eager (the constructor computes every item) and store (the first read of each item is a miss)
    start = time.perf_counter()
    eager = CacheDataset(inputs, tr, copy_cache=False, progress=False, num_workers=1)
    fills: dict[str, list[float]] = {"private": [(time.perf_counter() - start) / fill_n]}
    stores: dict[str, Any] = {}
    for name, root in roots.items():
        cache = "process" if root is None else SharedCacheStore(root=root)
        stores[name] = CacheDataset(inputs, tr, runtime_cache=cache, progress=False)
        fills[name] = []
        for i in range(fill_n):
            start = time.perf_counter()
            _hit(stores[name], i)
            fills[name].append(time.perf_counter() - start)

    # raw write of one computed item: list assignment / store.put, against a plain os.write of the same bytes
    item = tr(_inputs(cfg, 1)[0], end=first_random)
    arrays = _item_arrays(item)
    lst: list[Any] = [None]
    writes: dict[str, list[float]] = {"private": []}
    plains: dict[str, list[float]] = {}
    file_bytes = 0
    for r in range(cfg["compute_n"] + 2):
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
            store.put(0, key, item)
            writes[name].append(time.perf_counter() - start)
            file_bytes = store.stats()["nbytes"]
            plains[name].append(_plain_write(os.path.dirname(store.path), arrays))
            store.invalidate([key], [])
        store.close()
    plains["private"] = plains["store"]
    del arrays

    # hits, interleaved: private no-copy, private copy (same list, copy_cache toggled), store(s)
    counter = _DeepcopyCounter()
    datasets = {"private_nocopy": (eager, False), "private_copy": (eager, True)}
    datasets.update({name: (ds, True) for name, ds in stores.items()})
    hits: dict[str, list[float]] = {p: [] for p in datasets}
    faults: dict[str, int] = dict.fromkeys(datasets, 0)
    copies: dict[str, int] = dict.fromkeys(datasets, 0)
    for r in range(warmup + reps):
        for name, (ds, copy_cache) in datasets.items():
            ds.copy_cache = copy_cache
            f0, c0 = _minflt(), counter.count
            start = time.perf_counter()
            _hit(ds)
            elapsed = time.perf_counter() - start
            if r >= warmup:
                hits[name].append(elapsed)
                faults[name] += _minflt() - f0
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
        ds = CacheDataset(_inputs(cfg, n_first, start=10_000), tr, runtime_cache=cache, progress=False)
        for i in range(n_first):
            cast(Any, ds._runtime).put(i, ds._runtime_keys[i], item)
        first_sets[name] = ds
    del item
    eager.copy_cache = False
    for i in range(n_first):
        start = time.perf_counter()
        _hit(eager)
        first["private_nocopy"].append(time.perf_counter() - start)
        for name, ds in first_sets.items():
            f0 = _minflt()
            start = time.perf_counter()
            _hit(ds, i)
            first[name].append(time.perf_counter() - start)
            first_faults[name] += _minflt() - f0
    for ds in first_sets.values():
        cast(Any, ds._runtime).invalidate(ds._runtime_keys, [])
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
    res["paths"]["store"]["reads_are_private"] = bool(stores["store"]._runtime.reads_are_private)
    res["paths"]["store"]["file_bytes_per_item"] = file_bytes
    try:  # uses private functions of cache_store: informative only
        res["breakdown"] = _breakdown(eager, stores["store"], tr, first_random, reps)
    except Exception as err:
        res["breakdown_error"] = f"{type(err).__name__}: {err}"
    return res


def _breakdown(eager: Any, store_ds: Any, tr: Any, first_random: int, reps: int) -> dict[str, Any]:
    """Where the time of one hit goes, for the floor and for the store: read, crop, copy, release; page faults."""
    from monai.data import cache_format, cache_mapping

    slots, key = store_ds._runtime, store_ds._runtime_keys[0]
    item_path = slots._item_path(key)
    steps: dict[str, dict[str, list[float]]] = {"private_nocopy": {}, "store": {}}

    def record(path: str, step: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        f0 = _minflt()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        elapsed = time.perf_counter() - start
        steps[path].setdefault(step, []).append(elapsed)
        steps[path].setdefault(step + " faults", []).append(float(_minflt() - f0))
        return out

    cached = eager._cache
    for _ in range(reps):
        data = record("private_nocopy", "read", cached.__getitem__, 0)
        out = record("private_nocopy", "crop", tr, data, start=first_random)
        record("private_nocopy", "copy", _collate_copy, out)
        del data, out

        raw = record("store", "open+mmap", cache_mapping._read_file, item_path)[0]
        data = record("store", "unpickle", cache_format._decode, raw, key)
        del raw
        out = record("store", "crop", tr, data, start=first_random)
        record("store", "copy", _collate_copy, out)
        start = time.perf_counter()
        del data, out  # the last views of the mapping: munmap
        steps["store"].setdefault("release", []).append(time.perf_counter() - start)
        record("store", "get() total", slots.get, 0, key)
    return {path: {step: _median(v) for step, v in d.items()} for path, d in steps.items()}


def job_micro_upstream(cfg: dict) -> dict[str, Any]:
    """Paths 3 and 4 (upstream tree), one after the other: fill, ``ListProxy`` write vs plain write, hits."""
    info = _job_setup()
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
    compute, _ = _compute_times(cfg, spec["numpy"], cfg["compute_n"])
    tr, first_random = _transforms(cfg["roi"], spec["numpy"])

    # upstream 1.6.1 makes a Manager().list() for runtime_cache="process"
    ds = CacheDataset(_inputs(cfg, fill_n), tr, runtime_cache="process", copy_cache=spec["copy_cache"], progress=False)
    fill = []
    for i in range(fill_n):
        start = time.perf_counter()
        _hit(ds, i)
        fill.append(time.perf_counter() - start)

    item = tr(_inputs(cfg, 1)[0], end=first_random)
    arrays = _item_arrays(item)
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
        plain.append(_plain_write(shm, arrays))
    lst[0] = None
    manager.shutdown()
    del item, arrays

    counter = _DeepcopyCounter()
    hits, faults = [], 0
    for r in range(warmup + reps):
        f0 = _minflt()
        start = time.perf_counter()
        _hit(ds)
        elapsed = time.perf_counter() - start
        if r >= warmup:
            hits.append(elapsed)
            faults += _minflt() - f0
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


def job_epoch(cfg: dict) -> dict[str, Any]:
    """
    A cold and a few warm epochs with 2 persistent DataLoader workers over ``items`` cached items (timed), then the
    memory of the main process and its children during one more warm epoch read by 2 fresh workers. ``path="baseline"``: the same loader and
    crop over a plain ``Dataset`` of one crop-sized item made before the workers start (no cache, no compute), whose
    memory is subtracted as that of the runtime (interpreter, torch, workers, batches in flight).
    """
    started = time.perf_counter()
    info = _job_setup()
    from monai.data import CacheDataset, DataLoader, Dataset
    from monai.transforms import Compose, Transform

    name = cfg["path"]
    n_items = cfg["items"]
    inputs = _inputs(cfg, n_items)
    if name == "baseline":
        make, first_random = _transforms(cfg["roi"], False)
        fixed = make(_inputs(cfg, 1, shape=cfg["roi"])[0], end=first_random)

        class Fixed(Transform):
            """Returns the same pre-made item (shared with the forked workers) whatever the input."""

            def __call__(self, data: dict) -> dict:
                return dict(fixed)

        ds: Any = Dataset(inputs, Compose([Fixed(), make.transforms[first_random]]))
        one_copy = _item_nbytes(fixed)
    else:
        spec = PATHS[name]
        tr, _ = _transforms(cfg["roi"], spec["numpy"])
        one_copy = n_items * _expected_nbytes(cfg["shape"])
        ds = CacheDataset(
            inputs,
            tr,
            runtime_cache=spec["runtime_cache"],
            copy_cache=spec["copy_cache"],
            progress=False,
            num_workers=2,
        )
    slots = getattr(ds, "_runtime", None)
    store_dir = getattr(slots, "path", None)
    phases = {"setup": time.perf_counter() - started}

    def epoch(loader: Any) -> float:
        start = time.perf_counter()
        for batch in loader:
            del batch
        return time.perf_counter() - start

    loader = DataLoader(ds, batch_size=1, shuffle=False, num_workers=2, persistent_workers=True)
    cold = epoch(loader)
    phases["cold"] = cold
    warm = [epoch(loader) for _ in range(cfg["epochs"])]
    phases["warm"] = sum(warm)
    shutdown = getattr(loader._iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    del loader
    gc.collect()
    _malloc_trim()
    # memory: a warm epoch read by 2 fresh workers (forked now, as at every epoch without persistent workers), so
    # that what computing the items in the cold epoch left in the workers' malloc heaps is not counted. Memory is
    # sampled in the main process right after the first batch arrives, then continuously by a thread while the
    # workers read; the epoch visits the items over and over until enough samples are taken (or 400 batches).
    start = time.perf_counter()
    order = list(range(n_items)) * max(1, -(-400 // n_items))
    fresh = DataLoader(ds, batch_size=1, sampler=order, num_workers=2, persistent_workers=False)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            samples.append(_memory_snapshot(store_dir))

    thread = threading.Thread(target=sampler, daemon=True)
    batches = iter(fresh)
    for i, batch in enumerate(batches):
        del batch
        if i == 0:
            samples.append(_memory_snapshot(store_dir))
            thread.start()
        elif i >= 16 and sum(x["complete"] for x in samples) >= cfg["memory_samples"]:
            break
    stop.set()
    thread.join()
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    phases["memory"] = time.perf_counter() - start
    # only the samples taken while all the processes of the first one were alive (not while the workers exit)
    valid = [x for x in samples if x["complete"] and x["n_processes"] >= samples[0]["n_processes"]] or samples[:1]
    ordered = sorted(valid, key=lambda x: x["footprint_bytes"])
    del batches, fresh
    gc.collect()
    return {
        "info": info,
        "cold_epoch_s": cold,
        "warm_epoch_s": warm,
        "one_copy_bytes": one_copy,
        "memory_first_batch": samples[0],
        "memory_median": ordered[(len(ordered) - 1) // 2],
        "memory_peak": ordered[-1],
        "memory_samples": samples,
        "memory_valid_samples": len(valid),
        "phases_s": phases,
    }


def job_small(cfg: dict) -> dict[str, Any]:
    """
    Many small items in the store under ``RLIMIT_NOFILE=1024``: fill, then read every item once and keep it alive
    (an open descriptor per item would exceed the limit); also a few thousand mapped items (over 64 KiB) kept alive.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    info = _job_setup()
    import numpy as np

    from monai.data import CacheDataset
    from monai.transforms import Compose, ToTensord

    def run(n: int, nbytes: int) -> dict[str, Any]:
        res: dict[str, Any] = {"n": n, "item_bytes": nbytes, "error": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                # each input carries its own vector (nbytes, filled with its number); the cached item is its tensor
                data = [{"x": np.full(nbytes // 4, i, dtype=np.float32)} for i in range(n)]
                tr = Compose([ToTensord(keys="x", track_meta=False)])
                ds = CacheDataset(data, tr, runtime_cache="process", progress=False)
                gc.collect()
                gc.disable()  # as timeit does: the collector's passes grow with the items kept alive below
                fill_times: list[float] = []
                kept: list[Any] = []
                times: list[float] = []
                try:
                    for i in range(n):
                        start = time.perf_counter()
                        ds[i]
                        fill_times.append(time.perf_counter() - start)
                    for i in range(n):
                        start = time.perf_counter()
                        item = ds[i]
                        times.append(time.perf_counter() - start)
                        kept.append(item)
                finally:
                    gc.enable()
                res["fill_s"] = sum(fill_times)
                res["correct"] = all(float(kept[i]["x"][-1]) == float(i) for i in range(n))
                res["open_fds_with_items_alive"] = len(os.listdir("/proc/self/fd"))
                res["store"] = cast(Any, ds._runtime).stats()
                head = min(1000, n // 2)
                res["seq_hit_first_s"] = _median(times[:head])
                res["seq_hit_last_s"] = _median(times[-head:])
                res["hit_all_s"] = _median(times)
                # the first and the last items again, alternately (with all the items alive), so that a drift of
                # the machine's load over the sequential pass does not pass for a dependence on the item
                first_t: list[float] = []
                last_t: list[float] = []
                gc.disable()
                try:
                    for k in range(head):
                        for index, out in ((k, first_t), (n - head + k, last_t)):
                            start = time.perf_counter()
                            ds[index]
                            out.append(time.perf_counter() - start)
                finally:
                    gc.enable()
                res["hit_first_s"] = _median(first_t)
                res["hit_last_s"] = _median(last_t)
                res["fill_first_s"] = _median(fill_times[:head])
                res["fill_last_s"] = _median(fill_times[-head:])
                del kept, ds, data
            except Exception as err:  # reported, not raised: the report must be written
                res["error"] = f"{type(err).__name__}: {err}"
            res["warnings"] = [str(w.message)[:300] for w in caught]
        gc.collect()
        return res

    return {
        "info": info,
        "nofile_limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "small": run(cfg["n_small"], 1024),
        "mapped": run(cfg["n_mapped"], 96 * 1024),
    }


JOBS: dict[str, Callable[[dict], dict[str, Any]]] = {
    "micro_fork": job_micro_fork,
    "micro_upstream": job_micro_upstream,
    "epoch": job_epoch,
    "small": job_small,
}


def _run_job_main(job: str, cfg_path: str, result_path: str) -> int:
    with open(cfg_path) as f:
        cfg = json.load(f)
    if os.environ.get("MONAI_BENCH_NO_POOL"):  # --no-pool: every mapping is made anew and unmapped after use
        try:
            from monai.data import cache_mapping

            cache_mapping._POOL.MIN_SIZE = sys.maxsize
        except ImportError:  # the upstream tree
            pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            result = JOBS[job](cfg)
        except Exception:
            result = {"error": traceback.format_exc()}
    messages = sorted({f"{w.category.__name__}: {w.message}"[:400] for w in caught})
    result["job_warnings"] = messages
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# driver


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run_subprocess(job: str, tree: Path, cfg: dict, out_dir: Path, timeout: float) -> dict[str, Any]:
    """Run one job in a subprocess with ``PYTHONPATH=tree``; returns its result (or an ``error`` entry)."""
    label = f"{job} {cfg.get('path', '')}".strip()
    _log(f"start {label} ({tree.name})")
    work = out_dir / "jobs"
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{job}-{cfg.get('path', 'all')}"
    cfg_file, result_file = work / f"{tag}.cfg.json", work / f"{tag}.result.json"
    cfg_file.write_text(json.dumps(cfg))
    result_file.unlink(missing_ok=True)
    # bytecode of both trees is cached under the output directory, not in the trees (whatever PYTHONDONTWRITEBYTECODE)
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(out_dir / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", job, str(cfg_file), str(result_file)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(out_dir), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        _log(f"TIMEOUT {label} after {timeout:.0f} s")
        return {"error": f"timed out after {timeout:.0f} s"}
    elapsed = time.perf_counter() - start
    (out_dir / "logs").mkdir(exist_ok=True)
    (out_dir / "logs" / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result_file.exists():
        _log(f"FAILED {label} (exit {proc.returncode})")
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    result = json.loads(result_file.read_text())
    if "error" in result and isinstance(result["error"], str):
        _log(f"ERROR in {label}: {result['error'].strip().splitlines()[-1]}")
    else:
        _log(f"done  {label} in {elapsed:.1f} s")
    return result


def _is_pristine(tree: Path) -> bool:
    """Whether ``tree`` holds exactly the files of the upstream wheel (checked against its ``RECORD`` hashes)."""
    records = list(tree.glob("monai-*.dist-info/RECORD"))
    if len(records) != 1:
        return False
    listed = set()
    for line in records[0].read_text().splitlines():
        path, digest = line.rsplit(",", 2)[:2]
        listed.add(path)
        if not digest:
            continue
        algo, _, expected = digest.partition("=")
        try:
            data = (tree / path).read_bytes()
        except OSError:
            return False
        actual = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
        if actual != expected:
            return False
    present = {
        str(p.relative_to(tree)) for p in (tree / "monai").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    return present <= listed


def _prepare_trees(args: argparse.Namespace, out_dir: Path) -> Path | None:
    """Refresh the fork's tree (``layout --if-stale``) and unpack the pristine upstream tree unless it is intact."""
    if not args.no_refresh:
        subprocess.run([sys.executable, str(BUILD_SCRIPT), "layout", "--if-stale"], check=True, cwd=str(REPO))
    if args.skip_upstream:
        return None
    upstream = out_dir / "upstream-tree"
    if not _is_pristine(upstream):  # kept otherwise, so that its cached bytecode stays valid
        _log(f"unpacking upstream 1.6.1 into {upstream}")
        cmd = [sys.executable, str(BUILD_SCRIPT), "pristine", str(upstream)]
        subprocess.run(cmd, check=True, cwd=str(REPO), capture_output=True)
        if not _is_pristine(upstream):
            raise RuntimeError(f"{upstream} does not match the RECORD of the upstream wheel")
    return upstream


def _config(args: argparse.Namespace) -> dict[str, Any]:
    if args.small:
        cfg = {"shape": [96, 96, 64], "roi": [48, 48, 48], "reps": 40, "items": 16, "fill_n": 3, "compute_n": 3}
        cfg["first_reps"] = 20
    else:
        cfg = {"shape": [240, 240, 155], "roi": [96, 96, 96], "reps": 25, "items": 4, "fill_n": 3, "compute_n": 3}
        cfg["first_reps"] = 10  # items of 145 MiB each in /dev/shm during that part
    cfg["epochs"] = args.epochs
    cfg["memory_samples"] = 6 if args.small else 10
    cfg["data_dir"] = str(Path(args.out_dir).resolve() / "data")
    cfg["n_small"], cfg["n_mapped"] = args.small_items, args.mapped_items
    if args.reps is not None:
        cfg["reps"] = args.reps
    if args.items is not None:
        cfg["items"] = args.items
    cfg["store_root"] = os.path.abspath(args.store_root) if args.store_root else None
    return cfg


def _ms(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def _summarize(raw: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios and targets from the raw job results."""
    paths: dict[str, dict[str, Any]] = {}
    micro = [raw.get("micro_fork", {}), raw.get("micro_upstream", {})]
    compute_by_path: dict[str, float] = {}
    item_nbytes = None
    for result in micro:
        for name, p in result.get("paths", {}).items():
            paths[name] = {
                "hit_s": _median(p["hit_s"]),
                "hit_min_s": min(p["hit_s"]),
                "fill_s": _median(p["fill_s"]),
                "write_s": _median(p["write_s"]),
                "plain_write_s": _median(p["plain_write_s"]),
                "minflt_per_hit": p["minflt_per_hit"],
                "deepcopies_per_hit": p["deepcopies_per_hit"],
            }
            if "first_read_s" in p:
                paths[name]["first_read_s"] = _median(p["first_read_s"])
                paths[name]["first_read_x_floor"] = _median(p["first_read_s"]) / _median(p["first_read_floor_s"])
                paths[name]["first_read_minflt"] = p["first_read_minflt"]
            compute_by_path[name] = _median(p["compute_s"])
            item_nbytes = item_nbytes or result.get("item_nbytes")
    for name, p in paths.items():
        p["compute_s"] = compute_by_path[name]
        p["fill_ratio"] = p["write_s"] / p["plain_write_s"]
    floor = paths.get("private_nocopy", {}).get("hit_s", float("nan"))
    for p in paths.values():
        p["hit_x_floor"] = p["hit_s"] / floor
    # memory: the median (and the peak) of the samples of the warm epoch; net = footprint less the baseline's runtime
    base = raw.get("epoch_baseline", {})
    runtime: dict[str, int] = {}
    summary_base: dict[str, Any] = {}
    if "memory_median" in base:  # the runtime: the baseline's footprint less its one pre-made item
        runtime = {s: base[f"memory_{s}"]["footprint_bytes"] - base["one_copy_bytes"] for s in ("median", "peak")}
        mid = base["memory_median"]
        summary_base = {
            "cold_epoch_s": base["cold_epoch_s"],
            "warm_epoch_s": _median(base["warm_epoch_s"]),
            "n_processes": mid["n_processes"],
            "pss_bytes": mid["pss_bytes"],
            "shm_file_bytes": mid["shm_file_bytes"],
            "footprint_bytes": mid["footprint_bytes"],
            "runtime_bytes": runtime["median"],
            "memory_samples": base["memory_valid_samples"],
        }
    for name in PATHS:
        ep = raw.get(f"epoch_{name}")
        if not ep or "error" in ep:
            continue
        p = paths.setdefault(name, {})
        mid = ep["memory_median"]
        p["cold_epoch_s"] = ep["cold_epoch_s"]
        p["warm_epoch_s"] = _median(ep["warm_epoch_s"])
        p["n_processes"] = mid["n_processes"]
        p["pss_bytes"] = mid["pss_bytes"]
        p["shm_file_bytes"] = mid["shm_file_bytes"]
        p["footprint_bytes"] = mid["footprint_bytes"]
        p["one_copy_bytes"] = ep["one_copy_bytes"]
        p["memory_samples"] = ep["memory_valid_samples"]
        if runtime:
            p["net_bytes"] = mid["footprint_bytes"] - runtime["median"]
            p["net_x_copy"] = p["net_bytes"] / ep["one_copy_bytes"]
            p["net_peak_bytes"] = ep["memory_peak"]["footprint_bytes"] - runtime["peak"]
            p["net_peak_x_copy"] = p["net_peak_bytes"] / ep["one_copy_bytes"]
    for p in paths.values():
        if "warm_epoch_s" in p and "warm_epoch_s" in paths.get("private_nocopy", {}):
            p["warm_x_floor"] = p["warm_epoch_s"] / paths["private_nocopy"]["warm_epoch_s"]

    def ratio(a: str, b: str) -> float | None:
        if a in paths and b in paths and "hit_s" in paths[a] and "hit_s" in paths[b]:
            return float(paths[a]["hit_s"] / paths[b]["hit_s"])
        return None

    store = paths.get("store", {})
    small = raw.get("small", {})
    checks: list[dict[str, Any]] = []
    T = TARGETS

    def check(name: str, desc: str, value: float | None, limit: float, at_most: bool, unit: str = "x") -> None:
        if value is None or value != value:
            status = "SKIP"
        else:
            status = "PASS" if (value <= limit if at_most else value >= limit) else "FAIL"
        sign = "<=" if at_most else ">="
        shown = "n/a" if value is None or value != value else f"{value:.2f}{unit}"
        checks.append({"name": name, "status": status, "value": value, "limit": limit, "text": desc, "shown": shown})
        checks[-1]["line"] = f"{status}  {desc}: {shown} ({sign} {limit:g}{unit})"

    check(
        "hit_vs_floor",
        "store hit+crop vs private no-copy floor",
        ratio("store", "private_nocopy"),
        T["hit_vs_floor"],
        True,
    )
    check(
        "speedup_vs_copy",
        "store speed-up vs private copy_cache=True",
        ratio("private_copy", "store"),
        T["speedup_vs_copy"],
        False,
    )
    check(
        "speedup_vs_upstream_numpy",
        "store speed-up vs upstream ListProxy numpy items",
        ratio("upstream_numpy", "store"),
        T["speedup_vs_upstream_numpy"],
        False,
    )
    check(
        "fill_ratio", "store write vs plain os.write of the same bytes", store.get("fill_ratio"), T["fill_ratio"], True
    )
    check(
        "pss_ratio",
        "main + 2 workers footprint (net, median of the warm-epoch samples) vs one copy",
        store.get("net_x_copy"),
        T["pss_ratio"],
        True,
    )
    s = small.get("small", {}) if isinstance(small, dict) else {}
    flat = None
    if s and not s.get("error") and s.get("correct") and not s.get("warnings") and s.get("hit_first_s"):
        flat = s["hit_last_s"] / s["hit_first_s"]
    check(
        "small_flat",
        f"{cfg['n_small']:,} small items, ulimit -n 1024: no error, last/first 1,000 hit time",
        flat if s else None,
        T["small_flat"],
        True,
    )
    if s and flat is None:
        checks[-1]["status"] = "FAIL"
        checks[-1]["line"] = "FAIL" + checks[-1]["line"][4:] + f" [error: {s.get('error') or s.get('warnings')}]"
    return {"paths": paths, "baseline": summary_base, "item_nbytes": item_nbytes, "checks": checks}


def _tables(summary: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    paths = summary["paths"]
    head1 = [
        "path",
        "hit ms",
        "x floor",
        "1st read ms",
        "1st x floor",
        "store speed-up",
        "deepcopy/hit",
        "faults/hit",
        "compute ms",
        "fill ms",
        "write ms",
        "plain ms",
        "fill ratio",
    ]
    head2 = ["path", "cold epoch s", "warm epoch s", "x floor", "procs", "PSS MiB", "shm MiB", "footprint MiB"]
    head2 += ["net MiB", "x copy", "peak x copy", "samples"]
    rows1, rows2 = [], []
    b = summary.get("baseline")
    if b:
        rows2.append(
            [
                "0. baseline: no cache, one pre-made crop",
                _fmt(b["cold_epoch_s"]),
                _fmt(b["warm_epoch_s"], ".3f"),
                "",
                str(b["n_processes"]),
                _fmt(b["pss_bytes"] / MIB, ".0f"),
                _fmt(b["shm_file_bytes"] / MIB, ".0f"),
                _fmt(b["footprint_bytes"] / MIB, ".0f"),
                "(runtime)",
                "",
                "",
                str(b["memory_samples"]),
            ]
        )
    store_hit = paths.get("store", {}).get("hit_s")
    for name, spec in ALL_PATHS.items():
        p = paths.get(name)
        if not p:
            if name in PATHS:
                rows1.append([spec["label"], "skipped/error"] + [""] * (len(head1) - 2))
                rows2.append([spec["label"], "skipped/error"] + [""] * (len(head2) - 2))
            continue
        if "hit_s" in p:
            speed = p["hit_s"] / store_hit if store_hit else None
            rows1.append(
                [
                    spec["label"],
                    _ms(p["hit_s"]),
                    _fmt(p["hit_x_floor"]),
                    _ms(p["first_read_s"]) if "first_read_s" in p else "-",
                    _fmt(p["first_read_x_floor"]) if "first_read_s" in p else "-",
                    _fmt(speed, ".1f", "x") if name != "store" else "1x",
                    _fmt(p["deepcopies_per_hit"], ".0f"),
                    _fmt(p["minflt_per_hit"], ".0f"),
                    _ms(p["compute_s"]),
                    _ms(p["fill_s"]),
                    _ms(p["write_s"]),
                    _ms(p["plain_write_s"]),
                    _fmt(p["fill_ratio"]),
                ]
            )
        else:
            rows1.append([spec["label"], "error"] + [""] * (len(head1) - 2))
        if "warm_epoch_s" in p:
            rows2.append(
                [
                    spec["label"],
                    _fmt(p["cold_epoch_s"]),
                    _fmt(p["warm_epoch_s"], ".3f"),
                    _fmt(p.get("warm_x_floor")),
                    str(p["n_processes"]),
                    _fmt(p["pss_bytes"] / MIB, ".0f"),
                    _fmt(p["shm_file_bytes"] / MIB, ".0f"),
                    _fmt(p["footprint_bytes"] / MIB, ".0f"),
                    _fmt(p.get("net_bytes", float("nan")) / MIB, ".0f"),
                    _fmt(p.get("net_x_copy"), ".3f"),
                    _fmt(p.get("net_peak_x_copy"), ".3f"),
                    str(p["memory_samples"]),
                ]
            )
        elif name in PATHS:
            rows2.append([spec["label"], "error"] + [""] * (len(head2) - 2))
    return head1, rows1, head2, rows2


def _plain_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _small_lines(raw: dict[str, Any]) -> list[str]:
    small = raw.get("small", {})
    if not small or isinstance(small.get("error"), str):
        return [f"small items: job error: {small.get('error', 'not run')}"]
    lines = [f"small-item job: RLIMIT_NOFILE soft limit {small['nofile_limit'][0]}"]
    for key in ("small", "mapped"):
        s = small[key]
        if s.get("error"):
            lines.append(f"  {s['n']:,} x {s['item_bytes'] // 1024} KiB: ERROR {s['error']}")
            continue
        lines.append(
            f"  {s['n']:,} x {s['item_bytes'] // 1024} KiB items: fill {s['fill_s']:.1f} s, "
            f"median hit of the first 1,000 {s['hit_first_s'] * 1e6:.0f} us, of the last 1,000 "
            f"{s['hit_last_s'] * 1e6:.0f} us (ratio {s['hit_last_s'] / s['hit_first_s']:.2f}; in the sequential pass "
            f"{s['seq_hit_first_s'] * 1e6:.0f} -> {s['seq_hit_last_s'] * 1e6:.0f} us, fill "
            f"{s['fill_first_s'] * 1e6:.0f} -> {s['fill_last_s'] * 1e6:.0f} us), all kept alive: "
            f"{s['open_fds_with_items_alive']} "
            f"open fds, values correct: {s['correct']}, warnings: {len(s['warnings'])}"
        )
    return lines


def _breakdown_lines(raw: dict[str, Any]) -> list[str]:
    b = raw.get("micro_fork", {}).get("breakdown")
    if not b:
        return []
    lines = ["hit breakdown (median ms; minor page faults):"]
    for path, steps in b.items():
        parts = [f"{k} {v * 1e3:.3f}" for k, v in steps.items() if not k.endswith("faults")]
        faults = [f"{k.replace(' faults', '')} {v:.0f}" for k, v in steps.items() if k.endswith("faults")]
        lines.append(f"  {path}: " + ", ".join(parts))
        lines.append(f"  {'':{len(path)}}  faults: " + ", ".join(faults))
    return lines


def _notes(summary: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Informative ratios that are not targets."""
    lines = []
    if cfg["shape"] != [240, 240, 155]:
        lines.append(
            "NOTE  items smaller than 4x240x240x155: the copies the store avoids are cheap, so the speed-up targets "
            "(calibrated for the full-size item) may fail; judge the targets on a full run"
        )
    for name in ("store", "store_root"):
        p = summary["paths"].get(name, {})
        if "first_read_x_floor" in p:
            lines.append(
                f"INFO  {ALL_PATHS[name]['short']}: first read of an item in a process (new file, nothing kept from "
                f"earlier reads) vs floor: {p['first_read_x_floor']:.2f}x ({p['first_read_minflt']:.0f} page faults)"
            )
    return lines


def _plot(summary: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot ({err}); pip install matplotlib"
    names = [n for n in ALL_PATHS if "hit_s" in summary["paths"].get(n, {})]
    mem = [n for n in PATHS if "net_bytes" in summary["paths"].get(n, {})]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {
        n: "tab:green" if n.startswith("store") else "tab:gray" if n.startswith("private") else "tab:red"
        for n in ALL_PATHS
    }
    hits = [summary["paths"][n]["hit_s"] * 1e3 for n in names]
    ax1.bar(range(len(names)), hits, color=[colors[n] for n in names])
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(names)), [ALL_PATHS[n]["short"] for n in names], rotation=20, ha="right")
    ax1.set_ylabel("ms per hit (read + crop + copy), log scale")
    ax1.set_title("per-hit time (median)")
    for i, v in enumerate(hits):
        ax1.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    if mem:
        vals = [summary["paths"][n]["net_bytes"] / MIB for n in mem]
        ax2.bar(range(len(mem)), vals, color=[colors[n] for n in mem])
        one = summary["paths"][mem[0]]["one_copy_bytes"] / MIB
        ax2.axhline(one, color="k", linestyle="--", linewidth=1, label="one copy of the data")
        ax2.axhline(one * TARGETS["pss_ratio"], color="tab:green", linestyle=":", linewidth=1, label="1.15x target")
        ax2.set_xticks(range(len(mem)), [PATHS[n]["short"] for n in mem], rotation=20, ha="right")
        ax2.set_ylabel("MiB (PSS + shared-memory files - baseline)")
        ax2.set_title("main + 2 workers memory, warm epoch (median)")
        ax2.legend(fontsize=8)
        for i, v in enumerate(vals):
            ax2.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in load],
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="items of 4x96x96x64 (crop 48^3) for a quick run")
    parser.add_argument("--reps", type=int, help="timed hits per path (default 25, --small 40)")
    parser.add_argument("--items", type=int, help="items K in the DataLoader epochs (default 4, --small 16)")
    parser.add_argument("--epochs", type=int, default=3, help="timed warm epochs (median reported)")
    parser.add_argument("--small-items", type=int, default=20000, help="number of 1 KiB items of the fd test")
    parser.add_argument("--mapped-items", type=int, default=2000, help="number of 96 KiB (mapped) items kept alive")
    parser.add_argument("--store-root", help="also time the store with its files in this directory (path 6)")
    parser.add_argument("--skip-upstream", action="store_true", help="skip the upstream 1.6.1 ListProxy paths")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT), help="output directory (default benchmarks/output)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target fails")
    parser.add_argument("--no-pool", action="store_true", help="disable the store's mapping reuse (to measure it)")
    parser.add_argument("--no-refresh", action="store_true", help="do not refresh build/tree (layout --if-stale)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for each subprocess")
    parser.add_argument("--job", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return _run_job_main(*args.job)
    if args.no_pool:
        os.environ["MONAI_BENCH_NO_POOL"] = "1"  # read by every job subprocess
    if not sys.platform.startswith("linux"):
        print("this benchmark needs Linux (/proc, /dev/shm)", file=sys.stderr)
        return 2

    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = _config(args)
    started = time.perf_counter()
    machine = _machine()
    upstream = _prepare_trees(args, out_dir)
    raw: dict[str, Any] = {}
    raw["micro_fork"] = _run_subprocess("micro_fork", FORK_TREE, cfg, out_dir, args.timeout)
    if upstream is not None:
        raw["micro_upstream"] = _run_subprocess("micro_upstream", upstream, cfg, out_dir, args.timeout)
    raw["epoch_baseline"] = _run_subprocess("epoch", FORK_TREE, dict(cfg, path="baseline"), out_dir, args.timeout)
    for name, spec in PATHS.items():
        if spec["tree"] == "upstream" and upstream is None:
            continue
        tree = FORK_TREE if spec["tree"] == "fork" else upstream
        assert tree is not None
        raw[f"epoch_{name}"] = _run_subprocess("epoch", tree, dict(cfg, path=name), out_dir, args.timeout)
    raw["small"] = _run_subprocess("small", FORK_TREE, cfg, out_dir, args.timeout)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(value.get("error"), str):
            print(f"\n!! {key} failed:\n{value['error']}", file=sys.stderr)
        for message in value.get("job_warnings", []) if isinstance(value, dict) else []:
            if "monai" in message.lower() or "cache" in message.lower():
                _log(f"warning in {key}: {message}")

    summary = _summarize(raw, cfg)
    head1, rows1, head2, rows2 = _tables(summary)
    one_copy = next((p["one_copy_bytes"] for p in summary["paths"].values() if "one_copy_bytes" in p), 0)
    shape = "x".join(str(s) for s in [4, *cfg["shape"]])
    roi = "x".join(str(s) for s in cfg["roi"])
    item_mib = (summary["item_nbytes"] or 0) / MIB
    versions = {k: v.get("info", {}).get("monai_version") for k, v in raw.items() if isinstance(v, dict)}
    sha = raw.get("micro_fork", {}).get("info", {}).get("cache_store_sha256", "n/a")
    header = [
        f"item: image {shape} float32 + label 1x{'x'.join(map(str, cfg['shape']))} uint8 MetaTensors "
        f"({item_mib:.1f} MiB), random crop {roi} + torch.stack copy; {cfg['reps']} timed hits per path; "
        f"DataLoader: 2 workers, K={cfg['items']} items, batch 1, one copy = {one_copy / MIB:.0f} MiB",
        f"machine: {machine['cpus']} cores, {machine['mem_total_gib']} GiB, shared with other jobs "
        f"(load average {machine['loadavg'][0]} at start, {machine['loadavg_end'][0]} at end); "
        f"monai {versions.get('micro_fork')} (fork) vs {versions.get('micro_upstream', 'n/a')} (upstream); "
        f"fork cache_store.py sha256 {sha}",
    ]
    notes = _notes(summary, cfg)
    text = [
        *header,
        "",
        "per hit (read + crop + collate copy, median) and fill (first compute + store of one item)",
        _plain_table(head1, rows1),
        "",
        "DataLoader, 2 workers: epochs (persistent workers); memory of main + children during a warm epoch (median)",
        _plain_table(head2, rows2),
        "",
        *_small_lines(raw),
        "",
        *_breakdown_lines(raw),
        "",
        "TARGETS (ratios measured in this run):",
        *[f"  {c['line']}" for c in summary["checks"]],
        *[f"  {line}" for line in notes],
    ]
    elapsed = time.perf_counter() - started
    text.append(f"\ntotal time {elapsed:.0f} s")
    print("\n".join(text))

    plot_error = _plot(summary, out_dir / "bench_cache.png")
    if plot_error:
        print(plot_error, file=sys.stderr)
    command = "python benchmarks/bench_cache.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    md = [
        "# CacheDataset runtime cache benchmark",
        "",
        f"`{command.strip()}`",
        "",
        *[f"- {h}" for h in header],
        "",
        "## Per hit and fill",
        "",
        _md_table(head1, rows1),
        "",
        "## DataLoader epochs and memory",
        "",
        _md_table(head2, rows2),
        "",
        "## Many small items",
        "",
        *[f"    {line}" for line in _small_lines(raw)],
        "",
        "## Hit breakdown",
        "",
        *[f"    {line}" for line in _breakdown_lines(raw)],
        "",
        "## Targets",
        "",
        *[f"- **{c['status']}** {c['line'][6:]}" for c in summary["checks"]],
        *[f"- {line}" for line in notes],
        "",
        f"Total time {elapsed:.0f} s.",
        "",
    ]
    (out_dir / "results.md").write_text("\n".join(md))
    report = {"config": cfg, "machine": machine, "summary": summary, "raw": raw, "elapsed_s": elapsed}
    (out_dir / "results.json").write_text(json.dumps(report, indent=1, default=str))
    shutil.rmtree(out_dir / "jobs", ignore_errors=True)
    failed = [c for c in summary["checks"] if c["status"] == "FAIL"]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
