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

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import unittest
from collections import Counter
from multiprocessing import Manager

import torch
from parameterized import parameterized

from monai.data import CacheDataset
from monai.transforms import Compose, Lambda, RandomizableTransform, Transform
from monai_sharedcache import SharedCacheStore, fill
from monai_sharedcache.keys import transforms_key
from tests.layer.layer_utils import DictCache, keyed_dataset
from tests.test_utils import skip_if_quick

NO_STORE = "SharedCacheStore needs fcntl, missing on this platform"
needs_store = unittest.skipUnless(SharedCacheStore.supported, NO_STORE)
FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
needs_fork = unittest.skipIf(FORK is None, "needs the fork start method")
N = 24
TIMEOUT = 120


class Load(Transform):
    """Deterministic: ``{"i": i, "img": i * ones}``; logs ``<i> <pid>`` at each computation (one O_APPEND write)."""

    def __init__(self, log: str, delay: float = 0.0) -> None:
        self.log, self.delay = log, delay

    def __call__(self, i: int) -> dict:
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
    """How many times each input was computed, by any process."""
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line.split()[0]) for line in f if line.strip())


def _fill_in_process(path: str, log: str, ready) -> None:
    """Another process of the node: joins the store by its path, and fills it with 2 threads once both are ready."""
    store = SharedCacheStore(path)
    ds = keyed_dataset(list(range(N)), Compose([Load(log, delay=0.2), AddOne()]), store, progress=False)
    ready.wait(TIMEOUT)
    fill(ds, num_threads=2)
    store.close()


class TestFill(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.log = os.path.join(self.tmp, "log")

    def runtime_cache(self, mode: str, **kwargs) -> object:
        """
        The runtime cache of ``mode``: a keyed cache (over a ``dict`` or ``Manager().dict()``, a store), or a container of
        slots of the series (``listproxy``, ``list``, ``thread``, ``process``: the fork's tests of ``ds.fill()``).
        """
        if mode in ("listproxy", "managerdict"):
            manager = Manager()
            self.addCleanup(manager.shutdown)
            return manager.list() if mode == "listproxy" else DictCache(manager.dict())
        if mode == "store":
            if not SharedCacheStore.supported:
                self.skipTest(NO_STORE)
            store = SharedCacheStore(root=self.tmp, **kwargs)
            self.addCleanup(store.close)
            return store
        return {"eager": False, "thread": True, "process": "process", "list": [], "dict": DictCache({})}[mode]

    def dataset(self, mode: str, data=None, **kwargs) -> CacheDataset:
        """A dataset of ``mode``'s runtime cache; a store's keys are its exact keys."""
        transform = Compose([Load(self.log), AddOne()])
        kwargs.setdefault("progress", False)
        cache = self.runtime_cache(mode)
        data = list(range(N)) if data is None else data
        if mode == "store":
            return keyed_dataset(data, transform, cache, **kwargs)
        if isinstance(cache, DictCache):  # a keyed cache needs the transforms' part of its keys
            kwargs.setdefault("hash_transform", transforms_key)
        return CacheDataset(data, transform, runtime_cache=cache, **kwargs)

    def check_items(self, ds: CacheDataset, data=None) -> None:
        for i, x in enumerate(range(N) if data is None else data):
            item = ds[i]
            self.assertTrue(item["i"] == x and torch.equal(item["img"], torch.full((2, 4), x + 1.0)), (i, item))

    @parameterized.expand([("eager",), ("dict",), ("managerdict",), ("store",)])
    def test_fill_computes_each_item_once(self, mode: str) -> None:
        ds = self.dataset(mode, num_workers=4)
        self.assertEqual(sum(computations(self.log).values()), N if mode == "eager" else 0)
        fill(ds)
        self.assertEqual(computations(self.log), Counter(range(N)))
        fill(ds)  # everything is cached: nothing to compute
        self.check_items(ds)
        self.check_items(ds)
        self.assertEqual(computations(self.log), Counter(range(N)))

    def test_threads(self) -> None:
        """``num_threads`` threads compute at once; by default as many as this process's CPUs."""
        threads: set = set()
        slow = Lambda(lambda i: (threads.add(threading.get_ident()), time.sleep(0.1), {"i": i})[-1])
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        for num_threads, expected in ((3, 3), (None, min(cpus, 8))):
            threads.clear()
            ds = CacheDataset(
                list(range(8)),
                Compose([slow]),
                runtime_cache=DictCache({}),
                hash_transform=transforms_key,
                progress=False,
            )
            fill(ds, num_threads=num_threads)
            self.assertEqual(len(threads), expected, num_threads)
        for bad in (0, -1, 1.5, True):
            with self.assertRaisesRegex(ValueError, "num_threads must be a positive integer"):
                fill(ds, num_threads=bad)  # type: ignore[arg-type]

    @parameterized.expand([("thread",), ("list",), ("listproxy",)])
    def test_a_container_of_slots_is_refused(self, mode: str) -> None:
        """The package fills keyed caches: a container of slots is a ``TypeError`` that names it, computing nothing."""
        ds = self.dataset(mode)
        with self.assertRaisesRegex(TypeError, "keyed runtime cache .*with get and put, such as a SharedCacheStore"):
            fill(ds)
        self.assertEqual(computations(self.log), Counter())

    def test_fill_without_waiting(self) -> None:
        """``fill(wait=False)`` of an item that another thread computes returns ``False`` at once, computing nothing."""
        store = self.runtime_cache("store")
        started, release = threading.Event(), threading.Event()
        slow = threading.Thread(
            target=store.get_or_compute, args=("k", lambda: (started.set(), release.wait(TIMEOUT), 1)[-1])
        )
        slow.start()
        self.addCleanup(lambda: (release.set(), slow.join(TIMEOUT)))
        self.assertTrue(started.wait(TIMEOUT))
        computed: list = []
        self.assertFalse(store.fill("k", lambda: computed.append(2) or 2, wait=False))  # its claim is held
        release.set()
        slow.join(TIMEOUT)
        self.assertTrue(store.fill("k", lambda: computed.append(3) or 3))  # stored by the other thread
        self.assertEqual((computed, store.get("k")), ([], 1))

    @skip_if_quick
    @needs_store
    def test_two_processes_fill_each_item_once(self) -> None:
        """2 processes x 2 threads fill one store at once: the claims split the items, each computed once."""
        store = self.runtime_cache("store")
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Barrier(2)
        procs = [ctx.Process(target=_fill_in_process, args=(store.path, self.log, ready)) for _ in range(2)]
        for p in procs:
            p.start()
            self.addCleanup(lambda p=p: (p.is_alive() and p.kill(), p.join(TIMEOUT)))
        for p in procs:
            p.join(TIMEOUT)
        self.assertEqual([p.exitcode for p in procs], [0, 0])
        self.assertEqual(computations(self.log), Counter(range(N)))
        with open(self.log) as f:
            by = dict(map(int, line.split()) for line in f)  # which process computed each item
        self.assertEqual(sorted(set(by.values())), sorted(p.pid for p in procs))  # both computed
        ds = keyed_dataset(list(range(N)), Compose([Load(self.log, 0.2), AddOne()]), store, progress=False)
        self.check_items(ds)  # every item, from the store
        self.assertEqual(computations(self.log), Counter(range(N)))


if __name__ == "__main__":
    unittest.main()
