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
What anchoring the store costs on a hit of the portable store (issue 22: at most 2% more than before):
``python benchmarks/bench_anchor.py [--before REV] [--rounds 9] [--reps 25]``.

Two trees: the store before it was anchored, and this version's. The series of this repository's git revision
``--before`` (by default deae873, the last with the anchored store as a PR of its own, since folded into the PRs that
own its code) is laid out up to that PR (its stage 12); this version's series is laid out whole.
In each, a fresh process makes a store on ``/dev/shm`` without the Linux fast path (``MONAI_CACHE_FAST_PATH=0``),
puts one item, and times ``--reps`` hits: ``get`` and a copied crop, as a training hit does. Two items: the hits
benchmark's (an image of 4 x 240 x 240 x 155 float32 and its label, 145 MiB; a 96^3 crop) and a small one (4 KiB; no
crop), where the fixed cost of a read shows most. The trees alternate, ``--rounds`` times, and the medians of the
rounds are printed with their ratio (after / before).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = r"""
import json, os, sys, tempfile, time
import numpy as np, torch
from monai.data import SharedCacheStore

kind, reps = sys.argv[1], int(sys.argv[2])
root = tempfile.mkdtemp(dir="/dev/shm")
store = SharedCacheStore(root=root, reserve=0)
if kind == "large":
    item = {"image": torch.rand(4, 240, 240, 155), "label": torch.zeros(1, 240, 240, 155, dtype=torch.uint8)}
else:
    item = {"image": torch.rand(1024)}
assert store.put("k", item)
rng, times = np.random.default_rng(0), []
for _ in range(reps + 3):
    t0 = time.perf_counter()
    got = store.get("k")
    if kind == "large":
        x, y, z = (int(v) for v in rng.integers(0, 240 - 96, 3))
        z = min(z, 155 - 96)
        out = got["image"][:, x : x + 96, y : y + 96, z : z + 96].clone()
    else:
        out = got["image"].clone()
    times.append(time.perf_counter() - t0)
    del got, out
store.close()
os.rmdir(root)
print(json.dumps(sorted(times[3:])[reps // 2]))
"""


def before_tree(out: Path, rev: str) -> Path:
    """Lay out the series of the git revision ``rev`` up to the anchored store's own PR into ``out``."""
    src = out.parent / "before-src"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    build = [sys.executable, str(src / "build_backend" / "monai_sharedcache_build.py"), "pristine", str(out)]
    subprocess.run([*build, "--upto", "0014-cache-store-anchored.patch"], check=True, capture_output=True)
    return out


def this_tree(out: Path) -> Path:
    """Lay out this version's whole series into ``out``."""
    build = [sys.executable, str(ROOT / "build_backend" / "monai_sharedcache_build.py"), "layout", str(out)]
    subprocess.run(build, check=True, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="deae873", help="the git revision of the store before it was anchored")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {
            "before": before_tree(Path(tmp) / "before", args.before),
            "after": this_tree(Path(tmp) / "after"),
        }
        env = {**os.environ, "MONAI_CACHE_FAST_PATH": "0"}
        for kind in ("large", "small"):
            found: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    cmd = [sys.executable, "-c", JOB, kind, str(args.reps)]
                    proc = subprocess.run(
                        cmd, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=600
                    )
                    if proc.returncode:
                        raise SystemExit(proc.stderr)
                    found[name].append(json.loads(proc.stdout))
            before, after = (statistics.median(v) for v in found.values())
            spread = {name: f"{min(v) * 1e3:.3f}..{max(v) * 1e3:.3f}" for name, v in found.items()}
            print(
                f"{kind}: before {before * 1e3:.3f} ms, after {after * 1e3:.3f} ms, ratio {after / before:.3f} "
                f"(medians of {args.rounds} rounds of {args.reps} hits; spreads in ms {spread})"
            )


if __name__ == "__main__":
    main()
