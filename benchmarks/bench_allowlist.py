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
What reading items with an allow-list of types costs a hit (``PYTHONPATH=build/tree python
benchmarks/bench_allowlist.py [--small] [--reps 25]``): the item of ``bench_cache.py`` (a dict of two MetaTensors,
145 MiB; 9.6 MiB with ``--small``), a hit of it (read + 96³ random crop + collate-like copy) through a store made with
``weights_only=True`` (the default, the allow-list) and one with ``weights_only=False`` (any type), interleaved hit by
hit in one process, each first in every other round; the medians and their ratio. The store's fast path is as
``MONAI_CACHE_FAST_PATH`` says (on by default; ``0`` for the portable store, whose reads map each item file afresh).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import hit, inputs, standalone, transforms  # noqa: E402


def main() -> None:
    args, shape, roi = standalone(__doc__.splitlines()[1], 25)
    from monai.data import CacheDataset, SharedCacheStore

    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output", "data")
    tr, _ = transforms(roi, False)
    data = inputs({"data_dir": out, "shape": shape}, 1)
    stores = {"allow-list": SharedCacheStore(weights_only=True), "any type": SharedCacheStore(weights_only=False)}
    datasets = {name: CacheDataset(data, tr, runtime_cache=store, progress=False) for name, store in stores.items()}
    times: dict[str, list[float]] = {name: [] for name in datasets}
    names = list(datasets)
    for r in range(2 + args.reps):
        for name in names if r % 2 else names[::-1]:  # each first in every other round: no order bias
            ds = datasets[name]
            start = time.perf_counter()
            hit(ds, 0)
            if r >= 2:  # after 2 warm-up hits: the first one computes the item
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    fast = os.environ.get("MONAI_CACHE_FAST_PATH", "1") != "0"
    print(f"{'full stack' if fast else 'portable store'}, {args.reps} interleaved hits, medians:")
    for name, ms in med.items():
        print(f"  {name:10s} {ms:7.2f} ms")
    print(f"  allow-list / any type: {med['allow-list'] / med['any type']:.3f}x")
    for store in stores.values():
        store.close()


if __name__ == "__main__":
    main()
