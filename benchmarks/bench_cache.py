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
numbers that matter are the RATIOS of one run (the machine may be shared), each a median over repetitions. Every
run of the hits section measures the store twice: with its Linux fast path (path 5, ``MONAI_CACHE_FAST_PATH=1``) and
without it (path 5b, the portable store, ``MONAI_CACHE_FAST_PATH=0``, in a job of its own: the variable is read at
the import of monai), each against the floor and ``copy_cache=True`` timed in its own job.

Run from the repository root::

    python benchmarks/bench_cache.py            # full size, about 3-5 minutes on 2 cores
    python benchmarks/bench_cache.py --small    # quick run, under 2 minutes
    python benchmarks/bench_cache.py --small --sections hits --runs 3

Results go to ``benchmarks/output/`` (``results.json``, whose ``rows`` the PR descriptions read, ``results.md``,
``bench_cache.png``). The exit code is 0 even when a target fails, unless ``--strict`` is given. Linux only
(``/proc``, ``/dev/shm``). See ``benchmarks/README.md`` (the map of the modules: this one is the command, it parses
the flags and runs the sections' jobs).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import DEFAULT_OUT, FORK_TREE, PATHS
from bench_epochs import job_epoch
from bench_hits import job_micro_fork, job_micro_upstream
from bench_machine import hugepage_settings, machine
from bench_persistent import job_persist
from bench_report import plot, write
from bench_run import log, prepare_trees, run_subprocess, tree_version
from bench_small import job_small
from bench_summary import summarize

SECTIONS = ("hits", "epochs", "small", "ddp", "persistent")
# what ``bench_cache.py --job JOB CFG RESULT`` runs, in a subprocess started by ``bench_run.run_subprocess``
JOBS: dict[str, Callable[[dict], dict[str, Any]]] = {
    "micro_fork": job_micro_fork,
    "micro_upstream": job_micro_upstream,
    "epoch": job_epoch,
    "small": job_small,
    "persist": job_persist,
}


def run_job_main(job: str, cfg_path: str, result_path: str) -> int:
    """Run one job on the config in ``cfg_path``; write its result, or its traceback, and its warnings as JSON."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            result = JOBS[job](cfg)
        except Exception:
            result = {"error": traceback.format_exc()}
    result["job_warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:400] for w in caught})
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


def _config(args: argparse.Namespace, sections: list[str]) -> dict[str, Any]:
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
    cfg["sections"], cfg["runs"], cfg["skip_upstream"] = sections, args.runs, bool(args.skip_upstream)
    return cfg


def _sections(text: str, parser: argparse.ArgumentParser) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        parser.error(f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose among {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in chosen]


def _default_root() -> str:
    """Where the store puts its directories by default (``MONAI_CACHE_ROOT``, ``/dev/shm`` or the temp dir)."""
    root = os.environ.get("MONAI_CACHE_ROOT")
    if root:
        return root
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _module_section(
    section: str, module: str, args: argparse.Namespace, out_dir: Path, trees: dict[str, Path] | None
) -> tuple[Any, list[str]]:
    """A section implemented by ``benchmarks/<module>.py``, if it exists: (its result, its report lines)."""
    if importlib.util.find_spec(module) is None:
        print(f"{section} section: not available", file=sys.stderr)
        return None, [f"{section} section: not available (no benchmarks/{module}.py)"]
    log(f"start {section} section ({module}.py)")
    try:
        mod = importlib.import_module(module)
        result = mod.run_section(args, out_dir, trees)
    except Exception:
        result = {"error": traceback.format_exc()}
        mod = sys.modules.get(module)
    try:
        lines = list(mod.report_lines(result)) if mod is not None else [f"{section} section: {result['error']}"]
    except Exception as err:
        lines = [f"{section} section: no report ({type(err).__name__}: {err})"]
    log(f"done  {section} section")
    return result, lines


def _fork_version(raw: dict[str, Any]) -> str:
    """``monai.__version__`` of the fork's tree: as a fork job imported it, else read from the tree."""
    for key in ("micro_fork", "micro_portable", "epoch_store", "small", "persistent"):
        result = raw.get(key)
        version = result.get("info", {}).get("monai_version") if isinstance(result, dict) else None
        if version:
            return str(version)
    return tree_version(FORK_TREE) or "unknown"


def _run(args: argparse.Namespace, cfg: dict[str, Any], out_dir: Path) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Run the chosen sections: the raw results, and the report lines of the other sections (title: lines)."""
    upstream, refreshed = None, False
    if {"hits", "epochs", "small"} & set(cfg["sections"]):  # the fork's tree; the upstream tree for hits and epochs
        prepare = argparse.Namespace(**vars(args))
        prepare.skip_upstream = args.skip_upstream or not {"hits", "epochs"} & set(cfg["sections"])
        upstream, refreshed = prepare_trees(prepare, out_dir), True
    raw: dict[str, Any] = {}
    extra: dict[str, list[str]] = {}
    if "hits" in cfg["sections"]:
        # each run in fresh subprocesses: the store with its fast path (paths 1, 2, 5, 6), then without it (1, 2, 5b;
        # MONAI_CACHE_FAST_PATH=0 is read at the import of monai, hence a process of its own)
        for run in range(1, args.runs + 1):
            for variant, key in (("full", "micro_fork"), ("portable", "micro_portable")):
                tag = key if args.runs == 1 else f"{key}-run{run}"
                job_cfg = dict(cfg, run=run, variant=variant)
                result = run_subprocess(
                    "micro_fork", FORK_TREE, job_cfg, out_dir, args.timeout, tag=tag, fast_path=variant == "full"
                )
                if run == 1:
                    raw[key] = result
                else:
                    raw.setdefault(f"{key}_extra_runs", []).append(result)
        if upstream is not None:
            raw["micro_upstream"] = run_subprocess("micro_upstream", upstream, cfg, out_dir, args.timeout)
    if "epochs" in cfg["sections"]:
        raw["epoch_baseline"] = run_subprocess("epoch", FORK_TREE, dict(cfg, path="baseline"), out_dir, args.timeout)
        for name, spec in PATHS.items():
            if spec["tree"] == "upstream" and upstream is None:
                continue
            tree = FORK_TREE if spec["tree"] == "fork" else upstream
            assert tree is not None
            raw[f"epoch_{name}"] = run_subprocess("epoch", tree, dict(cfg, path=name), out_dir, args.timeout)
    if "small" in cfg["sections"]:
        raw["small"] = run_subprocess("small", FORK_TREE, cfg, out_dir, args.timeout)
    if "ddp" in cfg["sections"]:
        # without the upstream tree (--skip-upstream, or no hits/epochs), bench_ddp.py prepares the trees itself
        trees = {"fork": FORK_TREE, "upstream": upstream} if upstream else None
        result, lines = _module_section("ddp", "bench_ddp", args, out_dir, trees)
        if result is not None:
            raw["ddp"] = result
        extra["DDP (bench_ddp.py)"] = lines
    if "persistent" in cfg["sections"]:
        # the fork's tree only; refreshed by the section itself unless an earlier section did
        trees = {"fork": FORK_TREE} if refreshed else None
        result, lines = _module_section("persistent", "bench_persistent", args, out_dir, trees)
        if result is not None:
            raw["persistent"] = result
        extra["Persistent store (bench_persistent.py)"] = lines  # bench_persistent.TITLE
    return raw, extra


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="items of 4x96x96x64 (crop 48^3) for a quick run")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"sections to run, among {','.join(SECTIONS)} (default: all; persistent: bench_persistent.py)",
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="runs of the hits section (each: the store with and without its fast path)"
    )
    parser.add_argument("--reps", type=int, help="timed hits per path (default 25, --small 40)")
    parser.add_argument("--items", type=int, help="items K in the DataLoader epochs (default 4, --small 16)")
    parser.add_argument("--epochs", type=int, default=3, help="timed warm epochs (median reported)")
    parser.add_argument("--small-items", type=int, default=20000, help="number of 1 KiB items of the fd test")
    parser.add_argument("--mapped-items", type=int, default=2000, help="number of 96 KiB (mapped) items kept alive")
    parser.add_argument("--store-root", help="also time the store with its files in this directory (path 6)")
    parser.add_argument("--skip-upstream", action="store_true", help="skip the upstream 1.6.1 ListProxy paths")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT), help="output directory (default benchmarks/output)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target fails")
    parser.add_argument("--no-refresh", action="store_true", help="do not refresh build/tree (layout --if-stale)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for each subprocess")
    parser.add_argument("--job", nargs=3, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.job:
        return run_job_main(*args.job)
    sections = _sections(args.sections, parser)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not sys.platform.startswith("linux"):
        print("this benchmark needs Linux (/proc, /dev/shm)", file=sys.stderr)
        return 2

    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = _config(args, sections)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # the run's start, UTC
    started = time.perf_counter()
    info = machine()
    info["hugepages"] = hugepage_settings([_default_root(), *([cfg["store_root"]] if cfg["store_root"] else [])])
    raw, extra = _run(args, cfg, out_dir)
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    for key, value in raw.items():
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, dict) and isinstance(one.get("error"), str):
                print(f"\n!! {key} failed:\n{one['error']}", file=sys.stderr)
            for message in one.get("job_warnings", []) if isinstance(one, dict) else []:
                if "monai" in message.lower() or "cache" in message.lower():
                    log(f"warning in {key}: {message}")

    summary = summarize(raw, cfg)
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python benchmarks/bench_cache.py", *(shlex.quote(a) for a in given)])
    meta = {"date": date, "version": _fork_version(raw), "command": command}
    elapsed = time.perf_counter() - started
    print(write(out_dir, meta, cfg, info, raw, summary, extra, elapsed))
    plot_error = plot(summary, out_dir / "bench_cache.png")
    if plot_error:
        print(plot_error, file=sys.stderr)
    shutil.rmtree(out_dir / "jobs", ignore_errors=True)
    section_checks = [
        c for key in ("ddp", "persistent") if isinstance(raw.get(key), dict) for c in raw[key].get("checks", [])
    ]
    failed = [c for c in [*summary["checks"], *section_checks] if isinstance(c, dict) and c.get("status") == "FAIL"]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
