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
Run every recipe of ``tutorials/shared_cache/`` against the patched tree (the fork's wheel); fail if one fails.

    python tutorials/run_recipes.py                 # all of them, (cores + 1) at a time
    python tutorials/run_recipes.py -j 1 --only hash_as_key --only faults
    python tutorials/run_recipes.py --list

Each recipe is a complete script that checks its own results (it exits non-zero, or prints no final ``ok``, on any
problem). They run with ``PYTHONPATH=build/tree`` (laid out first if it is stale, as ``runtests.sh`` does) and a
timeout each, in their own process group, which is killed on timeout:

- the single-process ones with ``python <recipe>``; ``mp_spawn.py`` and ``bring_your_own_listproxy.py`` start their
  ranks themselves with ``torch.multiprocessing.spawn``;
- ``torchrun_one_node.py`` and ``fill_before_training.py`` with ``python -m torch.distributed.run --standalone --nproc_per_node=2``;
- ``multi_node.py`` as two nodes on this machine: two ``torch.distributed.run --nnodes=2 --node_rank=<n>`` launches
  of one rank each, told apart by ``MONAI_CACHE_NODE_ID=node<n>``.

The output of each recipe goes to ``build/recipes/<name>.log`` and is printed if the recipe fails. Exit status:
0 if every selected recipe passed, 1 otherwise, 2 for bad arguments or no patched tree.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECIPES = HERE / "shared_cache"
TREE = ROOT / "build" / "tree"
LOGS = ROOT / "build" / "recipes"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# one more than the cores: the distributed recipes spend part of their time waiting for each other
DEFAULT_JOBS = min(8, (os.cpu_count() or 2) + 1)


@dataclass
class Recipe:
    """A recipe file and the commands that run it (several commands run at once, e.g. the nodes of a job)."""

    name: str
    commands: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)
    weight: int = 1  # rough cost, to start the slow ones first

    @property
    def path(self) -> Path:
        return RECIPES / f"{self.name}.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recipes() -> list[Recipe]:
    def plain(name: str, weight: int = 1) -> Recipe:
        return Recipe(name, [([sys.executable, str(RECIPES / f"{name}.py")], {})], weight)

    out = [
        plain("single_process"),
        plain("dataloader_workers"),
        plain("set_data_between_epochs"),
        plain("hash_as_key"),
        plain("faults"),
        plain("measure_memory"),
        plain("keep_across_runs", 2),
        plain("mp_spawn", 3),
        plain("bring_your_own_listproxy", 3),
        Recipe(
            "torchrun_one_node",
            [([*TORCHRUN, "--standalone", "--nproc_per_node=2", str(RECIPES / "torchrun_one_node.py")], {})],
            3,
        ),
        Recipe(
            "fill_before_training",
            [([*TORCHRUN, "--standalone", "--nproc_per_node=2", str(RECIPES / "fill_before_training.py")], {})],
            3,
        ),
    ]
    port = str(free_port())
    nodes = []
    for node in range(2):
        cmd = [
            *TORCHRUN,
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(RECIPES / "multi_node.py"),
        ]
        nodes.append((cmd, {"MONAI_CACHE_NODE_ID": f"node{node}"}))
    out.append(Recipe("multi_node", nodes, 3))
    return out


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TREE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")  # the recipes share the cores with each other
    env["PYTHONUNBUFFERED"] = "1"
    return env


_print_lock = threading.Lock()
_live_lock = threading.Lock()
_live: set[subprocess.Popen] = set()  # the running recipe processes, killed on Ctrl-C


def say(text: str) -> None:
    with _print_lock:
        print(text, flush=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group that ``proc`` leads (the recipe, its ranks and their DataLoader workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(recipe: Recipe, timeout: float) -> tuple[Recipe, bool, float, str]:
    """Run the commands of ``recipe`` at once; passed if all exit with 0 and the output ends with ``ok``."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{recipe.name}.log"
    start = time.monotonic()
    procs = []
    with open(log_path, "wb") as log:
        for cmd, extra in recipe.commands:
            env = {**base_env(), **extra}
            log.write(f"$ {''.join(f'{k}={v} ' for k, v in extra.items())}{' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=str(RECIPES),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, to kill everything it started on timeout
            )
            procs.append(proc)
            with _live_lock:
                _live.add(proc)
        why = ""
        deadline = start + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                why = f"timed out after {timeout:.0f} s"
                break
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
            else:
                kill_group(proc)  # leftovers of a finished recipe, if any
            with _live_lock:
                _live.discard(proc)
    elapsed = time.monotonic() - start
    output = log_path.read_text(errors="replace")
    if not why:
        codes = [p.returncode for p in procs]
        if any(codes):
            why = f"exit status {codes}"
        elif "ok" not in [line.strip() for line in output.splitlines()]:
            why = "no final 'ok' line"
    return recipe, not why, elapsed, why


def ensure_tree(layout: bool) -> bool:
    if layout or not (TREE / "monai" / "__init__.py").is_file():
        build = [sys.executable, str(ROOT / "build_backend" / "monai_sharedcache_build.py"), "layout", "--if-stale"]
        if subprocess.run(build, cwd=str(ROOT)).returncode != 0:
            return False
    # a tree of the fork's wheel: the package, and the fork's patch that gives its names to monai.data (the recipes
    # import them from there); an upstream MONAI, with or without the series, has neither
    package = (TREE / "monai_sharedcache" / "store.py").is_file()
    return package and "SharedCacheStore" in (TREE / "monai" / "data" / "__init__.py").read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-j", "--jobs", type=int, default=DEFAULT_JOBS, help=f"recipes run at once (default: {DEFAULT_JOBS})"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per recipe (default: 240)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only this recipe (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument(
        "--no-layout", dest="layout", action="store_false", help="use build/tree as it is (not refreshed if stale)"
    )
    args = parser.parse_args(argv)

    all_recipes = recipes()
    known = {r.name for r in all_recipes}
    on_disk = {p.stem for p in RECIPES.glob("*.py")}
    if on_disk - known:
        print(f"error: recipes without a way to run them here: {sorted(on_disk - known)}", file=sys.stderr)
        return 2
    if args.list:
        for r in all_recipes:
            for cmd, extra in r.commands:
                env = "".join(f"{k}={v} " for k, v in extra.items())
                print(f"{r.name:<26} {env}python {' '.join(cmd[1:])}")
        return 0
    unknown = set(args.only) - known
    if unknown:
        print(f"error: unknown recipes {sorted(unknown)}; known: {sorted(known)}", file=sys.stderr)
        return 2
    selected = [r for r in all_recipes if not args.only or r.name in args.only]
    if not ensure_tree(args.layout):
        print(f"error: no patched tree in {TREE}", file=sys.stderr)
        return 2

    selected.sort(key=lambda r: -r.weight)  # slow ones first, the short ones fill the gaps
    start = time.monotonic()
    results = []
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    futures = []
    try:
        futures = [pool.submit(run, r, args.timeout) for r in selected]
        for future in as_completed(futures):
            recipe, ok, elapsed, why = future.result()
            say(f"{'PASS' if ok else 'FAIL'}  {recipe.name:<26} {elapsed:6.1f} s  {why}")
            if not ok:
                text = (LOGS / f"{recipe.name}.log").read_text(errors="replace")
                say("    | " + "\n    | ".join(text.splitlines()[-40:]))
            results.append((recipe, ok, elapsed))
    except KeyboardInterrupt:
        for future in futures:
            future.cancel()
        with _live_lock:
            for proc in _live:
                kill_group(proc)
        say("interrupted")
        return 130
    finally:
        pool.shutdown(wait=True)
    total = time.monotonic() - start
    failed = [r.name for r, ok, _ in results if not ok]
    say(
        f"{len(results) - len(failed)}/{len(results)} recipes passed in {total:.1f} s "
        f"({args.jobs} at a time; logs in {LOGS.relative_to(ROOT)})"
    )
    if failed:
        say(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
