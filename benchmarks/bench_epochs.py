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
The epochs section's job: DataLoader epochs over the cached items (timed) and the memory of the main process and its
workers during a warm epoch (read by ``procmem``).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import procmem
from bench_common import PATHS, expected_nbytes, inputs, item_nbytes, job_setup, malloc_trim, transforms


def job_epoch(cfg: dict) -> dict[str, Any]:
    """
    A cold and a few warm epochs with 2 persistent DataLoader workers over ``items`` cached items (timed), then the
    memory of the main process and its children during one more warm epoch read by 2 fresh workers.
    ``path="baseline"``: the same loader and crop over a plain ``Dataset`` of one crop-sized item made before the
    workers start (no cache, no compute), whose memory is subtracted as that of the runtime (interpreter, torch,
    workers, batches in flight).
    """
    started = time.perf_counter()
    info = job_setup()
    from monai.data import CacheDataset, DataLoader, Dataset
    from monai.transforms import Compose, Transform

    name = cfg["path"]
    n_items = cfg["items"]
    data = inputs(cfg, n_items)
    if name == "baseline":
        make, first_random = transforms(cfg["roi"], False)
        fixed = make(inputs(cfg, 1, shape=cfg["roi"])[0], end=first_random)

        class Fixed(Transform):
            """Returns the same pre-made item (shared with the forked workers) whatever the input."""

            def __call__(self, data: dict) -> dict:
                return dict(fixed)

        ds: Any = Dataset(data, Compose([Fixed(), make.transforms[first_random]]))
        one_copy = item_nbytes(fixed)
    else:
        spec = PATHS[name]
        tr, _ = transforms(cfg["roi"], spec["numpy"])
        one_copy = n_items * expected_nbytes(cfg["shape"])
        ds = CacheDataset(
            data,
            tr,
            runtime_cache=spec["runtime_cache"],
            copy_cache=spec["copy_cache"],
            progress=False,
            num_workers=2,
        )
    slots = getattr(ds, "_runtime", None)  # a _StoreSlots (its store's files are counted) or a _ListCache
    store_dir = getattr(getattr(slots, "store", None), "path", None)
    phases = {"setup": time.perf_counter() - started}

    def epoch(loader: Any) -> float:
        start = time.perf_counter()
        for batch in loader:
            del batch
        return time.perf_counter() - start

    loader = DataLoader(ds, batch_size=1, shuffle=False, num_workers=2, persistent_workers=True)
    cold = epoch(loader)
    phases["cold"] = cold
    warm = [epoch(loader) for _ in range(cfg["epochs"])]
    phases["warm"] = sum(warm)
    shutdown = getattr(loader._iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    del loader
    gc.collect()
    malloc_trim()
    # memory: a warm epoch read by 2 fresh workers (forked now, as at every epoch without persistent workers), so
    # that what computing the items in the cold epoch left in the workers' malloc heaps is not counted. Memory is
    # sampled in the main process right after the first batch arrives, then continuously by a thread while the
    # workers read; the epoch visits the items over and over until enough samples are taken (or 400 batches).
    start = time.perf_counter()
    order = list(range(n_items)) * max(1, -(-400 // n_items))
    fresh = DataLoader(ds, batch_size=1, sampler=order, num_workers=2, persistent_workers=False)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    me, store_dirs = os.getpid(), [store_dir] if store_dir else []

    def sampler() -> None:
        while not stop.is_set():
            samples.append(procmem.tree_snapshot(me, store_dirs))

    thread = threading.Thread(target=sampler, daemon=True)
    batches = iter(fresh)
    for i, batch in enumerate(batches):
        del batch
        if i == 0:
            samples.append(procmem.tree_snapshot(me, store_dirs))
            thread.start()
        elif i >= 16 and sum(x["complete"] for x in samples) >= cfg["memory_samples"]:
            break
    stop.set()
    thread.join()
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    phases["memory"] = time.perf_counter() - start
    # only the samples taken while all the processes of the first one were alive (not while the workers exit)
    valid = [x for x in samples if x["complete"] and x["n_processes"] >= samples[0]["n_processes"]] or samples[:1]
    ordered = sorted(valid, key=lambda x: x["footprint_bytes"])
    del batches, fresh
    gc.collect()
    return {
        "info": info,
        "cold_epoch_s": cold,
        "warm_epoch_s": warm,
        "one_copy_bytes": one_copy,
        "memory_first_batch": samples[0],
        "memory_median": ordered[(len(ordered) - 1) // 2],
        "memory_peak": ordered[-1],
        "memory_samples": samples,
        "memory_valid_samples": len(valid),
        "phases_s": phases,
    }
