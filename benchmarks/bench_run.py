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
How the driver runs the jobs: each in a subprocess of its own (``bench_cache.py --job JOB CFG RESULT``, whose
registry of jobs is ``bench_cache.JOBS``) with ``PYTHONPATH`` set to one tree (the fork's laid-out tree or a pristine
upstream 1.6.1 tree) and ``MONAI_CACHE_FAST_PATH`` set for the fork's store (``1``, or ``0`` for the portable path
5b), and the preparation of those trees. It imports no job module: the sections' drivers (``bench_ddp``,
``bench_persistent``) import it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import BUILD_SCRIPT, FAST_PATH_ENV, REPO

SCRIPT = Path(__file__).resolve().with_name("bench_cache.py")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_subprocess(
    job: str, tree: Path, cfg: dict, out_dir: Path, timeout: float, tag: str | None = None, fast_path: bool = True
) -> dict[str, Any]:
    """
    Run one job in a subprocess with ``PYTHONPATH=tree``; returns its result (or an ``error`` entry). ``fast_path``:
    the value of ``MONAI_CACHE_FAST_PATH`` in the subprocess (``1``: the fork's store with its Linux fast path, as
    the user's environment may say otherwise; ``0``: the portable store; the upstream tree ignores it).
    """
    label = tag or f"{job} {cfg.get('path', '')}".strip()
    log(f"start {label} ({tree.name})")
    work = out_dir / "jobs"
    work.mkdir(parents=True, exist_ok=True)
    tag = tag or f"{job}-{cfg.get('path', 'all')}"
    cfg_file, result_file = work / f"{tag}.cfg.json", work / f"{tag}.result.json"
    cfg_file.write_text(json.dumps(cfg))
    result_file.unlink(missing_ok=True)
    # bytecode of both trees is cached under the output directory, not in the trees (whatever PYTHONDONTWRITEBYTECODE)
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(out_dir / "pycache"))
    env[FAST_PATH_ENV] = "1" if fast_path else "0"
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, str(SCRIPT), "--job", job, str(cfg_file), str(result_file)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=str(out_dir), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"TIMEOUT {label} after {timeout:.0f} s")
        return {"error": f"timed out after {timeout:.0f} s"}
    elapsed = time.perf_counter() - start
    (out_dir / "logs").mkdir(exist_ok=True)
    (out_dir / "logs" / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result_file.exists():
        log(f"FAILED {label} (exit {proc.returncode})")
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    result = json.loads(result_file.read_text())
    if "error" in result and isinstance(result["error"], str):
        log(f"ERROR in {label}: {result['error'].strip().splitlines()[-1]}")
    else:
        log(f"done  {label} in {elapsed:.1f} s")
    return result


def tree_version(tree: Path) -> str | None:
    """``monai.__version__`` of a laid-out tree, read from its ``monai/_version.py`` without importing monai (torch)."""
    try:
        spec = importlib.util.spec_from_file_location("_bench_monai_version", tree / "monai" / "_version.py")
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return str(module.get_versions()["version"])
    except Exception:  # no tree, or another kind of _version.py: the jobs report monai.__version__ anyway
        return None


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


def prepare_trees(args: argparse.Namespace, out_dir: Path) -> Path | None:
    """Refresh the fork's tree (``layout --if-stale``) and unpack the pristine upstream tree unless it is intact."""
    if not args.no_refresh:
        subprocess.run([sys.executable, str(BUILD_SCRIPT), "layout", "--if-stale"], check=True, cwd=str(REPO))
    if args.skip_upstream:
        return None
    upstream = out_dir / "upstream-tree"
    if not _is_pristine(upstream):  # kept otherwise, so that its cached bytecode stays valid
        log(f"unpacking upstream 1.6.1 into {upstream}")
        cmd = [sys.executable, str(BUILD_SCRIPT), "pristine", str(upstream)]
        subprocess.run(cmd, check=True, cwd=str(REPO), capture_output=True)
        if not _is_pristine(upstream):
            raise RuntimeError(f"{upstream} does not match the RECORD of the upstream wheel")
    return upstream
