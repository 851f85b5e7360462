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
What the fork's keys cost (its layer's ``monai_sharedcache.keys``; ``PYTHONPATH=build/tree python
benchmarks/bench_keys.py [--entries 10000] [--dir DIR] [--upstream DIR]``):

- the fingerprint of a typical MONAI pipeline (``LoadImaged``, ``EnsureChannelFirstd``, ``Spacingd``,
  ``ScaleIntensityRanged``, ``CropForegroundd``): the first one in a fresh interpreter, and again;
- the constructor and ``set_data`` of a ``CacheDataset`` with a runtime cache over ``--entries`` entries, each in a
  fresh interpreter: entries naming a 100-byte file each, entries naming a 24 MB file each (sparse: no disk is
  used, but a key that read them would read 24 MB each), and entries whose label names a directory of ``--entries``
  files; then the first read of every item's key (``ds._cache[i]``: one stat per file). With ``--upstream DIR`` (a
  tree of pristine MONAI 1.6.1: ``python build_backend/monai_sharedcache_build.py pristine DIR``) the same runs on
  upstream, whose runtime cache computes no key.

Prints a table and writes ``benchmarks/output/keys.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIPELINE = """
import time
t0 = time.perf_counter()
from monai_sharedcache.keys import transforms_fingerprint
from monai.transforms import CropForegroundd, EnsureChannelFirstd, LoadImaged, ScaleIntensityRanged, Spacingd
keys = ["image", "label"]
pipeline = [
    LoadImaged(keys), EnsureChannelFirstd(keys), Spacingd(keys, (1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
    ScaleIntensityRanged("image", -57, 164, 0.0, 1.0, clip=True), CropForegroundd(keys, source_key="image"),
]
t0 = time.perf_counter()
transforms_fingerprint(pipeline)
first = time.perf_counter() - t0
again = []
for _ in range(50):
    t0 = time.perf_counter()
    transforms_fingerprint(pipeline)
    again.append(time.perf_counter() - t0)
again.sort()
print(first, again[len(again) // 2])
"""


CONSTRUCT = """
import json, sys, time
from monai.data import CacheDataset
from monai.transforms import Compose, Lambda
data = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
ds = CacheDataset(data, Compose([Lambda(lambda d: d)]), runtime_cache=[], progress=False)
built = time.perf_counter() - t0
t0 = time.perf_counter()
ds.set_data(data)
again = time.perf_counter() - t0
t0 = time.perf_counter()
for i in range(len(data)):  # a slot's key at its first use: the files it names stat'ed
    ds._cache.slot_key(i) if hasattr(ds._cache, "slot_key") else None
print(built, again, time.perf_counter() - t0)
"""


def construct(tree: str, data_file: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, "-c", CONSTRUCT, data_file]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800, env=env)
    return [float(v) for v in out.stdout.split()[-3:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--entries", type=int, default=10000)
    parser.add_argument("--dir", default=None, help="where the input files go (default: a directory under .)")
    parser.add_argument("--upstream", default=None, help="a tree of pristine MONAI 1.6.1, to compare with")
    args = parser.parse_args()
    import monai

    out = subprocess.run([sys.executable, "-c", PIPELINE], capture_output=True, text=True, check=True, timeout=600)
    first, again = map(float, out.stdout.split())
    tree = os.path.dirname(os.path.dirname(os.path.abspath(monai.__file__)))
    trees = {"fork": tree, **({"upstream": args.upstream} if args.upstream else {})}
    where = tempfile.mkdtemp(prefix="bench-keys-", dir=args.dir or ".")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        sets: dict[str, list] = {"100-byte files": [], "24 MB files": [], "a label naming a directory": []}
        os.makedirs(os.path.join(where, "train"))
        for i in range(args.entries):
            for kind, size in (("small", 100), ("large", 24 * 10**6)):
                with open(os.path.join(where, f"{kind}{i}.bin"), "wb") as f:
                    f.truncate(size)  # sparse: its size without its blocks
            open(os.path.join(where, "train", f"f{i}"), "wb").close()
            sets["100-byte files"].append({"image": os.path.join(where, f"small{i}.bin"), "id": i})
            sets["24 MB files"].append({"image": os.path.join(where, f"large{i}.bin"), "id": i})
            sets["a label naming a directory"].append({"id": i, "site": os.path.join(where, "train")})
        for name, data in sets.items():
            data_file = os.path.join(where, "data.json")
            Path(data_file).write_text(json.dumps(data))
            results[name] = {label: construct(path, data_file) for label, path in trees.items()}
    finally:
        shutil.rmtree(where, ignore_errors=True)
    report = {
        "version": monai.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "entries": args.entries,
        "fingerprint_first_ms": first * 1e3,
        "fingerprint_again_ms": again * 1e3,
        "construct_s": results,
    }
    print(f"MONAI {monai.__version__}, {args.entries} entries")
    print(f"fingerprint of the typical pipeline: first {first * 1e3:.2f} ms, again {again * 1e3:.3f} ms")
    small = results["100-byte files"]["fork"][0]
    for name, runs in results.items():
        for label, (built, again_s, keys) in runs.items():
            line = f"{name:27s} {label:8s} constructor {built:7.3f} s ({built / args.entries * 1e6:6.1f} us/entry)"
            line += f", set_data {again_s:7.3f} s, {built / small:5.2f}x 100-byte files"
            if label == "fork":
                line += f"; first use of the keys {keys:6.3f} s"
            print(line)
    Path("benchmarks/output").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/output/keys.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
