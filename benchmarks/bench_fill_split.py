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
How ``CacheDataset.fill`` splits a node's items between ranks without a launcher's environment
(``PYTHONPATH=build/tree python benchmarks/bench_fill_split.py``): 2 processes started as ``mp.spawn`` starts ranks
(no ``LOCAL_RANK``), one store, 40 items of 50 ms each; per thread count (1, 2 and the default), 3 trials: the items
each rank computed and the wall time of the slower ``fill``. Prints a table and writes
``benchmarks/output/fill_split.json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

N = 40


def _slow(x):
    time.sleep(0.05)
    return x + 1


def _rank(path: str, threads: int | None, go, results) -> None:
    import numpy as np

    from monai.data import CacheDataset, SharedCacheStore
    from monai.transforms import Compose, Lambda

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    store = SharedCacheStore(path)
    ds = CacheDataset([np.full(2, i) for i in range(N)], Compose([Lambda(_slow)]), runtime_cache=store, progress=False)
    go.wait(60)
    t0 = time.perf_counter()
    ds.fill(num_threads=threads)
    results.put((ds.cache_stats()["process"]["computed"], time.perf_counter() - t0))
    store.close()


def main() -> None:
    import monai
    from monai.data import SharedCacheStore

    ctx = mp.get_context("spawn")
    report: dict = {"version": monai.__version__, "date": time.strftime("%Y-%m-%d"), "items": N, "runs": {}}
    for threads in (1, 2, None):
        trials = []
        for _ in range(3):
            store = SharedCacheStore()
            go, results = ctx.Event(), ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(store.path, threads, go, results)) for _ in range(2)]
            for p in procs:
                p.start()
            time.sleep(5)  # both have built their datasets
            go.set()
            out = [results.get(timeout=120) for _ in procs]
            for p in procs:
                p.join(60)
            store.close()
            trials.append({"computed": sorted(c for c, _ in out), "seconds": round(max(t for _, t in out), 3)})
        report["runs"]["default" if threads is None else str(threads)] = trials
        print(f"threads {threads or 'default'}: " + ", ".join(f"{t['computed']} in {t['seconds']} s" for t in trials))
    Path("benchmarks/output").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/output/fill_split.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
