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
``runtime_cache="process"`` before and after PR 05, which makes it the store: pristine MONAI 1.6.1 (a ``Manager``
list) against the fork, where the users of ``"process"`` run today (``python benchmarks/bench_process.py``, as root
for the 64 MB ``/dev/shm``, which needs a mount namespace):

- ``shm64``: Docker's default 64 MB ``/dev/shm`` (a tmpfs of 64 MB mounted over it in a private mount namespace),
  48 items of 2 MiB (1.5 times its size), 2 forked DataLoader workers, 3 epochs;
- ``nofile``: ``ulimit -n 1024`` (set before the dataset, so the ``Manager`` server inherits it), 600 items of an
  image and a label tensor, 2 forked workers, 2 epochs;
- ``spawn`` and ``forkserver``: 16 items of 8 MiB, 2 workers of that start method, 3 epochs;
- ``nofcntl``: a Python whose ``import fcntl`` fails, as on Windows (``tests/modes/nofcntl``, spawn), where the fork
  keeps the checked ``Manager`` list: 16 items of 8 MiB, 2 workers, 3 epochs.

Each run is a fresh interpreter. It reports whether the job finished, the items computed in each epoch (by any
process) and the epoch times; every item read is checked. Prints a table and writes ``benchmarks/output/process.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import DEFAULT_OUT, FORK_TREE, REPO, md_table
from bench_run import prepare_trees

JOB = """
import json, os, resource, sys, time
import torch
from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, RandomizableTransform, Transform

N, NUMEL, CTX, NOFILE, EPOCHS, LOG = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), 3, sys.argv[5]

class Load(Transform):
    def __call__(self, i):
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"x")
        os.close(fd)
        return {"src": i, "img": torch.full((NUMEL,), float(i)), "label": torch.full((4,), float(i))}

class Check(RandomizableTransform):
    def __call__(self, d):
        return {"src": d["src"], "ok": bool(d["img"][-1] == d["src"] and d["label"][0] == d["src"])}

if __name__ == "__main__":
    if NOFILE:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    ds = CacheDataset(list(range(N)), Compose([Load(), Check()]), runtime_cache="process", progress=False)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=CTX or None, timeout=600)
    for epoch in range(EPOCHS if NUMEL > 1000 else 2):
        start, seen = time.perf_counter(), []
        for batch in loader:
            assert all(batch["ok"]), batch
            seen += batch["src"].tolist()
        assert sorted(seen) == list(range(N)), seen
        print(json.dumps({"epoch": epoch, "s": time.perf_counter() - start, "computed": os.path.getsize(LOG)}))
        sys.stdout.flush()
"""

# name: items, floats per image, start method of the workers, RLIMIT_NOFILE (0: unchanged), extra PYTHONPATH
SCENARIOS = {
    "shm64": (48, 512 * 1024, "fork", 0, None),
    "nofile": (600, 256, "fork", 1024, None),
    "spawn": (16, 2 * 1024 * 1024, "spawn", 0, None),
    "forkserver": (16, 2 * 1024 * 1024, "forkserver", 0, None),
    "nofcntl": (16, 2 * 1024 * 1024, "spawn", 0, REPO / "tests" / "modes" / "nofcntl"),
}


def run(tree: Path, name: str, tmp: Path, timeout: float) -> dict:
    """One scenario in a fresh interpreter on ``tree``: its epochs, or how it failed."""
    n, numel, ctx, nofile, extra = SCENARIOS[name]
    script, log = tmp / f"job_{name}.py", tmp / f"log_{name}_{tree.name}"
    script.write_text(JOB)
    log.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (extra, tree) if p)}
    cmd = [sys.executable, str(script), str(n), str(numel), ctx, str(nofile), str(log)]
    if name == "shm64":  # a private mount namespace: /dev/shm of the machine is left alone
        shell = "mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec " + " ".join(cmd)
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", (e.stdout or b"").decode(), (e.stderr or b"").decode()
    epochs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    errors = [ln.strip() for ln in err.splitlines() if "Error" in ln or "error" in ln]
    return {
        "rc": rc,
        "epochs": epochs,
        "error": errors[-1][:200] if errors else "",
        "wall_s": time.perf_counter() - start,
    }


def cell(r: dict) -> str:
    """``3 epochs: computed 48, 0, 0; 2.1, 0.4, 0.4 s`` or ``failed in epoch 1: <error>``."""
    done = len(r["epochs"])
    counts, before = [], 0
    for e in r["epochs"]:
        counts.append(str(e["computed"] - before))
        before = e["computed"]
    text = f"computed {', '.join(counts)}; " + ", ".join(f"{e['s']:.1f}" for e in r["epochs"]) + " s" if done else ""
    if r["rc"] == 0:
        return text
    return f"**fails** in epoch {done + 1} ({r['error'] or r['rc']})" + (f" after {text}" if done else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for each run")
    parser.add_argument("--no-refresh", action="store_true", help="do not lay out the fork's tree first")
    args = parser.parse_args()
    args.skip_upstream = False
    args.out_dir.mkdir(parents=True, exist_ok=True)
    upstream = prepare_trees(args, args.out_dir)
    assert upstream is not None
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios.split(","):
            for label, tree in (("upstream", upstream), ("fork", FORK_TREE)):
                results.setdefault(name, {})[label] = r = run(tree, name, Path(tmp), args.timeout)
                print(f"{name} {label}: {cell(r)}", flush=True)
    rows = [[name, cell(r["upstream"]), cell(r["fork"])] for name, r in results.items()]
    print(md_table(["scenario", "upstream 1.6.1 (Manager list)", "fork (store)"], rows))
    (args.out_dir / "process.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
