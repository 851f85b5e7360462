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
Tests of ``CacheDataset.fill`` and ``CacheDataset.cache_stats``: in every runtime cache mode in one process, with
DataLoader workers, and with 2 gloo ranks sharing a store from ``create_shared_cache`` (each item computed once per
node, the work split between the ranks, a progress bar, and a rank killed during the fill).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest
from collections import Counter
from contextlib import redirect_stderr
from multiprocessing import Manager

import torch
import torch.distributed as dist
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader, SharedCacheStore, create_shared_cache
from monai.transforms import Compose, RandomizableTransform, Transform
from monai.utils import optional_import

_, has_tqdm = optional_import("tqdm")

N = 24
TIMEOUT = 300.0  # seconds for a launch of ranks (interpreters importing MONAI on 2 busy cores)
IS_LINUX = sys.platform.startswith("linux")


class Load(Transform):
    """
    Deterministic: ``{"i": i, "img": i * ones}``; logs ``<i> <pid>`` to ``log`` when an item is complete. A process
    whose ``KILL_AFTER`` environment variable is set dies when it starts one more item than that (an environment
    variable, not an attribute: an attribute would change the cache key, and the ranks would share nothing).
    """

    def __init__(self, log: str, delay: float = 0.0) -> None:
        self.log, self.delay = log, delay
        self.started = 0
        self.lock = threading.Lock()

    def __call__(self, i: int) -> dict:
        with self.lock:
            self.started += 1
            kill = "KILL_AFTER" in os.environ and self.started > int(os.environ["KILL_AFTER"])
        if kill:  # this process dies in the middle of computing an item, holding its claim
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.delay)
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{i} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return {"i": i, "img": torch.full((2, 4), float(i))}


class AddOne(RandomizableTransform):
    def __call__(self, d: dict) -> dict:
        d["img"] += 1  # in place: a cache that handed out its own item would drift
        return d


def computations(log: str) -> Counter:
    """How many times each input was computed, and by which processes: ``{i: count}``, ``{pid: count}``."""
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line.split()[0]) for line in f if line.strip())


def computing_pids(log: str) -> Counter:
    with open(log) as f:
        return Counter(int(line.split()[1]) for line in f if line.strip())


def check_items(ds: CacheDataset) -> None:
    for i in range(len(ds)):
        item = ds[i]
        assert item["i"] == i and torch.equal(item["img"], torch.full((2, 4), i + 1.0)), (i, item)


class TestFill(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.log = os.path.join(self.tmp, "log")

    def runtime_cache(self, mode: str) -> object:
        if mode == "listproxy":
            manager = Manager()
            self.addCleanup(manager.shutdown)
            return manager.list()
        if mode == "store":
            store = SharedCacheStore()
            self.addCleanup(store.close)
            return store
        return {"eager": False, "thread": True, "process": "process", "list": []}[mode]

    @parameterized.expand([("eager",), ("thread",), ("process",), ("list",), ("listproxy",), ("store",)])
    def test_fill_computes_each_item_once(self, mode: str) -> None:
        data = list(range(N))
        ds = CacheDataset(
            data,
            Compose([Load(self.log), AddOne()]),
            runtime_cache=self.runtime_cache(mode),
            num_workers=4,
            progress=False,
        )
        self.assertEqual(sum(computations(self.log).values()), N if mode == "eager" else 0)
        ds.fill()
        self.assertEqual(computations(self.log), Counter(range(N)))
        ds.fill()  # everything is cached: nothing to compute
        check_items(ds)
        check_items(ds)
        self.assertEqual(computations(self.log), Counter(range(N)))
        stats = ds.cache_stats()
        self.assertEqual(stats["process"], {"hits": 2 * N, "misses": 0, "computed": N, "refused": 0})
        self.assertEqual(stats["cache"]["capacity"], N)
        if mode == "listproxy":  # not counted: it would copy every item out of the Manager
            self.assertEqual((stats["cache"]["filled"], stats["cache"]["nbytes"]), (None, None))
        else:
            self.assertEqual(stats["cache"]["filled"], N)
            self.assertGreaterEqual(stats["cache"]["nbytes"], N * 2 * 4 * 4)

    def test_progress_bar(self) -> None:
        if not has_tqdm:
            self.skipTest("tqdm is not installed")
        store = self.runtime_cache("store")
        ds = CacheDataset(list(range(N)), Compose([Load(self.log), AddOne()]), runtime_cache=store, progress=True)
        err = io.StringIO()
        with redirect_stderr(err):
            ds.fill()
        self.assertIn("Loading dataset", err.getvalue())
        self.assertIn(f"{N}/{N}", err.getvalue())

    def test_lazy_misses_then_hits(self) -> None:
        ds = CacheDataset(list(range(N)), Compose([Load(self.log), AddOne()]), runtime_cache=True, progress=False)
        check_items(ds)
        check_items(ds)
        self.assertEqual(ds.cache_stats()["process"], {"hits": N, "misses": N, "computed": N, "refused": 0})

    @unittest.skipUnless(IS_LINUX, "the counts of other processes are kept with Linux locks")
    def test_store_counts_dataloader_workers(self) -> None:
        """Workers count in the store: misses and computations in epoch 1, hits in epoch 2, after they exited."""
        store = self.runtime_cache("store")
        ds = CacheDataset(list(range(N)), Compose([Load(self.log), AddOne()]), runtime_cache=store, progress=False)
        for _ in range(2):
            loader = DataLoader(ds, batch_size=1, num_workers=2, timeout=60, multiprocessing_context="fork")
            self.assertEqual(sorted(int(b["i"][0]) for b in loader), list(range(N)))
        stats = ds.cache_stats()
        self.assertEqual(stats["process"], {"hits": 0, "misses": 0, "computed": 0, "refused": 0})  # the workers did
        counts = {k: stats["cache"][k] for k in ("hits", "misses", "computed", "refused", "filled")}
        self.assertEqual(counts, {"hits": N, "misses": N, "computed": N, "refused": 0, "filled": N})
        self.assertEqual(computations(self.log), Counter(range(N)))

    def test_hash_as_key_fills_the_unique_inputs(self) -> None:
        store = self.runtime_cache("store")
        data = [3, 1, 3, 0, 1, 2]
        ds = CacheDataset(data, Compose([Load(self.log), AddOne()]), hash_as_key=True, runtime_cache=store)
        ds.fill()
        self.assertEqual(computations(self.log), Counter({0: 1, 1: 1, 2: 1, 3: 1}))
        for i, x in enumerate(data):
            self.assertTrue(torch.equal(ds[i]["img"], torch.full((2, 4), x + 1.0)), (i, x))
        self.assertEqual(computations(self.log), Counter({0: 1, 1: 1, 2: 1, 3: 1}))

    def test_no_runtime_cache_nothing_to_fill(self) -> None:
        ds = CacheDataset(list(range(N)), Compose([Load(self.log), AddOne()]), cache_rate=0.5, progress=False)
        ds.fill()
        self.assertEqual(computations(self.log), Counter(range(N // 2)))
        self.assertEqual(ds.cache_stats()["cache"]["filled"], N // 2)


def _fill_rank(rank: int, world: int, tmp: str, kill_rank: int | None, share: bool) -> None:
    if share:  # as torchrun sets them: rank 1 starts at the middle; else both start at item 0 and meet all along
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    err = open(os.path.join(tmp, f"stderr{rank}"), "w")
    sys.stderr = err  # the progress bar
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    store = create_shared_cache(timeout=TIMEOUT)
    if rank == kill_rank:
        os.environ["KILL_AFTER"] = "3"
    load = Load(os.path.join(tmp, "log"), delay=0.1)
    ds = CacheDataset(list(range(N)), Compose([load, AddOne()]), runtime_cache=store, num_workers=2, progress=True)
    ds.fill()
    err.flush()
    with open(os.path.join(tmp, f"filled{rank}"), "w") as f:
        f.write(repr(ds.cache_stats()))
    check_items(ds)  # every item, from the store: none is computed again (checked by the parent)
    if kill_rank is None:
        dist.barrier()
        store.close()
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"done{rank}"), "w") as f:
        f.write("ok")
    os._exit(0)  # with a dead peer, tearing down the process group could wait for it


@unittest.skipUnless(IS_LINUX, "spawned gloo ranks sharing /dev/shm")
class TestFillDistributed(unittest.TestCase):
    def launch(self, kill_rank: int | None, share: bool = True) -> tuple[str, list[int | None]]:
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_fill_rank, args=(r, 2, tmp, kill_rank, share)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(10)
        self.assertFalse(alive, "a rank did not finish in time")
        return tmp, [p.exitcode for p in procs]

    @parameterized.expand([("shares",), ("same_start",)])
    def test_each_item_once_per_node(self, how: str) -> None:
        """2 ranks x 2 threads fill one store: every item computed once, by both ranks, with a progress bar."""
        tmp, codes = self.launch(kill_rank=None, share=how == "shares")
        self.assertEqual(codes, [0, 0])
        log = os.path.join(tmp, "log")
        self.assertEqual(computations(log), Counter(range(N)))
        self.assertEqual(len(computing_pids(log)), 2)  # the work was split between the two ranks
        for rank in range(2):
            with open(os.path.join(tmp, f"stderr{rank}")) as f:
                err = f.read()
            if has_tqdm:
                self.assertIn("Loading dataset", err)
                self.assertIn(f"{N}/{N}", err)

    def test_killed_rank_leaves_its_share_to_the_other(self) -> None:
        """Rank 1 is SIGKILLed while computing its 4th item: rank 0 computes the rest, each item completes once."""
        tmp, codes = self.launch(kill_rank=1)
        self.assertEqual(codes, [0, -signal.SIGKILL])
        self.assertTrue(os.path.exists(os.path.join(tmp, "done0")))
        log = os.path.join(tmp, "log")
        self.assertEqual(computations(log), Counter(range(N)))  # complete computations: once each, none lost
        by_pid = computing_pids(
            log
        )  # the killed rank completed 2 or 3 items (its 4th start killed it): rank 0 the rest
        self.assertEqual(len(by_pid), 2)
        self.assertIn(min(by_pid.values()), (2, 3))


if __name__ == "__main__":
    unittest.main()
