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
The small section's job: many small items in the store under ``RLIMIT_NOFILE=1024`` (no descriptor may stay open per
item), and a few thousand mapped items kept alive.
"""

from __future__ import annotations

import gc
import os
import resource
import time
import warnings
from typing import Any, cast

from bench_common import job_setup, median


def job_small(cfg: dict) -> dict[str, Any]:
    """
    Many small items in the store under ``RLIMIT_NOFILE=1024``: fill, then read every item once and keep it alive
    (an open descriptor per item would exceed the limit); also a few thousand mapped items (over 64 KiB) kept alive.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    info = job_setup()
    import numpy as np

    from monai.data import CacheDataset
    from monai.transforms import Compose, ToTensord

    def run(n: int, nbytes: int) -> dict[str, Any]:
        res: dict[str, Any] = {"n": n, "item_bytes": nbytes, "error": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                # each input carries its own vector (nbytes, filled with its number); the cached item is its tensor
                data = [{"x": np.full(nbytes // 4, i, dtype=np.float32)} for i in range(n)]
                tr = Compose([ToTensord(keys="x", track_meta=False)])
                ds = CacheDataset(data, tr, runtime_cache="process", progress=False)
                gc.collect()
                gc.disable()  # as timeit does: the collector's passes grow with the items kept alive below
                fill_times: list[float] = []
                kept: list[Any] = []
                times: list[float] = []
                try:
                    for i in range(n):
                        start = time.perf_counter()
                        ds[i]
                        fill_times.append(time.perf_counter() - start)
                    for i in range(n):
                        start = time.perf_counter()
                        item = ds[i]
                        times.append(time.perf_counter() - start)
                        kept.append(item)
                finally:
                    gc.enable()
                res["fill_s"] = sum(fill_times)
                res["correct"] = all(float(kept[i]["x"][-1]) == float(i) for i in range(n))
                res["open_fds_with_items_alive"] = len(os.listdir("/proc/self/fd"))
                res["store"] = cast(Any, ds._runtime).stats()
                res["runtime"] = type(ds._runtime).__name__  # _StoreSlots: the fork's SharedCacheStore
                head = min(1000, n // 2)
                res["seq_hit_first_s"] = median(times[:head])
                res["seq_hit_last_s"] = median(times[-head:])
                res["hit_all_s"] = median(times)
                # the first and the last items again, alternately (with all the items alive), so that a drift of
                # the machine's load over the sequential pass does not pass for a dependence on the item
                first_t: list[float] = []
                last_t: list[float] = []
                gc.disable()
                try:
                    for k in range(head):
                        for index, out in ((k, first_t), (n - head + k, last_t)):
                            start = time.perf_counter()
                            ds[index]
                            out.append(time.perf_counter() - start)
                finally:
                    gc.enable()
                res["hit_first_s"] = median(first_t)
                res["hit_last_s"] = median(last_t)
                res["fill_first_s"] = median(fill_times[:head])
                res["fill_last_s"] = median(fill_times[-head:])
                del kept, ds, data
            except Exception as err:  # reported, not raised: the report must be written
                res["error"] = f"{type(err).__name__}: {err}"
            res["warnings"] = [str(w.message)[:300] for w in caught]
        gc.collect()
        return res

    return {
        "info": info,
        "nofile_limit": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "small": run(cfg["n_small"], 1024),
        "mapped": run(cfg["n_mapped"], 96 * 1024),
    }
