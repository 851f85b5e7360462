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
The persistent section: a cache kept across runs. Upstream's ``PersistentDataset`` and ``LMDBDataset`` against the
fork's ``SharedCacheStore(path, persistent=True)`` on the local disk and on ``/dev/shm``, all in one run, on the same
item (the item, the cached chain and the hit of ``bench_common``) and the same disk.

The contenders (every cache in a directory of its own, emptied at the start of the section):

a. ``PersistentDataset(cache_dir=<disk>/persistentdataset)``: one ``torch.save`` file per item;
b. ``LMDBDataset(cache_dir=<disk>/lmdb)`` (needs ``lmdb``; skipped with the reason if it cannot be imported): its
   constructor computes every missing item;
c. ``CacheDataset(runtime_cache=SharedCacheStore(<disk>/store-disk, persistent=True))``;
d. the same with the store on ``/dev/shm``.

Run from the repository root (Linux: ``/proc``, ``/dev/shm``)::

    python benchmarks/bench_cache.py --sections persistent            # full size, about 1.5 minutes on 2 cores
    python benchmarks/bench_cache.py --small --sections persistent    # quick run
    python benchmarks/bench_persistent.py [--small]                   # the section alone, its report printed

``<disk>`` is ``<out-dir>/persist`` (``benchmarks/output`` is on the local disk). The cached chain is that of
``bench_common`` with a counting step at its end (``Lambda(count_computation)``, deterministic, so every contender
caches it): the computations of a process are counted where they happen. Every phase is a fresh subprocess with
``PYTHONPATH`` set to the fork's tree (``bench_run.run_subprocess``, job ``persist``; the store with its fast path):

1. first run (empty cache): the time from the dataset's setup to its first batch (``ds[0]`` + the collate-like copy)
   and to all N items stored (stores: ``ds.fill()`` after the first batch; ``PersistentDataset``: ``ds[i]`` of each
   item; ``LMDBDataset``: its constructor), and the computations;
2. restart: a new process on the same directory (warm page cache): time to first batch (opening the store and the
   dataset included), computations (must be 0), then a warm epoch of the N items;
3. reads: one more process opens every filled cache, reads each item once, then times ``--reps`` hits (read + crop +
   copy, items in turn) of each, interleaved with the private no-copy floor of ``bench_common``; the stores with the
   floor, then ``PersistentDataset`` and ``LMDBDataset`` with the floor in a loop of their own (their reads of the
   whole item evict the CPU caches before whatever comes next, as ``copy_cache=True`` does in the hits section);
4. over budget: a persistent ``/dev/shm`` store with ``max_bytes`` half the dataset's bytes (as the disk store counts
   them) is filled in one process, then read for 2 epochs in a new one; the disk store, holding every item, likewise.

Targets, ratios within the run: the disk store computes nothing on restart, and reaches its first batch in <= 0.1x
the time of its first run; its warm read is >= 10x faster than ``PersistentDataset``'s. ``run_section(args, out_dir,
trees)`` and ``report_lines(result)`` serve the ``bench_cache.py`` driver (``--sections persistent``); the caches are
removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench_common import (
    DEFAULT_OUT,
    FORK_TREE,
    MIB,
    collate_copy,
    expected_nbytes,
    hit,
    inputs,
    job_setup,
    md_table,
    median,
    minflt,
    plain_table,
    transforms,
)
from bench_machine import mount_of
from bench_run import prepare_trees, run_subprocess

TITLE = "Persistent store (bench_persistent.py)"
CONTENDERS: dict[str, dict[str, str]] = {
    "persistentdataset": {"label": "a. PersistentDataset (disk)", "short": "PersistentDataset"},
    "lmdb": {"label": "b. LMDBDataset (disk)", "short": "LMDBDataset"},
    "store_disk": {"label": "c. persistent SharedCacheStore (disk)", "short": "disk store"},
    "store_shm": {"label": "d. persistent SharedCacheStore (/dev/shm)", "short": "/dev/shm store"},
}
STORES = ("store_disk", "store_shm")
BUDGET = "budget_shm"  # the /dev/shm store with max_bytes half the dataset's bytes
TARGETS = {"restart_computed": 0, "restart_first_batch": 0.1, "read_vs_persistentdataset": 10.0}
WARMUP = 2

_COMPUTED = [0]  # computations of the cached transforms in this process (count_computation)


def count_computation(data: Any) -> Any:
    """The last cached (deterministic) step of the chain: counts the computations of this process."""
    _COMPUTED[0] += 1
    return data


class UnavailableError(Exception):
    """A contender that this tree or this Python cannot run (reported as skipped, with the reason)."""


# ---------------------------------------------------------------------------------------------------------------------
# the job (in a subprocess, PYTHONPATH = the fork's tree)


def _chain(cfg: dict) -> Any:
    """The chain of ``bench_common.transforms`` with ``Lambda(count_computation)`` as its last cached step."""
    from monai.transforms import Compose, Lambda

    tr, first_random = transforms(cfg["roi"], False)
    steps = list(tr.transforms)
    return Compose([*steps[:first_random], Lambda(func=count_computation), *steps[first_random:]])


def _store_class() -> Any:
    from monai.data import SharedCacheStore

    if "persistent" not in inspect.signature(SharedCacheStore.__init__).parameters:
        raise UnavailableError(
            "SharedCacheStore has no persistent=True in this tree (patches/0012-cache-store-persistent.patch not "
            "laid out yet)"
        )
    return SharedCacheStore


def _open_store(cfg: dict, name: str) -> Any:
    kwargs: dict[str, Any] = {"persistent": True}
    if name == BUDGET:
        kwargs["max_bytes"] = int(cfg["budget_bytes"])
    return _store_class()(cfg["dirs"][name], **kwargs)


def _lmdb_check() -> None:
    try:
        import lmdb  # noqa: F401
    except ImportError as err:
        raise UnavailableError(f"lmdb cannot be imported ({err}); pip install 'lmdb<2'") from err


def _dataset(cfg: dict, name: str, data: list[dict], tr: Any, store: Any = None) -> Any:
    from monai.data import CacheDataset, LMDBDataset, PersistentDataset

    if name == "persistentdataset":
        return PersistentDataset(data, tr, cache_dir=cfg["dirs"][name])
    if name == "lmdb":
        return LMDBDataset(data, tr, cache_dir=cfg["dirs"][name], progress=False)
    return CacheDataset(data, tr, runtime_cache=store, progress=False)


def _close(ds: Any, store: Any) -> None:
    if hasattr(ds, "close"):  # LMDBDataset's read environment
        ds.close()
    if store is not None:
        store.close()  # persistent: the directory stays


def _stats(ds: Any, store: Any) -> dict[str, Any] | None:
    return ds.cache_stats() if store is not None else None


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes allocated by the files under ``path`` (``st_blocks``: the LMDB map file is sparse)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _open(cfg: dict, name: str, data: list[dict], tr: Any) -> tuple[Any, Any, float, float]:
    """The dataset of contender ``name`` (and its store): (ds, store, seconds to open the store, to make the ds)."""
    if name == "lmdb":
        _lmdb_check()
    start = time.perf_counter()
    store = _open_store(cfg, name) if name in STORES or name == BUDGET else None
    opened = time.perf_counter()
    ds = _dataset(cfg, name, data, tr, store)
    return ds, store, opened - start, time.perf_counter() - opened


def _first_run(cfg: dict, name: str) -> dict[str, Any]:
    """Empty cache: time to first batch, to all N items stored; computations."""
    data, tr = inputs(cfg, cfg["n"]), _chain(cfg)  # the input files are written once, before the clock
    start = time.perf_counter()
    ds, store, open_s, setup_s = _open(cfg, name, data, tr)
    computed_setup = _COMPUTED[0]
    hit(ds, 0)
    out: dict[str, Any] = {"open_s": open_s, "setup_s": setup_s, "computed_at_setup": computed_setup}
    out["first_batch_s"] = time.perf_counter() - start
    out["computed_at_first_batch"] = _COMPUTED[0]
    if store is not None:
        ds.fill()
    elif name == "persistentdataset":
        for i in range(1, len(data)):
            hit(ds, i)
    out["fill_s"] = time.perf_counter() - start  # LMDBDataset: its constructor stored every item
    out["computed"] = _COMPUTED[0]
    out["stats"] = _stats(ds, store)
    _close(ds, store)
    out["disk_bytes"] = disk_bytes(cfg["dirs"][name])
    return out


def _restart(cfg: dict, name: str) -> dict[str, Any]:
    """A new process on a filled cache: time to first batch, computations, a warm epoch."""
    data, tr = inputs(cfg, cfg["n"]), _chain(cfg)
    start = time.perf_counter()
    ds, store, open_s, setup_s = _open(cfg, name, data, tr)
    stats_before = _stats(ds, store)
    computed_setup = _COMPUTED[0]
    t0 = time.perf_counter()
    hit(ds, 0)
    end = time.perf_counter()
    out: dict[str, Any] = {"open_s": open_s, "setup_s": setup_s, "first_hit_s": end - t0, "first_batch_s": end - start}
    out["computed_at_setup"], out["computed_at_first_batch"] = computed_setup, _COMPUTED[0]
    out["stats_before"] = stats_before
    start = time.perf_counter()
    for i in range(len(data)):
        hit(ds, i)
    out["epoch_s"] = time.perf_counter() - start
    out["computed"] = _COMPUTED[0]
    out["stats"] = _stats(ds, store)
    _close(ds, store)
    return out


def _reads(cfg: dict, names: list[str]) -> dict[str, Any]:
    """Warm per-read cost of every filled cache, interleaved with the private no-copy floor (see the docstring)."""
    from monai.data import CacheDataset

    data, tr = inputs(cfg, cfg["n"]), _chain(cfg)
    plain, _ = transforms(cfg["roi"], False)
    floor = CacheDataset(data[:1], plain, copy_cache=False, progress=False, num_workers=1)  # not counted
    opened: dict[str, tuple[Any, Any]] = {}
    out: dict[str, Any] = {"contenders": {}}
    for name in names:
        try:
            ds, store, _, _ = _open(cfg, name, data, tr)
        except UnavailableError as err:
            out["contenders"][name] = {"skipped": str(err)}
            continue
        c0 = _COMPUTED[0]
        for i in range(len(data)):  # warm: each item read once by this process
            hit(ds, i)
        opened[name] = (ds, store)
        out["contenders"][name] = {"computed_warming": _COMPUTED[0] - c0}
    groups = [[n for n in names if n in STORES and n in opened], [n for n in names if n not in STORES and n in opened]]
    n, reps = len(data), cfg["reps"]
    for g, group in enumerate(groups):
        if not group:
            continue
        floor_s: list[float] = []
        times: dict[str, list[float]] = {name: [] for name in group}
        faults: dict[str, int] = dict.fromkeys(group, 0)
        c0 = _COMPUTED[0]
        for r in range(WARMUP + reps):
            start = time.perf_counter()
            collate_copy(floor[0])
            if r >= WARMUP:
                floor_s.append(time.perf_counter() - start)
            for name in group:
                ds = opened[name][0]
                f0 = minflt()
                start = time.perf_counter()
                hit(ds, r % n)
                elapsed = time.perf_counter() - start
                if r >= WARMUP:
                    times[name].append(elapsed)
                    faults[name] += minflt() - f0
        for name in group:
            entry = out["contenders"][name]
            entry.update(read_s=times[name], floor_s=floor_s, group=g, minflt_per_read=faults[name] / reps)
            entry["computed_reading"] = _COMPUTED[0] - c0  # of the group
            entry["stats"] = _stats(*opened[name])
    for ds, store in opened.values():
        _close(ds, store)
    return out


def _epochs(cfg: dict, name: str, fill: bool) -> dict[str, Any]:
    """``fill``: fill the (empty) store; else 2 epochs of reads over a filled one (a new process)."""
    data, tr = inputs(cfg, cfg["n"]), _chain(cfg)
    ds, store, _, _ = _open(cfg, name, data, tr)
    out: dict[str, Any] = {"max_bytes": cfg["budget_bytes"] if name == BUDGET else None}
    if fill:
        start = time.perf_counter()
        ds.fill()
        out.update(fill_s=time.perf_counter() - start, computed=_COMPUTED[0])
    else:
        out["stats_before"] = _stats(ds, store)
        out["epochs"] = []
        for _ in range(cfg["budget_epochs"]):
            c0, start = _COMPUTED[0], time.perf_counter()
            for i in range(len(data)):
                hit(ds, i)
            out["epochs"].append({"s": time.perf_counter() - start, "computed": _COMPUTED[0] - c0})
    out["stats"] = _stats(ds, store)
    _close(ds, store)
    return out


def job_persist(cfg: dict) -> dict[str, Any]:
    """The ``persist`` job of ``bench_run``: one phase (``cfg["phase"]``) of one contender (``cfg["contender"]``)."""
    started = time.perf_counter()
    info = job_setup()
    import monai.data  # noqa: F401  (its import time is not the cache's)

    res: dict[str, Any] = {"info": info, "phase": cfg["phase"], "contender": cfg.get("contender")}
    res["import_s"] = time.perf_counter() - started
    phase, name = cfg["phase"], cfg.get("contender")
    try:
        if phase == "first":
            res.update(_first_run(cfg, name))
        elif phase == "restart":
            res.update(_restart(cfg, name))
        elif phase == "reads":
            res.update(_reads(cfg, cfg["names"]))
        elif phase in ("budget_fill", "budget_epochs"):
            res.update(_epochs(cfg, name, fill=phase == "budget_fill"))
        else:
            raise ValueError(f"unknown phase {phase!r}")
    except UnavailableError as err:
        res["skipped"] = str(err)
    return res


# ---------------------------------------------------------------------------------------------------------------------
# the driver's side (no torch, no monai)


def _log(msg: str) -> None:
    print(f"[bench_persistent {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _config(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    small = bool(getattr(args, "small", False))
    cfg: dict[str, Any] = {
        "shape": [96, 96, 64] if small else [240, 240, 155],
        "roi": [48, 48, 48] if small else [96, 96, 96],
        "n": 8 if small else 6,
        "reps": getattr(args, "reps", None) or (40 if small else 25),
        "budget_epochs": 2,
        "data_dir": str(out_dir / "data"),
    }
    disk = out_dir / "persist"
    tag = hashlib.sha256(str(out_dir).encode()).hexdigest()[:8]
    shm = Path("/dev/shm") / f"monai-bench-persist-{os.getuid()}-{tag}"
    cfg["disk_root"], cfg["shm_root"] = str(disk), str(shm)
    cfg["dirs"] = {
        "persistentdataset": str(disk / "persistentdataset"),
        "lmdb": str(disk / "lmdb"),
        "store_disk": str(disk / "store-disk"),
        "store_shm": str(shm / "store"),
        BUDGET: str(shm / "budget"),
    }
    cfg["item_nbytes"] = expected_nbytes(cfg["shape"])
    cfg["budget_bytes"] = cfg["n"] * cfg["item_nbytes"] // 2  # replaced by half the disk store's nbytes if known
    return cfg


def _clean(cfg: dict[str, Any]) -> None:
    for root in (cfg["disk_root"], cfg["shm_root"]):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root, mode=0o700)


def _prepare_tree(args: argparse.Namespace, out_dir: Path) -> Path:
    """The fork's tree, refreshed as ``bench_cache.py`` does (``layout --if-stale``, unless ``--no-refresh``)."""
    ns = argparse.Namespace(no_refresh=bool(getattr(args, "no_refresh", False)), skip_upstream=True)
    prepare_trees(ns, out_dir)
    return FORK_TREE


def run_section(args: argparse.Namespace, out_dir: Path | str, trees: Mapping[str, Path] | None = None) -> dict:
    """Run every phase of every contender; ``trees["fork"]``: the fork's tree (refreshed here if ``trees`` is None)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tree = Path(trees["fork"]) if trees and trees.get("fork") else _prepare_tree(args, out_dir)
    cfg = _config(args, out_dir)
    timeout = float(getattr(args, "timeout", None) or 900)
    jobs: dict[str, Any] = {}

    def job(phase: str, name: str | None = None, **extra: Any) -> dict[str, Any]:
        tag = f"persist-{phase}" + (f"-{name}" if name else "")
        result = run_subprocess("persist", tree, dict(cfg, phase=phase, contender=name, **extra), out_dir, timeout, tag)
        jobs[tag] = result
        return result

    _clean(cfg)
    try:
        runs: dict[str, dict[str, Any]] = {}
        for name in CONTENDERS:
            first = job("first", name)
            runs[name] = {"first": first}
            if "error" not in first and "skipped" not in first:  # a restart of a cache that was filled
                runs[name]["restart"] = job("restart", name)
        names = [n for n, r in runs.items() if "restart" in r and "error" not in r["restart"]]
        reads = job("reads", names=names) if names else {"skipped": "no filled cache"}
        disk_nbytes = ((runs["store_disk"]["first"].get("stats") or {}).get("cache") or {}).get("nbytes")
        if disk_nbytes:
            cfg["budget_bytes"] = int(disk_nbytes) // 2  # half the dataset's bytes, as the store counts them
        budget: dict[str, Any] = {}
        fill = job("budget_fill", BUDGET)
        budget[BUDGET] = {"fill": fill}
        if "error" not in fill and "skipped" not in fill:
            budget[BUDGET]["epochs"] = job("budget_epochs", BUDGET)
        if _ok(runs["store_disk"].get("restart")):
            budget["store_disk"] = {"epochs": job("budget_epochs", "store_disk")}
    finally:
        for root in (cfg["disk_root"], cfg["shm_root"]):  # the caches: 3 copies of the dataset on disk, 2 in memory
            shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {"config": cfg, "runs": runs, "reads": reads, "budget": budget}
    first_info = next((r.get("info") for r in jobs.values() if isinstance(r.get("info"), dict)), None)
    if first_info:
        result["info"] = first_info  # the report's header: the fork's version, the fast path
    result["job_warnings"] = sorted({w for r in jobs.values() for w in r.get("job_warnings", [])})
    result["errors"] = {tag: r["error"] for tag, r in jobs.items() if isinstance(r.get("error"), str)}
    result["summary"] = summarize(result)
    result["checks"] = checks(result["summary"])
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["elapsed_s"] = time.perf_counter() - started
    return result


# ---------------------------------------------------------------------------------------------------------------------
# summary, targets, report


def _ok(r: Any) -> bool:
    return isinstance(r, dict) and "error" not in r and "skipped" not in r


def _why(r: Any) -> str:
    if not isinstance(r, dict):
        return "not run"
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    lines = str(r.get("error", "not run")).strip().splitlines()
    return f"error: {lines[-1] if lines else ''}"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per contender: the first run, the restart, the reads (medians, ratios); the over-budget epochs."""
    runs, reads = result["runs"], result["reads"].get("contenders", {})
    out: dict[str, Any] = {"contenders": {}, "budget": {}}
    disk_read = median(reads.get("store_disk", {}).get("read_s", []))
    for name, r in runs.items():
        first, restart, read = r.get("first"), r.get("restart"), reads.get(name, {})
        c: dict[str, Any] = {}
        if not _ok(first):
            c["why"] = _why(first)
            out["contenders"][name] = c
            continue
        c.update({k: first[k] for k in ("fill_s", "first_batch_s", "computed", "disk_bytes") if k in first})
        c["first"] = {k: first.get(k) for k in ("open_s", "setup_s", "computed_at_first_batch", "stats")}
        if _ok(restart):
            c["restart_first_batch_s"] = restart["first_batch_s"]
            c["restart_ratio"] = restart["first_batch_s"] / first["first_batch_s"]
            c["restart_computed"] = restart["computed"]
            c["restart_computed_at_first_batch"] = restart["computed_at_first_batch"]
            c["warm_epoch_s"] = restart["epoch_s"]
            keys = ("open_s", "setup_s", "first_hit_s", "stats_before", "stats")
            c["restart"] = {k: restart.get(k) for k in keys}
        else:
            c["why"] = f"restart: {_why(restart)}"
        if read.get("read_s"):
            c["read_s"] = median(read["read_s"])
            c["floor_s"] = median(read["floor_s"])
            c["read_x_floor"] = c["read_s"] / c["floor_s"]
            c["disk_store_speedup"] = c["read_s"] / disk_read if disk_read == disk_read else None
            c["minflt_per_read"] = read.get("minflt_per_read")
            c["computed_reading"] = read.get("computed_warming", 0) + read.get("computed_reading", 0)
        elif read.get("skipped") or not _ok(result["reads"]):
            c["read_why"] = _why(read if read.get("skipped") else result["reads"])
        out["contenders"][name] = c
    for name, b in result["budget"].items():
        entry: dict[str, Any] = {}
        epochs = b.get("epochs")
        if _ok(epochs):
            entry["epochs"] = epochs["epochs"]
            entry["stats"] = epochs.get("stats")
            entry["max_bytes"] = epochs.get("max_bytes")
        else:
            entry["why"] = _why(epochs if epochs is not None else b.get("fill"))
        fill = b.get("fill") or runs.get(name, {}).get("first")  # the disk store: its first run
        if _ok(fill):
            entry["fill"] = {k: fill.get(k) for k in ("fill_s", "computed", "stats", "max_bytes")}
        out["budget"][name] = entry
    return out


def _check(name: str, text: str, value: float | None, limit: float, passed: bool | None, shown: str) -> dict:
    """A check; ``passed`` None: not measured, SKIP (FAIL if ``shown`` tells of an error: the store failed)."""
    status = ("FAIL" if "error:" in shown else "SKIP") if passed is None else ("PASS" if passed else "FAIL")
    line = f"{status}  {text}: {shown}"
    return dict(name=name, status=status, value=value, limit=limit, text=text, shown=shown, line=line)


def checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, in the format of ``bench_cache.py``'s checks (status, value, limit, text, shown, line)."""
    disk, pd = summary["contenders"].get("store_disk", {}), summary["contenders"].get("persistentdataset", {})
    out = []
    n = disk.get("restart_computed")
    why = f" ({disk['why']})" if disk.get("why") else ""
    shown = "n/a" + why if n is None else f"{n} (== 0)"
    text = "disk store: computations of the cached transforms on restart (a new process)"
    out.append(_check("restart_computed", text, n, 0, None if n is None else n == 0, shown))
    ratio, limit = disk.get("restart_ratio"), TARGETS["restart_first_batch"]
    shown = "n/a" + why if ratio is None else f"{ratio:.3f}x (<= {limit:g}x)"
    text = "disk store: restart time to first batch vs the first run's"
    out.append(_check("restart_first_batch", text, ratio, limit, None if ratio is None else ratio <= limit, shown))
    speed = None
    if disk.get("read_s") and pd.get("read_s"):
        speed = pd["read_s"] / disk["read_s"]
    limit = TARGETS["read_vs_persistentdataset"]
    why = next((f" ({c[k]})" for c in (disk, pd) for k in ("why", "read_why") if c.get(k)), "")
    shown = "n/a" + why if speed is None else f"{speed:.1f}x (>= {limit:g}x)"
    text = "disk store: warm read + crop + copy speed-up vs PersistentDataset"
    out.append(
        _check("read_vs_persistentdataset", text, speed, limit, None if speed is None else speed >= limit, shown)
    )
    return out


def _s(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None or value != value else f"{value:{spec}}"


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The contenders' table: head and rows (plain text by ``bench_common.plain_table``, markdown by ``md_table``)."""
    head = ["contender", "fill s", "computed", "1st batch s", "restart 1st batch ms", "x 1st run", "restart computed"]
    head += ["warm epoch s", "read ms", "x floor", "disk store speed-up", "size MiB"]
    rows = []
    for name, spec in CONTENDERS.items():
        c = result.get("summary", {}).get("contenders", {}).get(name, {})
        if "fill_s" not in c:
            rows.append(
                [spec["label"], c.get("why", "not run").split(":")[0] + " (see below)"] + [""] * (len(head) - 2)
            )
            continue
        restart_ms = c.get("restart_first_batch_s")
        speedup = c.get("disk_store_speedup")
        rows.append(
            [
                spec["label"],
                _s(c["fill_s"]),
                str(c.get("computed", "n/a")),
                _s(c["first_batch_s"]),
                _s(None if restart_ms is None else restart_ms * 1e3, ".1f"),
                _s(c.get("restart_ratio"), ".3f"),
                str(c.get("restart_computed", "n/a")),
                _s(c.get("warm_epoch_s"), ".3f"),
                _s(None if c.get("read_s") is None else c["read_s"] * 1e3),
                _s(c.get("read_x_floor")),
                "1x" if name == "store_disk" and speedup else _s(speedup, ".1f") + ("x" if speedup else ""),
                _s(c.get("disk_bytes", 0) / MIB, ".0f"),
            ]
        )
    return head, rows


def _budget_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["store (2 epochs in a new process)", "max_bytes MiB", "computed per epoch", "epoch s", "filled at end"]
    head += ["refused", "reused", "first run: computed / filled / refused"]
    rows = []
    labels = {BUDGET: "persistent store on /dev/shm, max_bytes = half", "store_disk": "persistent store on disk, all"}
    for name, label in labels.items():
        b = result.get("summary", {}).get("budget", {}).get(name)
        if not b:
            continue
        if "epochs" not in b:
            rows.append([label, b.get("why", "not run").split(":")[0] + " (see below)"] + [""] * (len(head) - 2))
            continue
        cache = (b.get("stats") or {}).get("cache") or {}
        fill = b.get("fill") or {}
        fcache = (fill.get("stats") or {}).get("cache") or {}
        first = f"{fill.get('computed')} / {fcache.get('filled')} / {fcache.get('refused')}" if fill else "n/a"
        rows.append(
            [
                label,
                _s(None if b.get("max_bytes") is None else b["max_bytes"] / MIB, ".0f") if b.get("max_bytes") else "-",
                " / ".join(str(e["computed"]) for e in b["epochs"]),
                " / ".join(f"{e['s']:.2f}" for e in b["epochs"]),
                str(cache.get("filled", "n/a")),
                str(cache.get("refused", "n/a")),
                str(cache.get("reused", "n/a")),
                first,
            ]
        )
    return head, rows


def _detail_lines(result: dict[str, Any]) -> list[str]:
    """The numbers behind the targets: the restart's breakdown, the reads, the stores' stats, warnings, errors."""
    lines = []
    summary = result.get("summary", {})
    for name, c in summary.get("contenders", {}).items():
        short = CONTENDERS[name]["short"]
        first, restart = c.get("first") or {}, c.get("restart") or {}
        if "fill_s" not in c:
            lines.append(f"  {short}: {c.get('why', 'not run')}")
            continue
        text = (
            f"  {short}: first run: open {_s((first.get('open_s') or 0) * 1e3, '.1f')} ms, dataset "
            f"{_s((first.get('setup_s') or 0) * 1e3, '.1f')} ms, 1st batch {_s(c['first_batch_s'], '.3f')} s "
            f"({first.get('computed_at_first_batch')} computed), all stored {_s(c['fill_s'], '.3f')} s"
        )
        if restart:
            text += (
                f"; restart: open {_s((restart.get('open_s') or 0) * 1e3, '.1f')} ms + dataset "
                f"{_s((restart.get('setup_s') or 0) * 1e3, '.1f')} ms + 1st ds[0]+copy "
                f"{_s((restart.get('first_hit_s') or 0) * 1e3, '.1f')} ms = "
                f"{_s(c['restart_first_batch_s'] * 1e3, '.1f')} ms ({c['restart_computed_at_first_batch']} computed "
                f"by then, {c['restart_computed']} in all)"
            )
        elif c.get("why"):
            text += f"; {c['why']}"
        lines.append(text)
        if c.get("read_s") is not None:
            lines.append(
                f"  {' ' * len(short)}  warm read + crop + copy {c['read_s'] * 1e3:.2f} ms = {c['read_x_floor']:.2f}x "
                f"the floor ({c['floor_s'] * 1e3:.2f} ms, timed in between), {_s(c.get('minflt_per_read'), ',.0f')} "
                f"page faults per read, {c.get('computed_reading')} computed while reading"
            )
        elif c.get("read_why"):
            lines.append(f"  {' ' * len(short)}  reads: {c['read_why']}")
        for when, key in (("first run", "first"), ("restart, before reading", "restart"), ("restart, end", "restart")):
            stats = (c.get(key) or {}).get("stats_before" if "before" in when else "stats")
            if stats:
                lines.append(f"  {' ' * len(short)}  cache_stats() {when}: {stats}")
    for name, b in summary.get("budget", {}).items():
        if b.get("why"):
            lines.append(f"  over budget, {name}: {b['why']}")
        if b.get("stats"):
            lines.append(f"  over budget, {name}: cache_stats() after the 2 epochs: {b['stats']}")
    for tag, error in result.get("errors", {}).items():
        lines.append(f"  ERROR {tag}: {(error.strip().splitlines() or [''])[-1]}")
    warned = result.get("job_warnings", [])
    relevant = [m for m in warned if any(w in m.lower() for w in ("monai", "cache", "store", "lmdb", "persist"))]
    for message in relevant:
        lines.append(f"  WARNING (in a job): {message}")
    if len(warned) > len(relevant):
        lines.append(f"  ({len(warned) - len(relevant)} other warnings, e.g. torch's deprecations: results.json)")
    return lines


def _setup_line(result: dict[str, Any]) -> str:
    cfg = result["config"]
    shape = "x".join(map(str, cfg["shape"]))
    item = cfg["item_nbytes"]
    return (
        f"{cfg['n']} items of image 4x{shape} float32 + label 1x{shape} uint8 ({item / MIB:.1f} MiB each, "
        f"{cfg['n'] * item / MIB:.0f} MiB in all), crop {'x'.join(map(str, cfg['roi']))} + collate copy; disk caches "
        f"in {cfg['disk_root']} ({_fs(cfg['disk_root'])}), memory in {cfg['shm_root']} ({_fs('/dev/shm')}); every "
        f"phase a fresh process (fork tree, fast path on); reads: {cfg['reps']} per contender; over budget: max_bytes "
        f"{cfg['budget_bytes'] / MIB:.0f} MiB"
    )


def _fs(path: str) -> str:
    m = mount_of(path)
    return f"{m.get('fstype', '?')} on {m.get('mount_point', '?')}"


_SMALL_NOTE = (
    "items smaller than 4x240x240x155: they are cheap to compute and to load, so the restart and speed-up targets "
    "(calibrated for the full-size item) may fail; judge them on a full run"
)


def report_lines(result: dict[str, Any]) -> list[str]:
    """The plain-text report of :func:`run_section`: the setup, the contenders, the budget, the targets, details."""
    if "summary" not in result:
        return [f"persistent section failed: {str(result.get('error', 'no result')).strip()[-2000:]}"]
    head, rows = table(result)
    bhead, brows = _budget_table(result)
    lines = [
        _setup_line(result),
        "fill s, computed, 1st batch s: the first run (empty cache; from the dataset's setup). restart: a new "
        "process, same directory. read ms: warm read + crop + copy (median), x floor: / the private no-copy floor.",
        "",
        plain_table(head, rows),
    ]
    if brows:
        lines += ["", "dataset twice the memory budget:", plain_table(bhead, brows)]
    lines += ["", "TARGETS (ratios measured in this run):", *[f"  {c['line']}" for c in result["checks"]]]
    if result["config"]["shape"] != [240, 240, 155]:
        lines.append(f"  NOTE  {_SMALL_NOTE}")
    lines += ["", "details:", *_detail_lines(result)]
    lines.append(f"section time {result['elapsed_s']:.0f} s (load average at the end {result['loadavg_end'][0]})")
    return lines


def markdown_lines(result: dict[str, Any]) -> list[str]:
    """The section in ``results.md``: the contenders' table and the budget's in markdown, the rest as text."""
    if "summary" not in result:
        return [f"    {line}" for line in report_lines(result)]
    head, rows = table(result)
    bhead, brows = _budget_table(result)
    lines = [_setup_line(result), "", md_table(head, rows), ""]
    if brows:
        lines += ["Dataset twice the memory budget:", "", md_table(bhead, brows), ""]
    lines += [f"- **{c['status']}** {c['line'][6:]}" for c in result["checks"]]
    if result["config"]["shape"] != [240, 240, 155]:
        lines.append(f"- NOTE {_SMALL_NOTE}")
    lines += ["", "Details:", "", *[f"    {line}" for line in _detail_lines(result)]]
    lines.append(f"\nSection time {result['elapsed_s']:.0f} s.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="8 items of 4x96x96x64 (crop 48^3): a quick run")
    parser.add_argument("--reps", type=int, help="timed reads per contender (default 25, --small 40)")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT), help="output directory (default benchmarks/output)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for each subprocess")
    parser.add_argument("--no-refresh", action="store_true", help="do not refresh build/tree (layout --if-stale)")
    args = parser.parse_args(argv)
    result = run_section(args, Path(args.out_dir))
    print("\n".join(report_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
