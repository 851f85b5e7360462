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
The benchmark of the ``CacheDataset`` runtime caches: the fork's store against private lists, upstream MONAI 1.6.1's
``Manager`` list, ``PersistentDataset`` and ``torch.save`` files, as ratios measured within one run (see README.md)::

    python benchmarks/bench_cache.py                      # full size, every section (about 6-9 minutes on 2 cores)
    python benchmarks/bench_cache.py --small              # the same code on small items (about 2-3 minutes)
    python benchmarks/bench_cache.py --sections hits,persistent

Every measurement runs in a subprocess of its own with ``PYTHONPATH`` set to one tree: the fork's laid-out
``build/tree`` (refreshed with ``layout --if-stale``) or pristine upstream 1.6.1 unpacked into
``benchmarks/output/upstream-tree``, so the upstream numbers are upstream code, and ``MONAI_CACHE_FAST_PATH`` (read at
the import of monai) is set for each job. Paths compared in one process alternate rep by rep, so that their ratio
sees the same machine load; medians are reported. Linux only (``/dev/shm``, ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FORK_TREE = REPO / "build" / "tree"
BUILD = REPO / "build_backend" / "monai_sharedcache_build.py"
SECTIONS = ("hits", "persistent", "eager", "ddp")
TARGETS = {  # name: (text, limit, "<=" or ">=")
    "hit": ("store hit + crop vs private-list floor (fast path)", 1.25, "<="),
    "persistent": ("persistent store warm read vs PersistentDataset (speed-up)", 10.0, ">="),
    "restart_computed": ("persistent store: items computed on restart", 0, "<="),
    "eager": ("eager hit (runtime_cache=False), fork vs upstream", 1.10, "<="),
}
_COMPUTED = [0]  # computations of the cached transforms in this process (the persistent jobs)


# ---------------------------------------------------------------------------------------------------------------------
# the jobs: each runs in a subprocess, with torch and one tree's monai


def data_files(data_dir: str, shape: list[int]) -> tuple[str, str]:
    """A synthetic 4-channel float32 image and 1-channel uint8 label of spatial ``shape`` (``.npy``, written once)."""
    import numpy as np

    tag = "x".join(map(str, shape))
    image, label = os.path.join(data_dir, f"image-4x{tag}.npy"), os.path.join(data_dir, f"label-1x{tag}.npy")
    if not (os.path.exists(image) and os.path.exists(label)):
        os.makedirs(data_dir, exist_ok=True)
        img = np.random.default_rng(0).standard_normal((4, *shape), dtype=np.float32)
        for path, arr in ((image, img), (label, (img[:1] > 1.0).astype(np.uint8))):
            np.save(f"{path}.{os.getpid()}.npy", arr)  # then renamed: jobs of another run may read it
            os.replace(f"{path}.{os.getpid()}.npy", path)
    return image, label


def inputs(cfg: dict, n: int, start: int = 0) -> list[dict]:
    """``n`` inputs naming the same files; the case number makes each one's key distinct."""
    image, label = data_files(cfg["data_dir"], cfg["shape"])
    return [{"image": image, "label": label, "case": start + i} for i in range(n)]


def count_computation(data: Any) -> Any:
    _COMPUTED[0] += 1
    return data


def transforms(roi: list[int], numpy_items: bool = False, count: bool = False) -> tuple[Any, int]:
    """A segmentation pipeline's cached steps, then a random crop: the ``Compose`` and its first random index."""
    import numpy as np

    from monai.transforms import Compose, EnsureTyped, Lambda, LoadImaged, NormalizeIntensityd, RandSpatialCropd

    keys = ["image", "label"]
    cached: list[Any] = [
        LoadImaged(keys="image", reader="NumpyReader", channel_dim=0, image_only=True, dtype=np.float32),
        LoadImaged(keys="label", reader="NumpyReader", channel_dim=0, image_only=True, dtype=np.uint8),
        NormalizeIntensityd(keys="image", channel_wise=True),
    ]
    if numpy_items:
        cached.append(EnsureTyped(keys=keys, data_type="numpy"))
    if count:
        cached.append(Lambda(func=count_computation))
    crop = RandSpatialCropd(keys=keys, roi_size=tuple(roi), random_size=False)
    return Compose([*cached, crop]), len(cached)


_BATCH: dict[tuple, Any] = {}


def collate_copy(item: dict) -> None:
    """A collate-like copy of the crop into a batch buffer allocated once, so that the allocator does not blur it."""
    import numpy as np
    import torch

    for key in ("image", "label"):
        value = item[key]
        value = torch.from_numpy(value) if isinstance(value, np.ndarray) else value.as_subclass(torch.Tensor)
        spec = (key, tuple(value.shape), value.dtype)
        if spec not in _BATCH:
            _BATCH[spec] = torch.empty((1, *value.shape), dtype=value.dtype)
        torch.stack([value], out=_BATCH[spec])


def hit(ds: Any, index: int = 0) -> None:
    """A cache hit as a training step sees it: ``ds[index]`` (read + random crop) + a collate-like copy."""
    collate_copy(ds[index])


def interleave(fns: dict[str, Callable[[int], Any]], reps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each ``fn(rep)``, called in turn rep by rep (the order reversed every other rep)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(warmup + reps):
        for name in names if r % 2 else names[::-1]:
            start = time.perf_counter()
            fns[name](r)
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def job_setup() -> dict[str, Any]:
    import torch

    import monai

    torch.set_num_threads(1)  # as in DataLoader workers; also steadier timings on a shared 2-core machine
    try:
        from monai_sharedcache import _pool

        fast_path: bool | None = bool(_pool.ENABLED)
    except ImportError:  # the upstream tree
        fast_path = None
    return {"monai": monai.__version__, "torch": torch.__version__, "fast_path": fast_path}


def job_hits(cfg: dict) -> dict[str, Any]:
    """
    In the fork's tree (with or without the fast path, as the driver set ``MONAI_CACHE_FAST_PATH``): a hit of the
    floor (a private list, ``copy_cache=False``), of the store and of ``copy_cache=True``; then the item format: the
    store's ``get``/``put`` against ``torch.save`` + ``torch.load(mmap=True, weights_only=True)`` of the same item, as
    ``PersistentDataset`` stores it (``convert_to_tensor``, plain tensors), in files on the store's file system.
    """
    res: dict[str, Any] = {"info": job_setup()}
    import torch

    from monai.data import CacheDataset
    from monai.utils import convert_to_tensor
    from monai_sharedcache import SharedCacheStore

    tr, first = transforms(cfg["roi"])
    data = inputs(cfg, 1)
    ms: dict[str, float] = {}
    start = time.perf_counter()
    eager = CacheDataset(data, tr, copy_cache=False, progress=False, num_workers=1)
    ms["compute"] = (time.perf_counter() - start) * 1e3
    store = SharedCacheStore(weights_only=False)  # what runtime_cache="process" makes in the fork's wheel
    store_ds = CacheDataset(data, tr, runtime_cache=store, hash_transform=store.hash_transform, progress=False)
    hit(store_ds, 0)  # the miss: computed and stored
    res["store_dir"] = store.path

    def floor(_: int) -> None:
        hit(eager)

    hits = interleave({"floor": floor, "store": lambda _: hit(store_ds)}, cfg["reps"])
    eager.copy_cache = True  # in a loop of its own: its deepcopy of the whole item evicts the CPU caches before
    # whichever hit comes next, which costs a store hit (new objects over its mapping) more than the floor's
    hits.update(interleave({"copy_cache": floor}, cfg["copy_reps"]))
    eager.copy_cache = False
    ms.update({f"hit.{name}": t * 1e3 for name, t in hits.items()})

    item = tr(dict(data[0]), end=first)
    tdir = tempfile.mkdtemp(prefix="bench-torch-", dir=os.path.dirname(store.path))

    def torch_put(path: str) -> None:
        tmp = f"{path}.tmp"
        torch.save(convert_to_tensor(item, convert_numeric=False, track_meta=False), tmp)
        os.replace(tmp, path)

    def read_crop(read: Callable[[], Any]) -> None:
        collate_copy(tr(read(), start=first))

    def torch_load(path: str) -> Any:
        return torch.load(path, mmap=True, weights_only=True)

    def plain_write(r: int) -> None:
        path = os.path.join(tdir, f"plain-{r}")
        with open(path, "wb") as f:
            for key in ("image", "label"):
                f.write(memoryview(item[key].as_subclass(torch.Tensor).numpy()).cast("B"))
        os.unlink(path)

    try:
        torch_put(os.path.join(tdir, "hit.pt"))
        store.put("hit", item)
        n = cfg["first_reps"]
        for i in range(n):  # each read once: nothing this process kept from an earlier read can serve it
            torch_put(os.path.join(tdir, f"first-{i}.pt"))
            store.put(f"first-{i}", item)
        # each read in a loop of its own with the floor: a torch.load between two store reads evicts what the
        # store's next hit reads (as the deepcopy above), and the other way round
        fmt: dict[str, float] = {}
        reads = {
            "hit.store": lambda _: read_crop(lambda: store.get("hit")),
            "hit.torch": lambda _: read_crop(lambda: torch_load(os.path.join(tdir, "hit.pt"))),
            "first.store": lambda i: read_crop(lambda: store.get(f"first-{i}")),
            "first.torch": lambda i: read_crop(lambda: torch_load(os.path.join(tdir, f"first-{i}.pt"))),
        }
        for name, fn in reads.items():
            first_read = name.startswith("first")
            t = interleave({"floor": floor, name: fn}, n if first_read else cfg["reps"], warmup=0 if first_read else 2)
            fmt[name], fmt[f"{name}.floor"] = t[name], t["floor"]
        store.discard([f"first-{i}" for i in range(n)])

        def store_put(r: int) -> None:
            if not store.put(f"put-{r}", item):
                raise RuntimeError(f"the store refused an item in {store.path}")
            store.discard([f"put-{r}"])

        def torch_put_once(r: int) -> None:
            torch_put(os.path.join(tdir, f"put-{r}.pt"))
            os.unlink(os.path.join(tdir, f"put-{r}.pt"))

        fmt.update(
            interleave(
                {"put.store": store_put, "put.torch": torch_put_once, "put.os_write": plain_write}, cfg["put_reps"]
            )
        )
        ms.update({f"format.{name}": t * 1e3 for name, t in fmt.items()})
        res["sizes_mib"] = {
            "store": max(e.stat().st_size for e in os.scandir(store.path) if e.name.endswith(".item")) / 2**20,
            "torch": os.path.getsize(os.path.join(tdir, "hit.pt")) / 2**20,
        }
    finally:
        shutil.rmtree(tdir, ignore_errors=True)
        store.close()
    res["ms"] = ms
    return res


def job_listproxy(cfg: dict) -> dict[str, Any]:
    """In the upstream tree: ``runtime_cache="process"`` (a ``Manager`` list) with tensor and numpy items."""
    res: dict[str, Any] = {"info": job_setup()}
    from monai.data import CacheDataset

    data = inputs(cfg, 1)
    tr, _ = transforms(cfg["roi"])
    tr_np, _ = transforms(cfg["roi"], numpy_items=True)
    eager = CacheDataset(data, tr, copy_cache=False, progress=False, num_workers=1)
    # tensors come back in shared memory: copy_cache=True (the default) keeps an in-place transform off the cache;
    # numpy items are private unpickled copies already
    tensors = CacheDataset(data, tr, runtime_cache="process", progress=False)
    arrays = CacheDataset(data, tr_np, runtime_cache="process", copy_cache=False, progress=False)
    hit(tensors, 0)
    hit(arrays, 0)
    fns = {
        "floor": lambda _: hit(eager),
        "listproxy_tensor": lambda _: hit(tensors),
        "listproxy_numpy": lambda _: hit(arrays),
    }
    res["ms"] = {f"hit.{k}": v * 1e3 for k, v in interleave(fns, cfg["upstream_reps"]).items()}
    return res


def _persist_open(cfg: dict) -> tuple[Any, Any, Any, list[dict], Any]:
    from monai.data import CacheDataset, PersistentDataset
    from monai_sharedcache import SharedCacheStore

    data = inputs(cfg, cfg["items"])
    tr, _ = transforms(cfg["roi"], count=True)
    pd = PersistentDataset(data, tr, cache_dir=os.path.join(cfg["persist_dir"], "persistentdataset"))
    store = SharedCacheStore(os.path.join(cfg["persist_dir"], "store"), persistent=True)
    ds = CacheDataset(data, tr, runtime_cache=store, hash_transform=store.hash_transform, progress=False)
    return pd, ds, store, data, tr


def job_persist_fill(cfg: dict) -> dict[str, Any]:
    """The first run: ``PersistentDataset`` and a persistent store on the disk store every item."""
    res: dict[str, Any] = {"info": job_setup()}
    pd, ds, store, data, _ = _persist_open(cfg)
    start = time.perf_counter()
    for i in range(len(data)):
        pd[i]
    res["fill_s"] = {"persistentdataset": time.perf_counter() - start}
    start = time.perf_counter()
    ds.fill()
    res["fill_s"]["store"] = time.perf_counter() - start
    store.close()
    res["computed"] = _COMPUTED[0]
    return res


def job_persist_read(cfg: dict) -> dict[str, Any]:
    """
    A new process on the filled caches: the first hit (a restart), warm reads against the floor, and what the
    store's checksums cost a first read in a run (a new session at every open), with the check and without (the
    core's ``verified``), alternating on the same item file.
    """
    res: dict[str, Any] = {"info": job_setup()}
    from monai.data import CacheDataset
    from monai_sharedcache import SharedCacheStore, checksum

    start = time.perf_counter()
    pd, ds, store, data, tr = _persist_open(cfg)
    res["open_ms"] = (time.perf_counter() - start) * 1e3
    restart = interleave({"persistentdataset": lambda _: hit(pd), "store": lambda _: hit(ds)}, 1, warmup=0)
    res["restart_first_hit_ms"] = {k: v * 1e3 for k, v in restart.items()}
    for i in range(len(data)):
        hit(pd, i)
        hit(ds, i)
    res["computed"] = _COMPUTED[0]
    floor_tr, _ = transforms(cfg["roi"])
    floor = CacheDataset(data[:1], floor_tr, copy_cache=False, progress=False, num_workers=1)
    n = len(data)
    fns = {
        "floor": lambda r: hit(floor),
        "store": lambda r: hit(ds, r % n),
        "persistentdataset": lambda r: hit(pd, r % n),
    }
    res["ms"] = {f"read.{k}": v * 1e3 for k, v in interleave(fns, cfg["reps"]).items()}
    item = os.path.join(store.path, sorted(n for n in os.listdir(store.path) if n.endswith(".item"))[0])
    store.close()
    try:
        res["checksum_recorded"] = os.getxattr(item, "user.monai.sum").decode()
    except OSError as err:
        res["checksum_recorded"] = f"none ({err.strerror})"

    def first_read(checked: bool) -> Callable[[int], None]:
        def run(_: int) -> None:
            with mock.patch.dict(os.environ, {checksum.ENV: "1" if checked else "0"}):  # read when a store opens
                s = SharedCacheStore(os.path.join(cfg["persist_dir"], "store"), persistent=True)  # a first read
            try:
                hit(CacheDataset(data[:1], tr, runtime_cache=s, hash_transform=s.hash_transform, progress=False))
            finally:
                s.close()

        return run

    checks = interleave({"checked": first_read(True), "unchecked": first_read(False)}, cfg["reps"])
    res["ms"].update({f"first_read.{k}": v * 1e3 for k, v in checks.items()})
    res["computed_end"] = _COMPUTED[0]
    return res


EAGER = """
import time
t = time.perf_counter()
import monai
imported = time.perf_counter() - t
import numpy as np
from monai.data import CacheDataset
from monai.transforms import Compose, Lambda
ds = CacheDataset([np.zeros(4) for _ in range(100)], Compose([Lambda(lambda x: x)]), progress=False)
best = float("inf")
for _ in range(7):
    t = time.perf_counter()
    for _ in range(200):
        for i in range(100):
            ds[i]
    best = min(best, (time.perf_counter() - t) / 20000)
print(imported, best)
"""
JOBS = {
    "hits": job_hits,
    "listproxy": job_listproxy,
    "persist_fill": job_persist_fill,
    "persist_read": job_persist_read,
}


# ---------------------------------------------------------------------------------------------------------------------
# the driver: no torch, no monai


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_job(job: str, tree: Path, cfg: dict, fast_path: bool = True, code: str | None = None) -> dict[str, Any]:
    """Run ``job`` (or the ``code``) in a subprocess with ``PYTHONPATH=tree``; its result, or an ``error``."""
    out = Path(cfg["out_dir"])
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(out / "pycache"))
    env["MONAI_CACHE_FAST_PATH"] = "1" if fast_path else "0"  # whatever the caller's environment says
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # else every job compiles monai anew: 20 s of each import
    cmd = [sys.executable, "-c", code] if code else [sys.executable, str(Path(__file__)), "--job", job, json.dumps(cfg)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cfg["timeout"])
    except subprocess.TimeoutExpired:
        return {"error": f"{job}: timed out after {cfg['timeout']} s"}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / f"{job}-{'fast' if fast_path else 'portable'}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        log(f"FAILED {job}: {proc.stderr.strip()[-1500:]}")
        return {"error": f"{job}: exit {proc.returncode}"}
    log(f"done {job} ({tree.name}, fast path {int(fast_path)}) in {time.perf_counter() - start:.1f} s")
    if code:
        return {"stdout": proc.stdout}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def prepare_trees(out: Path, refresh: bool = True) -> dict[str, Path]:
    """The fork's tree (laid out if stale) and pristine upstream 1.6.1 (unpacked from the pinned wheel if absent)."""
    if refresh:
        subprocess.run([sys.executable, str(BUILD), "layout", "--if-stale"], check=True, cwd=REPO, capture_output=True)
    upstream = out / "upstream-tree"
    if not list(upstream.glob("monai-1.6.1.dist-info/RECORD")):
        shutil.rmtree(upstream, ignore_errors=True)
        subprocess.run(
            [sys.executable, str(BUILD), "pristine", str(upstream)], check=True, cwd=REPO, capture_output=True
        )
    return {"fork": FORK_TREE, "upstream": upstream}


def _get(res: dict, *keys: str) -> Any:
    for key in keys:
        if not isinstance(res, dict) or key not in res:
            return None
        res = res[key]
    return res


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def section_hits(cfg: dict, trees: dict[str, Path], checks: dict[str, float | None]) -> tuple[dict, list[str]]:
    res = {
        "fast": run_job("hits", trees["fork"], cfg),
        "portable": run_job("hits", trees["fork"], cfg, fast_path=False),
        "upstream": run_job("listproxy", trees["upstream"], cfg),
    }
    if _get(res, "fast", "info", "fast_path") is False or _get(res, "portable", "info", "fast_path"):
        raise RuntimeError("MONAI_CACHE_FAST_PATH did not set the store's fast path as asked")
    fast, port, up = (res[k].get("ms", {}) for k in ("fast", "portable", "upstream"))
    store = fast.get("hit.store")
    lines = [
        f"item {cfg['item_mib']:.1f} MiB (image 4x{'x'.join(map(str, cfg['shape']))} float32 + label uint8), crop "
        f"{cfg['roi'][0]}^3 + collate copy; ms, medians of {cfg['reps']} interleaved reps; x = / the floor of its job",
        "",
        f"{'path':58s} {'ms':>9s} {'x floor':>8s}",
    ]

    def row(label: str, value: float | None, floor: float | None) -> None:
        lines.append(f"{label:58s} {_f(value):>9s} {_f(_ratio(value, floor), '.2f', 'x'):>8s}")

    row("1. private list, copy_cache=False (the floor)", fast.get("hit.floor"), fast.get("hit.floor"))
    row("2. private list, copy_cache=True", fast.get("hit.copy_cache"), fast.get("hit.floor"))
    row(
        "3. upstream 'process' ListProxy, tensors (copy_cache=True)",
        up.get("hit.listproxy_tensor"),
        up.get("hit.floor"),
    )
    row("4. upstream 'process' ListProxy, numpy items", up.get("hit.listproxy_numpy"), up.get("hit.floor"))
    row("5. fork 'process' store, fast path", store, fast.get("hit.floor"))
    row("5b. fork 'process' store, portable (MONAI_CACHE_FAST_PATH=0)", port.get("hit.store"), port.get("hit.floor"))
    row(
        "   first read of an item, fast path (get + crop + copy)",
        fast.get("format.first.store"),
        fast.get("format.first.store.floor"),
    )
    row("   first read of an item, portable", port.get("format.first.store"), port.get("format.first.store.floor"))
    lines += [
        "",
        f"store (fast path) speed-up: vs copy_cache=True {_f(_ratio(fast.get('hit.copy_cache'), store), '.1f', 'x')}, "
        f"vs ListProxy tensors {_f(_ratio(up.get('hit.listproxy_tensor'), store), '.1f', 'x')}, "
        f"vs ListProxy numpy {_f(_ratio(up.get('hit.listproxy_numpy'), store), '.1f', 'x')}; portable vs copy_cache=True "
        f"{_f(_ratio(port.get('hit.copy_cache'), port.get('hit.store')), '.1f', 'x')}",
        "",
        "item format, same item, same process: the store's file against torch.save(convert_to_tensor(item)) + "
        f"torch.load(mmap=True, weights_only=True), files on {os.path.dirname(str(_get(res, 'fast', 'store_dir')))}; "
        "ms, medians; each read in a loop of its own with the floor, torch/store = the ratio of their x floor",
        f"{'':34s} {'fast path':>29s}   {'portable':>29s}",
        f"{'':34s} {'store':>8s} {'torch':>8s} {'torch/store':>11s}   {'store':>8s} {'torch':>8s} {'torch/store':>11s}",
    ]

    def vs(ms: dict, what: str) -> list[float | None]:
        s, t = ms.get(f"format.{what}.store"), ms.get(f"format.{what}.torch")
        if what == "put":  # the puts alternate in one loop: no eviction to keep apart
            return [s, t, _ratio(t, s)]
        sf, tf = ms.get(f"format.{what}.store.floor"), ms.get(f"format.{what}.torch.floor")
        return [s, t, _ratio(_ratio(t, tf), _ratio(s, sf))]

    for what, label in (
        ("hit", "hit (same item again) + crop + copy"),
        ("first", "first read + crop + copy"),
        ("put", "put (write the item)"),
    ):
        cells = [_f(v, ".2f", "x" if i % 3 == 2 else "") for i, v in enumerate(vs(fast, what) + vs(port, what))]
        widths = (8, 8, 11)
        halves = [" ".join(f"{c:>{w}s}" for c, w in zip(cells[k : k + 3], widths)) for k in (0, 3)]
        lines.append(f"{label:34s} {halves[0]}   {halves[1]}")
    sizes = _get(res, "fast", "sizes_mib") or {}
    lines.append(
        f"plain os.write of the arrays: {_f(fast.get('format.put.os_write'))} ms; file sizes: store "
        f"{_f(sizes.get('store'), '.1f')} MiB, torch {_f(sizes.get('torch'), '.1f')} MiB; computing the item "
        f"{_f(fast.get('compute'), '.0f')} ms"
    )
    checks["hit"] = _ratio(store, fast.get("hit.floor"))
    return res, lines


def section_persistent(cfg: dict, trees: dict[str, Path], checks: dict[str, float | None]) -> tuple[dict, list[str]]:
    shutil.rmtree(cfg["persist_dir"], ignore_errors=True)
    os.makedirs(cfg["persist_dir"])
    try:
        res = {"fill": run_job("persist_fill", trees["fork"], cfg), "read": run_job("persist_read", trees["fork"], cfg)}
    finally:
        shutil.rmtree(cfg["persist_dir"], ignore_errors=True)
    fill, read = res["fill"], res["read"]
    ms = read.get("ms", {})
    first = read.get("restart_first_hit_ms", {})
    lines = [
        f"{cfg['items']} items on the disk ({cfg['persist_dir']}); every phase a new process (fork tree, fast path)",
        f"{'':38s} {'PersistentDataset':>18s} {'persistent store':>17s}",
        f"{'first run: all items stored, s':38s} {_f(_get(fill, 'fill_s', 'persistentdataset')):>18s} "
        f"{_f(_get(fill, 'fill_s', 'store')):>17s}",
        f"{'restart: first hit, ms':38s} {_f(first.get('persistentdataset')):>18s} {_f(first.get('store')):>17s}",
        f"{'warm read + crop + copy, ms':38s} {_f(ms.get('read.persistentdataset')):>18s} {_f(ms.get('read.store')):>17s}",
        f"{'  x the floor (' + _f(ms.get('read.floor')) + ' ms)':38s} "
        f"{_f(_ratio(ms.get('read.persistentdataset'), ms.get('read.floor')), '.2f', 'x'):>18s} "
        f"{_f(_ratio(ms.get('read.store'), ms.get('read.floor')), '.2f', 'x'):>17s}",
        f"computed: first run {fill.get('computed')} (both), restart and reads {read.get('computed')}",
        "",
        f"checksums (xattr {read.get('checksum_recorded')}): first read of the item in a run + crop + copy, "
        f"{cfg['reps']} alternating sessions: checked {_f(ms.get('first_read.checked'))} ms, unchecked "
        f"{_f(ms.get('first_read.unchecked'))} ms, "
        f"{_f(_ratio(ms.get('first_read.checked'), ms.get('first_read.unchecked')), '.2f', 'x')}",
    ]
    checks["persistent"] = _ratio(ms.get("read.persistentdataset"), ms.get("read.store"))
    computed = read.get("computed")
    checks["restart_computed"] = None if computed is None else float(computed)
    return res, lines


def section_eager(cfg: dict, trees: dict[str, Path], checks: dict[str, float | None]) -> tuple[dict, list[str]]:
    times: dict[str, list[list[float]]] = {"upstream": [], "fork": []}
    for r in range(cfg["eager_rounds"]):  # interleaved, so that both trees see the same load
        for name in list(times) if r % 2 else list(times)[::-1]:
            out = run_job(f"eager-{name}", trees[name], cfg, code=EAGER)
            if "error" in out:
                return out, [out["error"]]
            times[name].append([float(v) for v in out["stdout"].split()[-2:]])
    med = {name: [statistics.median(col) for col in zip(*t)] for name, t in times.items()}
    lines = [f"medians of {cfg['eager_rounds']} interleaved interpreters per tree"]
    for i, (what, scale, unit) in enumerate((("import monai", 1.0, "s"), ("eager hit, small item", 1e6, "us"))):
        up, fork = med["upstream"][i] * scale, med["fork"][i] * scale
        lines.append(f"{what:24s} upstream {up:8.3f} {unit}  fork {fork:8.3f} {unit}  {fork / up:5.2f}x")
    checks["eager"] = med["fork"][1] / med["upstream"][1]
    return {"median": med}, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--small", action="store_true", help="9.6 MiB items and fewer reps: a quick run")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"among {','.join(SECTIONS)}")
    parser.add_argument("--reps", type=int, help="timed reps per path (default 25, --small 30)")
    parser.add_argument("--out-dir", default=str(HERE / "output"))
    parser.add_argument("--persist-dir", help="a directory on a local disk (default <out-dir>/persist)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--no-refresh", action="store_true", help="do not run layout --if-stale")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for each subprocess")
    parser.add_argument("--job", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(JOBS[args.job[0]](json.loads(args.job[1]))))
        return 0
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shape, roi = ([96, 96, 64], [48, 48, 48]) if args.small else ([240, 240, 155], [96, 96, 96])
    reps = args.reps or (30 if args.small else 25)
    cfg: dict[str, Any] = {
        "small": args.small,
        "shape": shape,
        "roi": roi,
        "item_mib": 17 * shape[0] * shape[1] * shape[2] / 2**20,
        "reps": reps,
        "copy_reps": reps if args.small else 10,
        "first_reps": 12 if args.small else 8,
        "put_reps": 10 if args.small else 6,
        "upstream_reps": 10 if args.small else 6,
        "items": 6 if args.small else 4,
        "eager_rounds": 2 if args.small else 5,
        "timeout": args.timeout,
        "out_dir": str(out),
        "data_dir": str(out / "data"),
        "persist_dir": str(Path(args.persist_dir or out / "persist").resolve()),
    }
    started = time.perf_counter()
    trees = prepare_trees(out, refresh=not args.no_refresh)
    version = next((p.name[: -len(".dist-info")] for p in trees["fork"].glob("monai-*.dist-info")), "the fork")
    report = [
        f"{version} against upstream 1.6.1; {time.strftime('%Y-%m-%d')}; {os.cpu_count()} cores, "
        f"{platform.system()} {platform.release()}, python {platform.python_version()}",
        f"command: python benchmarks/bench_cache.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip(),
    ]
    print("\n".join(report), flush=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "version": version, "config": cfg}
    checks: dict[str, float | None] = {}
    for name in sections:
        log(f"section {name}")
        t0 = time.perf_counter()
        if name == "ddp":
            sys.path.insert(0, str(HERE))
            import bench_ddp

            results[name], lines = bench_ddp.run_section(args.small, out, trees, args.timeout)
            checks.update(results[name].get("checks", {}))
        else:
            section = {"hits": section_hits, "persistent": section_persistent, "eager": section_eager}[name]
            results[name], lines = section(cfg, trees, checks)
        text = ["", f"== {name} ({time.perf_counter() - t0:.0f} s)", *lines]
        print("\n".join(text), flush=True)
        report += text
    lines = ["", "== targets (ratios measured in this run)"]
    failed = False
    all_targets = dict(TARGETS)
    if "ddp" in sections:
        import bench_ddp

        all_targets.update(bench_ddp.TARGETS)
    for key, (text, limit, op) in all_targets.items():
        if key not in checks:
            continue
        value = checks[key]
        ok = value is not None and (value <= limit if op == "<=" else value >= limit)
        failed |= not ok
        shown = _f(value, ".3f")
        lines.append(f"{'PASS' if ok else 'FAIL'}  {text}: {shown} ({op} {limit:g})")
    lines.append(f"total {time.perf_counter() - started:.0f} s")
    print("\n".join(lines))
    report += lines
    results["checks"] = checks
    (out / "results.md").write_text("```text\n" + "\n".join(report) + "\n```\n")
    (out / "bench_cache.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
