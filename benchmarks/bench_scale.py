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
What a store's operations cost with many items (issue 24: the same with 50,000 items as with 50, within 1.2x):
``PYTHONPATH=build/tree python benchmarks/bench_scale.py [--small 50] [--large 50000] [--root /dev/shm]``.

For each size, a persistent store on ``--root`` is filled with that many small items (a 16-element tensor each), with
a ``max_bytes`` cap far above them (so every write counts its bytes, and none is refused). Then, in the same process:

- ``open``: ``SharedCacheStore(path, persistent=True)`` by its only user, so a new session each time, and its close;
- ``stats``: ``stats()`` of the open store;
- ``put``: ``put`` of a new small item;
- ``temp_stats``: ``stats()`` of a temporary (not persistent) store that holds as many items.

Each is the median of ``--reps`` calls; the table gives both sizes and their ratio. Written to
``benchmarks/output/bench_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from monai.data import SharedCacheStore

OUT = Path(__file__).resolve().parent / "output" / "bench_scale.json"


def _median(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(root: str, n: int, reps: int) -> dict[str, float]:
    """The median seconds of each operation on stores of ``n`` items in ``root``."""
    work = tempfile.mkdtemp(dir=root)
    try:
        path, item = f"{work}/kept", torch.arange(16)
        store = SharedCacheStore(path, persistent=True, max_bytes=1 << 40, reserve=0)
        temp = SharedCacheStore(root=work, max_bytes=1 << 40, reserve=0)
        for i in range(n):
            assert store.put(f"k{i}", item) and temp.put(f"k{i}", item)
        store.close()

        def reopen() -> None:
            SharedCacheStore(path, persistent=True).close()

        found = {"open": _median(reopen, reps)}
        store = SharedCacheStore(path, persistent=True)
        found["stats"] = _median(store.stats, reps)
        new = iter(range(n, n + reps))
        found["put"] = _median(lambda: store.put(f"k{next(new)}", item), reps)
        found["temp_stats"] = _median(temp.stats, reps)
        assert store.stats()["filled"] == n + reps and temp.stats()["filled"] == n, (store.stats(), temp.stats())
        store.close()
        temp.close()
        return found
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=50)
    parser.add_argument("--large", type=int, default=50_000)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--root", default="/dev/shm")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    small, large = measure(args.root, args.small, args.reps), measure(args.root, args.large, args.reps)
    rows = {op: {"small": small[op], "large": large[op], "ratio": large[op] / small[op]} for op in small}
    print(f"| operation | {args.small} items (ms) | {args.large} items (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for op, row in rows.items():
        print(f"| {op} | {row['small'] * 1e3:.3f} | {row['large'] * 1e3:.3f} | {row['ratio']:.2f}x |")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"small": args.small, "large": args.large, "reps": args.reps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
