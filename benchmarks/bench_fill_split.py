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
each rank computed and the wall time of the slower ``fill``.

Then the default thread count of ranks whose store comes from ``create_shared_cache`` (2 ranks started by spawn, gloo):
40 items of CPU work (torch matrix products, which release the GIL), filled with the default (the rank's share of the
node's CPUs, ``node_cpus``) and with as many threads as the rank's CPUs (the default before it), 3 trials each: the
wall time of the slower ``fill``, and the most items in the transforms at once on the node (each holds its memory).
Prints both tables and writes ``benchmarks/output/fill_split.json``.
"""

from __future__ import annotations

import argparse
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


def _cpu_work(x, busy, peak):
    import torch

    with busy.get_lock():
        busy.value += 1
        peak.value = max(peak.value, busy.value)
    a = torch.ones(384, 384)
    for _ in range(120):  # about 0.1 s of one core
        a = a @ a / 384
    with busy.get_lock():
        busy.value -= 1
    return x + 1


def _ddp_rank(rank: int, init: str, root: str, threads: int | None, busy, peak, results) -> None:
    import functools

    import numpy as np
    import torch
    import torch.distributed as dist

    from monai.data import CacheDataset, create_shared_cache
    from monai.transforms import Compose, Lambda

    torch.set_num_threads(1)  # one core per computing thread, as the ranks of a node share the cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    store = create_shared_cache(root=root, timeout=120)
    work = Lambda(functools.partial(_cpu_work, busy=busy, peak=peak))
    ds = CacheDataset([np.full(2, i) for i in range(N)], Compose([work]), runtime_cache=store, progress=False)
    dist.barrier()
    t0 = time.perf_counter()
    ds.fill(num_threads=threads)
    results.put((store.node_cpus, ds.cache_stats()["process"]["computed"], time.perf_counter() - t0))
    dist.barrier()
    store.close()
    dist.destroy_process_group()


def _default_threads(ctx, report: dict) -> None:
    import tempfile

    from monai.data.shared_cache import process_cpus

    cpus = len(process_cpus())
    for threads in (cpus, None):
        trials = []
        for _ in range(3):
            with tempfile.TemporaryDirectory() as tmp:
                busy, peak, results = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Queue()
                init = f"file://{tmp}/rendezvous"
                args = (init, tmp, threads, busy, peak, results)
                procs = [ctx.Process(target=_ddp_rank, args=(r, *args)) for r in range(2)]
                for p in procs:
                    p.start()
                out = [results.get(timeout=300) for _ in procs]
                for p in procs:
                    p.join(60)
            trials.append(
                {
                    "node_cpus": sorted(n for n, _, _ in out),
                    "computed": sorted(c for _, c, _ in out),
                    "seconds": round(max(t for _, _, t in out), 3),
                    "most_at_once": peak.value,
                }
            )
        name = f"{cpus} (the rank's CPUs)" if threads else "default"
        report["create_shared_cache"][name] = trials
        print(
            f"create_shared_cache, threads {name}: "
            + ", ".join(f"{t['computed']} in {t['seconds']} s, {t['most_at_once']} at once" for t in trials)
            + f" (node_cpus {trials[0]['node_cpus']})"
        )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options: --help only
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
    report["create_shared_cache"] = {}
    _default_threads(ctx, report)
    Path("benchmarks/output").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/output/fill_split.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
