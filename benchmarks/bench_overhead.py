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
What the fork costs those who never make a store (``python benchmarks/bench_overhead.py [--rounds 7]``), against
pristine upstream 1.6.1, as ratios of one run:

- ``import monai`` in a fresh interpreter (the median of ``--rounds`` interpreters per tree, interleaved);
- a hit of a small item with the default ``runtime_cache=False`` (a 4-element array, a cached ``Lambda``; the
  best of 7 rounds of 20,000 hits, each tree in its own interpreter, interleaved ``--rounds`` times, the median taken);
- what ``import monai`` and that eager path leave registered: at-fork hooks of the store and libc loaded.

Prints a table and writes ``benchmarks/output/overhead.json``. Uses ``build/tree`` (laid out if stale) and a pristine
upstream tree under ``benchmarks/output/upstream-tree`` (unpacked from the pinned wheel if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORK = ROOT / "build" / "tree"
UPSTREAM = ROOT / "benchmarks" / "output" / "upstream-tree"

IMPORT = "import time; t = time.perf_counter(); import monai; print(time.perf_counter() - t)"
HIT = """
import time
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
print(best)
"""
HOOKS = """
import json
import numpy as np
import monai
import sys
from monai.data import CacheDataset, _cache_locks
from monai.transforms import Compose, Lambda
ds = CacheDataset([np.zeros(4)] * 4, Compose([Lambda(lambda x: x)]), progress=False)
[ds[i] for i in range(4)]
pool = sys.modules.get("monai_sharedcache._pool")  # the fork's layer, not imported before a store is made
decided = pool is not None and "ENABLED" in vars(pool)
counts = "monai_sharedcache.counters" in sys.modules  # registers its hook when imported, at a first store
hooks = int(bool(_cache_locks._HOOKED)) + int(counts) + int(decided)
print(json.dumps({"at_fork_hooks": hooks, "libc_loaded": pool is not None and pool._LIBC_LOADED}))
"""


def run(tree: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    build = [sys.executable, str(ROOT / "build_backend" / "monai_sharedcache_build.py")]
    subprocess.run(build + ["layout", str(FORK), "--if-stale"], check=True, capture_output=True)
    if not (UPSTREAM / "monai").is_dir():
        subprocess.run(build + ["pristine", str(UPSTREAM)], check=True, capture_output=True)
    trees = {"upstream": UPSTREAM, "fork": FORK}
    times: dict[str, dict[str, list[float]]] = {name: {"import": [], "hit": []} for name in trees}
    for _ in range(args.rounds):  # interleaved, so that both trees see the same load
        for name, tree in trees.items():
            times[name]["import"].append(float(run(tree, IMPORT)))
            times[name]["hit"].append(float(run(tree, HIT)))
    median = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    hooks = json.loads(run(FORK, HOOKS))
    version = run(FORK, "import monai; print(monai.__version__)")
    report = {
        "version": version,
        "date": time.strftime("%Y-%m-%d"),
        "rounds": args.rounds,
        "import_s": {name: m["import"] for name, m in median.items()},
        "eager_hit_us": {name: m["hit"] * 1e6 for name, m in median.items()},
        "import_ratio": median["fork"]["import"] / median["upstream"]["import"],
        "eager_hit_ratio": median["fork"]["hit"] / median["upstream"]["hit"],
        "spread": {name: {k: [min(v), max(v)] for k, v in t.items()} for name, t in times.items()},
        **hooks,
    }
    print(f"MONAI {version} against upstream 1.6.1, medians of {args.rounds} interleaved rounds")
    for what, unit, scale in (("import", "s", 1.0), ("hit", "us", 1e6)):
        up, fork = median["upstream"][what] * scale, median["fork"][what] * scale
        print(f"{what:8s} upstream {up:8.3f} {unit}  fork {fork:8.3f} {unit}  {fork / up:5.2f}x")
    print(
        f"after import and the eager path: {hooks['at_fork_hooks']} at-fork hooks, libc loaded: {hooks['libc_loaded']}"
    )
    out = ROOT / "benchmarks" / "output"
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
