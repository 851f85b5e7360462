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

import contextlib
import glob
import os
import shutil
import signal
import unittest
import warnings
from collections import Counter
from unittest import mock

import torch
from parameterized import parameterized

from monai.data import DataLoader
from monai.transforms import Compose, Transform
from monai_sharedcache import SharedCacheStore, cache_stats
from monai_sharedcache import counters as cache_counters
from monai_sharedcache import fill
from tests.layer import test_cachedataset_fill as core
from tests.layer.layer_utils import keyed_dataset
from tests.layer.test_cachedataset_fill import FORK, TIMEOUT, AddOne, Load, N, computations, needs_fork, needs_store
from tests.test_utils import DistTestCase, skip_if_quick

ITEM_BYTES = 2 * 4 * 4  # the float32 image of an item
NO_EVENTS = {"hits": 0, "misses": 0, "computed": 0, "refused": 0}


def counts(stats: dict) -> dict:
    return {k: stats[k] for k in NO_EVENTS}


class Big(Transform):
    """An item of 128 KiB: past the cap of a small store."""

    def __call__(self, i: int) -> dict:
        return {"i": i, "img": torch.zeros(32 << 10)}


class _Listing:
    """An iterator of ``os.scandir`` that counts the entries it yields."""

    def __init__(self, it, seen: Counter) -> None:
        self.it, self.seen = it, seen

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc) -> None:
        self.it.close()

    def close(self) -> None:
        self.it.close()

    def __iter__(self):
        for entry in self.it:
            self.seen["listed"] += 1
            yield entry


@contextlib.contextmanager
def file_system_calls():
    """The directory entries listed by ``os.scandir``, and the calls of ``os.stat``, ``lstat`` and ``fstat``."""
    seen: Counter = Counter()
    scandir, stats = os.scandir, {name: getattr(os, name) for name in ("stat", "lstat", "fstat")}

    def counted(name: str):
        def call(*args, **kwargs):
            seen[name] += 1
            return stats[name](*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("os.scandir", lambda *a, **k: _Listing(scandir(*a, **k), seen)))
        for name in stats:
            stack.enter_context(mock.patch(f"os.{name}", counted(name)))
        yield seen


def _put_and_die(store: SharedCacheStore) -> None:
    """In a forked child: write an item, and die without any cleanup once it is written, before it is published."""
    with mock.patch.object(type(store), "_seal", lambda self, fd: os.kill(os.getpid(), signal.SIGKILL)):
        store.put("killed", torch.zeros(1000))


def _count_and_die(store: SharedCacheStore, hits: int) -> None:
    """In a forked child: read the item ``k`` ``hits`` times and compute ``c``, then die without any cleanup."""
    for _ in range(hits):
        store.get_or_compute("k", lambda: -1)
    store.get_or_compute("c", lambda: 7)
    os.kill(os.getpid(), signal.SIGKILL)


class TestStats(DistTestCase):
    """``cache_stats`` and the store's counts, on the datasets of the ``fill`` tests."""

    setUp = core.TestFill.setUp
    runtime_cache = core.TestFill.runtime_cache
    dataset = core.TestFill.dataset
    check_items = core.TestFill.check_items

    @parameterized.expand([("dict",), ("managerdict",), ("store",)])
    def test_counts_after_fill(self, mode: str) -> None:
        """A store counts its events and items; another keyed cache what it can tell: its capacity."""
        ds = self.dataset(mode, num_workers=4)
        self.assertEqual(sum(computations(self.log).values()), 0)
        fill(ds)
        self.check_items(ds)
        self.check_items(ds)
        stats = cache_stats(ds)
        store = mode == "store"  # another keyed cache is not counted: get alone would copy every item out
        self.assertEqual(stats["dataset"], {"capacity": N, "filled": N if store else None})
        if mode == "store":  # the item files, with their headers
            self.assertEqual(stats["process"], {"hits": 2 * N, "misses": 0, "computed": N, "refused": 0})
            self.assertEqual(counts(stats["cache"]), stats["process"])  # this process alone used the cache
            self.assertEqual(stats["cache"]["filled"], N)
            self.assertGreater(stats["cache"]["nbytes"], N * ITEM_BYTES)
            return
        unknown = dict.fromkeys(NO_EVENTS)  # get and put count nothing
        self.assertEqual((stats["process"], counts(stats["cache"])), (unknown, unknown))
        self.assertEqual((stats["cache"]["filled"], stats["cache"]["nbytes"]), (None, None))

    def test_lazy_misses_then_hits(self) -> None:
        ds = self.dataset("store")
        self.check_items(ds)
        self.check_items(ds)
        self.assertEqual(cache_stats(ds)["process"], {"hits": N, "misses": N, "computed": N, "refused": 0})

    def test_without_a_keyed_runtime_cache(self) -> None:
        """``cache_stats`` counts a keyed runtime cache: without one, a ``TypeError`` that says so."""
        with self.assertRaisesRegex(TypeError, "keyed runtime cache; this dataset has none"):
            cache_stats(self.dataset("eager", cache_rate=0.5))
        with self.assertRaisesRegex(TypeError, "keyed runtime cache .*got runtime_cache=True"):
            cache_stats(self.dataset("thread"))

    def check_worker_counts(self, context: str) -> None:
        """Workers count in the store: misses and computations in epoch 1, hits in epoch 2, after they exited."""
        ds = self.dataset("store")
        for _ in range(2):
            loader = DataLoader(ds, batch_size=1, num_workers=2, timeout=TIMEOUT, multiprocessing_context=context)
            self.assertEqual(sorted(int(b["i"][0]) for b in loader), list(range(N)))
        stats = cache_stats(ds)
        self.assertEqual(stats["process"], NO_EVENTS)  # the workers did it all
        self.assertEqual({**counts(stats["cache"]), "filled": stats["cache"]["filled"]},
                         {"hits": N, "misses": N, "computed": N, "refused": 0, "filled": N})  # fmt: skip
        self.assertEqual(computations(self.log), Counter(range(N)))

    @needs_store
    @needs_fork
    def test_store_counts_forked_workers(self) -> None:
        self.check_worker_counts("fork")

    @skip_if_quick
    @needs_store
    def test_store_counts_spawned_workers(self) -> None:
        self.check_worker_counts("spawn")

    def test_hash_as_key_counts(self) -> None:
        data = [3, 1, 3, 0, 1, 2]
        ds = self.dataset("store", data, hash_as_key=True)
        fill(ds)
        self.check_items(ds, data)
        self.assertEqual(cache_stats(ds)["process"], {"hits": 6, "misses": 0, "computed": 4, "refused": 0})

    def test_two_datasets_in_one_store(self) -> None:
        """A train and a validation dataset in one store: each counts its own slots, and the store holds both."""
        store = self.runtime_cache("store")
        train = keyed_dataset(list(range(N)), Compose([Load(self.log), AddOne()]), store, progress=False)
        fill(train)
        val = keyed_dataset([100, 101, 102], Compose([Load(self.log), AddOne()]), store, progress=False)
        val[0]
        self.assertEqual(cache_stats(train)["dataset"], {"capacity": N, "filled": N})
        self.assertEqual(cache_stats(val)["dataset"], {"capacity": 3, "filled": 1})
        self.assertEqual(cache_stats(val)["cache"]["filled"], N + 1)

    @needs_store
    def test_each_dataset_counts_its_own_events(self) -> None:
        """A train and a validation dataset in one store: ``process`` has each one's events, ``cache`` the store's."""
        store = self.runtime_cache("store", max_bytes=64 << 10)  # room for the items of train, not for those of val
        train = keyed_dataset(list(range(N)), Compose([Load(self.log), AddOne()]), store, progress=False)
        val = keyed_dataset([100, 101], Big(), store, progress=False)
        fill(train)
        self.check_items(train)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the store's warning of items past its cap
            for i in (0, 0, 1):
                val[i]
        mine = {"hits": N, "misses": 0, "computed": N, "refused": 0}
        theirs = {"hits": 0, "misses": 3, "computed": 3, "refused": 3}
        self.assertEqual(cache_stats(train)["process"], mine)
        self.assertEqual(cache_stats(val)["process"], theirs)
        whole = {k: mine[k] + theirs[k] for k in NO_EVENTS}
        for ds in (train, val):
            self.assertEqual(counts(cache_stats(ds)["cache"]), whole)
        self.assertEqual(counts(store.process_stats()), whole)  # the store's events of this process: both datasets'
        self.assertEqual(store.stats()["filled"], N)

    @needs_store
    def test_each_dataset_counts_its_own_reuse(self) -> None:
        """
        In the second run of a persistent store, each dataset counts the items of the first run that it reused. The
        counts of ``process`` are those of the dataset's cached transforms (their ``hash_transform`` digest): the
        validation dataset loads with a delay of its own, so that its cached transforms are not the training one's.
        """
        path, log = os.path.join(self.tmp, "kept"), os.path.join(self.tmp, "log")
        for _ in range(2):
            store = SharedCacheStore(path, persistent=True)
            try:
                train = keyed_dataset(list(range(N)), Compose([Load(log), AddOne()]), store, progress=False)
                val = keyed_dataset([100, 101, 102], Compose([Load(log, 0.001), AddOne()]), store, progress=False)
                fill(train)
                for _ in range(2):
                    val[0]
                stats = cache_stats(train), cache_stats(val)
            finally:
                store.close()
        self.assertEqual(stats[0]["process"], {**NO_EVENTS, "reused": N})
        self.assertEqual(stats[1]["process"], {**NO_EVENTS, "hits": 2, "reused": 1})
        self.assertEqual(stats[0]["cache"], {"filled": N + 1, "nbytes": stats[0]["cache"]["nbytes"], **NO_EVENTS,
                                             "hits": 2, "reused": N + 1})  # fmt: skip
        self.assertEqual(stats[0]["cache"], stats[1]["cache"])

    @parameterized.expand([("temporary",), ("persistent",)])
    @needs_store
    def test_stats_read_no_item(self, kind: str) -> None:
        """``stats()`` reads the store's counts: what it lists or stat's does not grow with the number of items."""
        seen = []
        for n in (2, 40):
            if kind == "persistent":
                store = SharedCacheStore(os.path.join(self.tmp, f"kept-{n}"), persistent=True)
            else:
                store = SharedCacheStore(root=self.tmp)
            self.addCleanup(store.close)
            for i in range(n):
                self.assertTrue(store.put(f"{i:03d}", torch.zeros(16)))
            store.discard(["000"])  # counted out
            with file_system_calls() as calls:
                stats = store.stats()
            files = glob.glob(os.path.join(store.path, "*.item"))
            self.assertEqual((stats["filled"], stats["nbytes"]), (n - 1, sum(map(os.path.getsize, files))))
            seen.append(dict(calls))
        self.assertEqual(seen[0], seen[1])

    @needs_store
    @needs_fork
    def test_reservation_of_a_killed_writer_is_counted_out(self) -> None:
        """A writer killed mid-write leaves its reservation counted: the next ``stats()`` counts the items again, once."""
        store = self.runtime_cache("store")
        self.assertTrue(store.put("kept", torch.zeros(16)))
        child = FORK.Process(target=_put_and_die, args=(store,))  # type: ignore[union-attr]
        child.start()
        child.join(TIMEOUT)
        if child.is_alive():
            child.kill()
            child.join(TIMEOUT)
        self.assertEqual(child.exitcode, -signal.SIGKILL)
        self.assertEqual(len(os.listdir(os.path.join(store.path, ".writes"))), 1)  # its reservation, unlocked
        (item,) = glob.glob(os.path.join(store.path, "*.item"))
        self.assertEqual((store.stats()["filled"], store.stats()["nbytes"]), (1, os.path.getsize(item)))
        self.assertEqual(os.listdir(os.path.join(store.path, ".writes")), [])  # recounted once: no scan from now on

    @needs_store
    def test_cache_stats_read_no_item_of_other_datasets(self) -> None:
        """``cache_stats()`` stats the dataset's own slots, however many items of others the store holds."""
        seen = []
        for n in (2, 40):
            store = self.runtime_cache("store")
            for i in range(n):
                self.assertTrue(store.put(f"other-{i:03d}", torch.zeros(16)))
            ds = keyed_dataset([0, 1, 2], Compose([Load(self.log), AddOne()]), store, progress=False)
            ds[0]
            with file_system_calls() as calls:
                stats = cache_stats(ds)
            self.assertEqual((stats["dataset"]["filled"], stats["cache"]["filled"]), (1, n + 1))
            seen.append(dict(calls))
        self.assertEqual(seen[0], seen[1])

    @parameterized.expand([("budget",), ("fault",)])
    @needs_store
    def test_refused_items_are_counted(self, why: str) -> None:
        """Items that the store cannot keep (past its budget, or after a fault) are computed and counted as refused."""
        store = self.runtime_cache("store", reserve=0, max_bytes=0 if why == "budget" else None)
        if why == "fault":  # every write of an item fails: its temporary directory is a file
            shutil.rmtree(os.path.join(store.path, ".tmp"))
            open(os.path.join(store.path, ".tmp"), "w").close()
        ds = keyed_dataset(list(range(N)), Compose([Load(self.log), AddOne()]), store, progress=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fill(ds)
            self.check_items(ds)  # computed again: nothing was stored
        self.assertEqual(len(caught), 1, [str(w.message) for w in caught])
        self.assertIn("max_bytes" if why == "budget" else "cannot write", str(caught[0].message))
        self.assertEqual(computations(self.log), Counter(dict.fromkeys(range(N), 2)))
        stats = cache_stats(ds)
        self.assertEqual(stats["process"], {"hits": 0, "misses": N, "computed": 2 * N, "refused": 2 * N})
        self.assertEqual(store.stats(), {"filled": 0, "nbytes": 0, **stats["process"]})

    @needs_store
    @needs_fork
    def test_counts_of_killed_processes_are_kept_and_their_slots_reused(self) -> None:
        """Processes SIGKILLed without cleanup keep their counts; their slots are reused: as many as processes at once."""
        with mock.patch.object(cache_counters, "_MAX_SLOTS", 2):  # this process and one child at a time
            store = self.runtime_cache("store")
            store.put("k", torch.zeros(10))
            self.assertEqual(store.get_or_compute("k", lambda: -1).sum(), 0)
            for hits in range(1, 6):
                child = FORK.Process(target=_count_and_die, args=(store, hits))  # type: ignore[union-attr]
                child.start()
                child.join(TIMEOUT)
                if child.is_alive():
                    child.kill()
                    child.join(TIMEOUT)
                self.assertEqual(child.exitcode, -signal.SIGKILL)
                self.assertEqual(len(os.listdir(os.path.join(store.path, ".counters"))), 2)
                store.discard(["c"])  # so that the next child computes it again
        self.assertEqual(counts(store.stats()), {"hits": 1 + 15, "misses": 5, "computed": 5, "refused": 0})
        self.assertEqual(store.process_stats(), {"hits": 1, "misses": 0, "computed": 0, "refused": 0})


if __name__ == "__main__":
    unittest.main()
