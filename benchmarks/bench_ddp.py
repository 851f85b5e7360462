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
End-to-end DDP benchmark: what users run, the way MONAI's DDP tutorial trains (2 ranks x 2 DataLoader workers on CPU
with gloo, NIfTI inputs, a small 3D UNet in ``DistributedDataParallel``), with upstream 1.6.1's eager caches against
the fork's shared store.

Run from the repository root (Linux: ``/proc``, ``/dev/shm``)::

    python benchmarks/bench_ddp.py            # full size, a few minutes on 2 cores
    python benchmarks/bench_ddp.py --small    # quick run

The variants (the same data, transforms, model, seeds; ``CacheDataset(num_workers=1)``, upstream's default):

1. upstream eager per rank: ``CacheDataset(runtime_cache=False)`` (``copy_cache=True``) and a ``DistributedSampler``,
   on the pristine upstream 1.6.1 tree: every rank computes and holds every item;
2. upstream eager with ``partition_dataset``: each rank caches its part only and shuffles within it (pristine tree);
3. the fork's lazy shared store: ``runtime_cache=create_shared_cache()`` + ``DistributedSampler`` (``build/tree``);
4. the fork's shared eager fill: the same, and ``ds.fill()`` before training.

Measured: the time to first batch, from the start of the dataset's setup (after a barrier of the ranks: it includes
``create_shared_cache``, the constructor and ``fill()``) to the first batch of the slowest rank; the epoch times; the
computations of the cached transforms in all processes (a deterministic pass-through at the end of the cached chain
appends a line to a file, ``O_APPEND``); the peak footprint of the variant's whole process tree (launcher, ranks,
workers: ``procmem.PeakSampler``, the store's files included). Targets, ratios within the run: the shared eager fill
computes each item once per node, its time to first batch is <= 0.6x and its footprint <= 0.55x those of upstream
eager per rank. The interpreters, torch, the workers and their transients take about 2 GiB in every variant, so
the data (24 items of 156 MiB, 3.7 GiB per copy) must dominate for the ratios to be about the caches: ``--small``
runs the code, its targets fail by design.

Each variant runs in fresh processes: a launcher (``--launch``, standard library only) starts the ranks of
``bench_ddp_rank.py`` with a torchrun-like environment and ``PYTHONPATH`` set to the pristine upstream tree or to the
fork's ``build/tree`` (prepared as ``bench_cache.py`` does), in a session of its own; every wait has a timeout, and
whatever is left of the session is killed. This driver samples the memory of the launcher's tree, checks that the
store's directory is gone, and writes ``<out-dir>/ddp/results.json`` (data in ``<out-dir>/ddp-data``, logs in
``<out-dir>/ddp/<variant>/``). ``run_section(args, out_dir, trees)`` and ``report_lines(result)`` serve the
``bench_cache.py`` driver (``--sections ddp``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import procmem
from bench_common import DEFAULT_OUT, FORK_TREE, MIB, plain_table
from bench_run import prepare_trees

RANK_SCRIPT = Path(__file__).resolve().with_name("bench_ddp_rank.py")

VARIANTS: dict[str, dict[str, str]] = {
    "upstream_eager": {"label": "1. upstream eager per rank + DistributedSampler", "tree": "upstream"},
    "upstream_partition": {"label": "2. upstream eager, partition_dataset", "tree": "upstream"},
    "shared_lazy": {"label": "3. fork lazy shared store", "tree": "fork"},
    "shared_fill": {"label": "4. fork shared store + fill()", "tree": "fork"},
}
TARGETS = {"ttfb_ratio": 0.6, "footprint_ratio": 0.55}  # shared fill vs upstream eager per rank, at most


def _config(args: argparse.Namespace) -> dict[str, Any]:
    small = bool(getattr(args, "small", False))
    cfg: dict[str, Any] = {
        "items": 8 if small else 24,
        "shape": [96, 96, 64] if small else [320, 320, 200],
        "crop": 32 if small else 64,
        "epochs": 2 if small else 3,
        "world": 2,
        "workers": 2,  # DataLoader workers per rank
        "cache_threads": 1,  # CacheDataset(num_workers=...), upstream's default: the 2 ranks keep the 2 cores busy
        "batch_size": 2,  # items per batch, 2 random crops each
        "timeout": float(getattr(args, "timeout", None) or 900),
    }
    if getattr(args, "ddp_items", None):
        cfg["items"] = int(args.ddp_items)
    if getattr(args, "ddp_epochs", None):
        cfg["epochs"] = int(args.ddp_epochs)
    return cfg


def make_data(data_dir: Path, n: int, shape: list[int]) -> list[dict[str, str]]:
    """Synthetic CT-like volumes (int16 image, uint8 label of a few spheres) as ``.nii.gz``, written once."""
    tag = f"{n}x{'x'.join(map(str, shape))}"
    folder = data_dir / tag
    files = [
        {"image": str(folder / f"img{i:03d}.nii.gz"), "label": str(folder / f"seg{i:03d}.nii.gz")} for i in range(n)
    ]
    if (folder / "done.json").exists():
        return files
    import nibabel as nib
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    for i, item in enumerate(files):
        rng = np.random.default_rng(i)
        label = np.zeros(shape, np.uint8)
        grid = np.ogrid[tuple(slice(0, s) for s in shape)]
        for _ in range(6):
            radius = rng.uniform(min(shape) / 12, min(shape) / 6)
            center = [rng.uniform(radius, s - radius) for s in shape]
            label[sum((g - c) ** 2 for g, c in zip(grid, center)) <= radius**2] = 1
        image = (label * 300.0 + 100.0 + rng.normal(0.0, 20.0, shape)).astype(np.int16)
        nib.Nifti1Image(image, np.eye(4)).to_filename(item["image"])
        nib.Nifti1Image(label, np.eye(4)).to_filename(item["label"])
    (folder / "done.json").write_text(json.dumps({"items": n, "shape": shape}))
    return files


def _log(msg: str) -> None:
    print(f"[bench_ddp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(cfg_path: str) -> int:
    """The launcher process (torchrun-like): start the ranks, stop them all if one fails or the time is up."""
    cfg = json.loads(Path(cfg_path).read_text())
    world, work = cfg["world"], Path(cfg["work"])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        with open(work / f"rank{rank}.log", "w") as log:
            cmd = [sys.executable, str(RANK_SCRIPT), cfg_path]
            renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), BENCH_DDP_LAUNCHED=repr(time.time()))
            procs.append(subprocess.Popen(cmd, env=renv, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + cfg["timeout"]
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=15)
    return 0 if all(p.returncode == 0 for p in procs) else 1


def _run_variant(name: str, tree: Path, base: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Run one variant in fresh processes: times, computations and the peak footprint of the launcher's tree."""
    work = out_dir / "ddp" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = dict(base, variant=name, work=str(work))
    (work / "config.json").write_text(json.dumps(cfg))
    store_file = work / "store_dir.txt"  # written by rank 0 of the fork's variants

    def store_dirs() -> list[str]:
        return [store_file.read_text().strip()] if store_file.exists() else []

    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(out_dir / "pycache"))
    env["MONAI_CACHE_FAST_PATH"] = "1"  # the fork's variants measure the full stack (ignored by the upstream tree)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    _log(f"start {name} ({tree})")
    result: dict[str, Any] = dict(VARIANTS[name])
    start, code = time.perf_counter(), None
    cmd = [sys.executable, str(Path(__file__).resolve()), "--launch", str(work / "config.json")]
    launcher = subprocess.Popen(cmd, env=env, cwd=str(work), start_new_session=True)
    try:
        with procmem.PeakSampler(root_pid=launcher.pid, store_dirs=store_dirs, interval=0.4) as sampler:
            code = launcher.wait(timeout=cfg["timeout"] + 60)
    except subprocess.TimeoutExpired:
        result["error"] = f"timed out after {cfg['timeout'] + 60:.0f} s"
    finally:  # whatever is left of the variant's session: nothing, unless something failed
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        launcher.wait(timeout=30)
    result["wall_s"] = time.perf_counter() - start
    result["peak"] = {k: v for k, v in (sampler.result or {}).items() if k != "per_process_pss_kib"}
    left = [d for d in store_dirs() if os.path.exists(d)]
    result["store_removed"] = not left if store_dirs() else None
    for d in left:  # the store goes with its last participant: a leftover is reported, then removed
        shutil.rmtree(d, ignore_errors=True)
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    if code != 0 or len(ranks) != cfg["world"]:
        logs = "".join(p.read_text()[-2000:] for p in sorted(work.glob("rank*.log")))
        result.setdefault("error", f"exit {code}: {logs}")
        _log(f"FAILED {name}: {result['error'][-400:]}")
        return result
    log = work / "computations.log"
    result["computations"] = len(log.read_text().splitlines()) if log.exists() else 0
    for key in ("first_batch_s", "first_batch_from_launch_s", "setup_s"):
        result[key] = max(r[key] for r in ranks)  # the slowest rank
    for key in ("epoch_s", "computations_after_setup", "computations_after_epoch", "loss", "cache_stats"):
        result[key] = ranks[0].get(key)
    _log(f"done  {name} in {result['wall_s']:.1f} s")
    return result


def _prepare_trees(args: argparse.Namespace, out_dir: Path) -> dict[str, Path]:
    """The fork's tree (``layout --if-stale``) and the pristine upstream tree, prepared as ``bench_cache.py`` does."""
    ns = argparse.Namespace(no_refresh=bool(getattr(args, "no_refresh", False)), skip_upstream=False)
    upstream = prepare_trees(ns, out_dir)  # skip_upstream=False: always a tree
    assert upstream is not None
    return {"fork": FORK_TREE, "upstream": upstream}


def _checks(variants: dict[str, Any], items: int) -> list[dict[str, Any]]:
    """The targets, in the format of ``bench_cache.py``'s checks (status, value, limit, text, shown, line)."""
    fill, eager = variants.get("shared_fill", {}), variants.get("upstream_eager", {})
    ok = bool(fill) and bool(eager) and "error" not in fill and "error" not in eager
    n = fill.get("computations") if ok else None
    text = "shared eager fill: computations per node == items"
    rows: list[tuple[str, str, Any, float, bool | None, str]] = [
        ("fill_once", text, n, items, None if n is None else n == items, f"{n} for {items} items")
    ]
    ttfb = fill["first_batch_s"] / eager["first_batch_s"] if ok else None
    footprint = fill["peak"]["footprint_bytes"] / eager["peak"]["footprint_bytes"] if ok else None
    for key, text, value in (
        ("ttfb_ratio", "shared eager fill time to first batch vs upstream eager per rank", ttfb),
        ("footprint_ratio", "shared eager fill peak footprint vs upstream eager per rank", footprint),
    ):
        shown = "n/a" if value is None else f"{value:.2f}x (<= {TARGETS[key]:g}x)"
        rows.append((key, text, value, TARGETS[key], None if value is None else value <= TARGETS[key], shown))
    checks = []
    for name, text, value, limit, passed, shown in rows:
        status = "SKIP" if passed is None else ("PASS" if passed else "FAIL")
        line = f"{status}  {text}: {shown}"
        checks.append(dict(name=name, status=status, value=value, limit=limit, text=text, shown=shown, line=line))
    return checks


def run_section(args: argparse.Namespace, out_dir: Path | str, trees: Mapping[str, Path] | None = None) -> dict:
    """Run the 4 variants; ``trees`` maps ``"fork"`` and ``"upstream"`` to their trees (prepared here if None)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    trees = dict(trees) if trees else _prepare_trees(args, out_dir)
    cfg = _config(args)
    _log(f"synthetic NIfTI data: {cfg['items']} volumes of {cfg['shape']} in {out_dir / 'ddp-data'}")
    cfg["files"] = make_data(out_dir / "ddp-data", cfg["items"], cfg["shape"])
    variants = {name: _run_variant(name, Path(trees[v["tree"]]), cfg, out_dir) for name, v in VARIANTS.items()}
    del cfg["files"]
    result: dict[str, Any] = {"config": cfg, "variants": variants, "checks": _checks(variants, cfg["items"])}
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["elapsed_s"] = time.perf_counter() - started
    (out_dir / "ddp" / "results.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def report_lines(result: dict[str, Any]) -> list[str]:
    """The plain-text report of :func:`run_section`: the setup, a table of the variants, the targets."""
    if "variants" not in result:
        return [f"ddp section failed: {str(result.get('error', 'no result')).strip()[-2000:]}"]
    cfg, variants = result["config"], result["variants"]
    item = 8 * math.prod(cfg["shape"])  # image and label, float32 after LoadImaged
    lines = [
        f"{cfg['world']} ranks x {cfg['workers']} DataLoader workers (gloo, CPU); {cfg['items']} NIfTI volumes of "
        f"{'x'.join(map(str, cfg['shape']))}, cached item (image + label float32) {item / MIB:.0f} MiB, one copy "
        f"{cfg['items'] * item / MIB:.0f} MiB; crops {cfg['crop']}^3 x 2, batch {cfg['batch_size']}, "
        f"{cfg['epochs']} epochs; CacheDataset(num_workers={cfg['cache_threads']})",
        "1st batch: seconds from the start of the dataset setup (after a barrier; includes create_shared_cache, the "
        "constructor and fill()) to the first batch, slowest rank. computed: runs of the cached transforms, all "
        "processes, whole run. footprint: peak over the variant's process tree (procmem).",
    ]
    head = ["variant", "tree", "computed", "1st batch s", "epochs s", "wall s", "peak footprint MiB", "shm MiB", "x 1."]
    rows: list[list[str]] = []
    eager = variants.get("upstream_eager", {}).get("peak", {}).get("footprint_bytes")
    for v in variants.values():
        if "error" in v:
            rows.append([v["label"], v["tree"], "error", *[""] * 6])
            continue
        fp = v["peak"]["footprint_bytes"]
        epochs = " / ".join(f"{t:.1f}" for t in v["epoch_s"])
        row = [v["label"], v["tree"], str(v["computations"]), f"{v['first_batch_s']:.1f}", epochs, f"{v['wall_s']:.0f}"]
        rows.append(
            row + [f"{fp / MIB:.0f}", f"{v['peak']['shm_bytes'] / MIB:.0f}", f"{fp / eager:.2f}" if eager else ""]
        )
    lines += ["", *plain_table(head, rows).splitlines(), "", "TARGETS (ratios measured in this run):"]
    lines += [f"  {c['line']}" for c in result["checks"]]
    for name, v in variants.items():
        if v.get("store_removed") is False:
            lines.append(f"  NOTE  {name}: the store's directory was left behind (removed by the benchmark)")
        if "error" in v:
            lines.append(f"  ERROR {name}: {(v['error'].strip().splitlines() or [''])[-1]}")
        if v.get("cache_stats"):
            lines.append(f"  {name}: rank 0 ds.cache_stats() at the end: {v['cache_stats']}")
    lines.append(f"section time {result['elapsed_s']:.0f} s (load average at the end {result['loadavg_end'][0]})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="8 small volumes, 2 epochs: a quick run")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT), help="output directory (default benchmarks/output)")
    parser.add_argument("--ddp-items", type=int, help="number of volumes (default 24, --small 8)")
    parser.add_argument("--ddp-epochs", type=int, help="epochs (default 3, --small 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for each variant")
    parser.add_argument("--no-refresh", action="store_true", help="do not refresh build/tree (layout --if-stale)")
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.launch:
        return _launch(args.launch)
    result = run_section(args, Path(args.out_dir))
    print("\n".join(report_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
