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
What the keys of PR 12 cost (``PYTHONPATH=build/tree python benchmarks/bench_keys.py [--entries 10000] [--dir DIR]``):

- the fingerprint of a typical MONAI pipeline (``LoadImaged``, ``EnsureChannelFirstd``, ``Spacingd``,
  ``ScaleIntensityRanged``, ``CropForegroundd``): the first one in a fresh interpreter, and again;
- constructing a ``CacheDataset`` with a runtime cache over ``--entries`` entries of 2 files each on ``--dir`` (a local
  disk by default: a directory under the current one), with a ``hash_func`` that sees names only (as before PR 12),
  with file stamps the first time in a process (every file hashed; 1 and 4 threads), and again (stat calls only).

Prints a table and writes ``benchmarks/output/keys.json``. The files are small (two 4 KiB ``.npy`` files per entry) and
in the page cache after they are written: this measures the stat calls and the hashing, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIPELINE = """
import time
t0 = time.perf_counter()
from monai.data._cache_keys import transforms_fingerprint
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


def construct(data: list, **kwargs) -> float:
    from monai.data import CacheDataset
    from monai.transforms import Compose, LoadImaged

    t0 = time.perf_counter()
    CacheDataset(data, Compose([LoadImaged(["image", "label"])]), runtime_cache=[], progress=False, **kwargs)
    return time.perf_counter() - t0


def names_only(entry: dict) -> bytes:
    from monai.data.utils import pickle_hashing

    return pickle_hashing(entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--entries", type=int, default=10000)
    parser.add_argument("--dir", default=None, help="where the input files go (default: a directory under .)")
    args = parser.parse_args()
    import numpy as np

    import monai
    from monai.data import _cache_keys

    out = subprocess.run([sys.executable, "-c", PIPELINE], capture_output=True, text=True, check=True, timeout=600)
    first, again = map(float, out.stdout.split())
    where = tempfile.mkdtemp(prefix="bench-keys-", dir=args.dir or ".")
    try:
        data = []
        for i in range(args.entries):
            entry = {k: os.path.join(where, f"{k}{i}.npy") for k in ("image", "label")}
            for path in entry.values():
                np.save(path, np.zeros(1000, np.float32))
            data.append(entry)
        past = time.time_ns() - 60 * 10**9  # older than RACY_SECONDS, as a dataset's files are
        for entry in data:
            for path in entry.values():
                os.utime(path, ns=(past, past))
        results = {"names only": construct(data, hash_func=names_only)}
        for threads in (1, 4):
            _cache_keys._digests.clear()
            results[f"stamps, first ({threads} thread{'s' * (threads > 1)})"] = construct(data, num_workers=threads)
        results["stamps, again (1 thread)"] = statistics.median(construct(data) for _ in range(3))
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
    print(f"MONAI {monai.__version__}, {args.entries} entries of 2 files")
    print(f"fingerprint of the typical pipeline: first {first * 1e3:.2f} ms, again {again * 1e3:.3f} ms")
    base = results["names only"]
    for name, seconds in results.items():
        print(f"construct, {name:28s} {seconds:8.3f} s  {seconds / base:6.2f}x names only")
    Path("benchmarks/output").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/output/keys.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
