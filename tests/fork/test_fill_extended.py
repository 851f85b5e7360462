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
The extended tests of ``CacheDataset.fill`` with 2 gloo ranks sharing a store from ``create_shared_cache``: a rank
killed during the fill leaves its share to the other, ranks that start at the same item meet all along, and each
rank shows a progress bar.
"""

from __future__ import annotations

import ast
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

import torch
import torch.distributed as dist
from fork_utils import TIMEOUT, end, run_forked, skip_if_quick, skip_unless_fork, skip_unless_store
from parameterized import parameterized

from monai.data import CacheDataset, SharedCacheStore, create_shared_cache
from monai.transforms import Compose, RandomizableTransform, Transform
from monai.utils import optional_import
from monai_sharedcache import _locks as locks

_, has_tqdm = optional_import("tqdm")

N = 24
LAUNCH_TIMEOUT = 300.0  # seconds for a launch of ranks (interpreters importing MONAI on 2 busy cores)


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
    """How many times each input was computed."""
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line.split()[0]) for line in f if line.strip())


def computing_pids(log: str) -> Counter:
    """How many inputs each process computed."""
    with open(log) as f:
        return Counter(int(line.split()[1]) for line in f if line.strip())


def check_items(ds: CacheDataset) -> None:
    for i in range(len(ds)):
        item = ds[i]
        assert item["i"] == i and torch.equal(item["img"], torch.full((2, 4), i + 1.0)), (i, item)


def _fill_rank(rank: int, world: int, tmp: str, kill_rank: int | None, share: bool) -> None:
    if share:  # as torchrun sets them, which fill ignores: the claims alone split the items, under any launcher
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    err = open(os.path.join(tmp, f"stderr{rank}"), "w")
    sys.stderr = err  # the progress bar
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    store = create_shared_cache(root=tmp, timeout=TIMEOUT)
    if rank == kill_rank:
        os.environ["KILL_AFTER"] = "3"
    load = Load(os.path.join(tmp, "log"), delay=0.1)
    ds = CacheDataset(list(range(N)), Compose([load, AddOne()]), runtime_cache=store, num_workers=2, progress=True)
    ds.fill(num_threads=2)
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


def _count_one(store: SharedCacheStore) -> None:
    store.get_or_compute("in-child", lambda: 1)
    os._exit(0 if store.process_stats()["computed"] == 1 else 1)


@skip_unless_store
@skip_unless_fork
class TestCounterSlots(unittest.TestCase):
    """A store gives its counter slot up at close; a forked child counts even if another thread was counting."""

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="test-fill-extended-")
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self, path: str | None = None) -> SharedCacheStore:
        store = SharedCacheStore(path) if path else SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        return store

    def test_close_gives_the_counter_slot_up_and_keeps_its_counts(self) -> None:
        first = self.new_store()
        second = self.new_store(first.path)
        second.get_or_compute("k", lambda: 1)  # second counts: it holds a slot
        (slot,) = os.listdir(os.path.join(first.path, ".counters"))
        slot = os.path.join(first.path, ".counters", slot)
        self.assertIsNone(locks.try_hold(slot))
        second.close()
        free = locks.try_hold(slot)
        self.assertIsNotNone(free)
        free.close()  # type: ignore[union-attr]
        self.assertEqual(first.stats()["computed"], 1)

    def test_counting_after_a_fork_while_another_thread_counts(self) -> None:
        store = self.new_store()
        store.get_or_compute("k", lambda: 1)
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            with store._counters._lock:  # as another thread in the middle of counting
                holding.set()
                release.wait(TIMEOUT)

        thread = threading.Thread(target=hold)
        thread.start()
        self.addCleanup(thread.join, TIMEOUT)
        self.addCleanup(release.set)
        self.assertTrue(holding.wait(TIMEOUT))
        self.assertEqual(run_forked(_count_one, store, timeout=30), 0)


@skip_if_quick
@skip_unless_store
class TestFillDistributed(unittest.TestCase):
    def launch(self, kill_rank: int | None, share: bool = True) -> tuple[str, list[int | None]]:
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_fill_rank, args=(r, 2, tmp, kill_rank, share)) for r in range(2)]
        for p in procs:
            p.start()
            self.addCleanup(end, p)
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.assertFalse([p for p in procs if p.is_alive()], "a rank did not finish in time")
        return tmp, [p.exitcode for p in procs]

    def assert_full_after_fill(self, tmp: str, rank: int) -> None:
        """``fill`` returned only when the node's cache was full (not just this rank's share of it)."""
        with open(os.path.join(tmp, f"filled{rank}")) as f:
            self.assertEqual(ast.literal_eval(f.read())["cache"]["filled"], N, rank)

    @parameterized.expand([("torchrun_env",), ("no_env",)])
    def test_each_item_once_per_node(self, how: str) -> None:
        """2 ranks x 2 threads fill one store: every item computed once, split between the ranks, with a progress bar."""
        tmp, codes = self.launch(kill_rank=None, share=how == "torchrun_env")
        self.assertEqual(codes, [0, 0])
        log = os.path.join(tmp, "log")
        self.assertEqual(computations(log), Counter(range(N)))
        self.assertEqual(len(computing_pids(log)), 2)  # the work was split between the two ranks, about evenly
        self.assertGreaterEqual(min(computing_pids(log).values()), N // 4, computing_pids(log))
        for rank in range(2):
            self.assert_full_after_fill(tmp, rank)
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
        self.assert_full_after_fill(tmp, 0)
        log = os.path.join(tmp, "log")
        self.assertEqual(computations(log), Counter(range(N)))  # complete computations: once each, none lost
        by_pid = computing_pids(
            log
        )  # the killed rank completed 2 or 3 items (its 4th start killed it): rank 0 the rest
        self.assertEqual(len(by_pid), 2)
        self.assertIn(min(by_pid.values()), (2, 3))


if __name__ == "__main__":
    unittest.main()
