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
The extended tests of PR 01 (list, ListProxy and "thread" runtime caches, and the eager cache): container lengths,
DataLoader workers forked and spawned, concurrent resizes, other processes on one container, a killed Manager, two
gloo ranks. Standalone: they need nothing of the later PRs (no SharedCacheStore).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import shutil
import tempfile
import time
import unittest
import warnings
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
from fork_utils import CountedLoad, Load, RandAdd, Scale, executions
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader, SmartCacheDataset
from monai.data import dataset as dataset_module
from monai.data import transforms_hashing
from monai.transforms import Compose, Lambda, Lambdad, RandomizableTransform

TIMEOUT = 120.0  # seconds for any wait on another process
DATA = list(range(10))
START_METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
# DataLoader workers of the ranks: fork where there is fork (a full interpreter start per spawned worker is slow)
WORKER_METHOD = "fork" if "fork" in START_METHODS else "spawn"


def make_transform(log: str | None = None) -> Compose:
    return Compose([Load(log), RandAdd()])


def first_item(batch):
    return batch[0]


def check_item(test: unittest.TestCase, item: dict, src, added: float = 1.0) -> None:
    """``item`` is ``Load()(src)`` and then, unless it is a cached item itself (``added=0``), ``RandAdd`` once."""
    test.assertEqual(item["src"], src)
    expected = torch.full((3, 4), float(src) + added)
    test.assertTrue(torch.equal(torch.as_tensor(item["img"]), expected), f"wrong image for {src}: {item['img']}")


def join_all(test: unittest.TestCase, procs: list) -> list:
    """Join ``procs`` (started); kill those still alive past the timeout, and fail then. Their exit codes."""
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in procs if p.is_alive()]
    for p in late:
        p.kill()
        p.join(TIMEOUT)
    if late:
        test.fail(f"{len(late)} child processes did not finish in {TIMEOUT} s")
    return [p.exitcode for p in procs]


def run_ranks(test: unittest.TestCase, fn, args: tuple, nprocs: int = 2) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; fail, killing them, past twice the timeout."""
    ctx = torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + 2 * TIMEOUT
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                test.fail("the ranks timed out")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)


class ManagerTestCase(unittest.TestCase):
    """A Manager and a temporary directory per test, both removed at the end."""

    def setUp(self) -> None:
        self.manager = multiprocessing.Manager()
        self.addCleanup(self.manager.shutdown)  # also after the test killed its server
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.log = os.path.join(self.tmp, "log")

    def container(self, kind: str, length: int = 0):
        if kind == "listproxy":
            return self.manager.list([None] * length)
        return [None] * length if kind == "list" else kind  # else a mode

    def kill_manager(self) -> None:
        self.manager._process.kill()
        self.manager._process.join(TIMEOUT)
        self.assertFalse(self.manager._process.is_alive())


SIZING = [(k, n, r) for k in ("list", "listproxy") for n in (0, 3, 5, 10, 20) for r in (0.5, 1.0)]


class TestSizing(ManagerTestCase):
    @parameterized.expand(SIZING + [("thread", 0, 0.5), ("thread", 0, 1.0)])
    def test_main_process(self, kind, length, rate):
        cache = self.container(kind, length)
        ds = CacheDataset(DATA, make_transform(), cache_rate=rate, runtime_cache=cache, progress=False)
        self.assertEqual(ds.cache_num, int(len(DATA) * rate))
        for _ in range(2):
            for i in range(len(DATA)):
                check_item(self, ds[i], DATA[i])
        check_item(self, ds[-1], DATA[-1])
        if not isinstance(cache, str):
            self.assertEqual(len(cache), max(length, ds.cache_num))  # grown to cache_num, never trimmed
        self.assertEqual(len(ds._cache), ds.cache_num)
        self.assertEqual([d["src"] for d in ds._cache], DATA[: ds.cache_num])  # the view holds the cached items

    @parameterized.expand([(m, n) for m in START_METHODS for n in (0, 3, 20)])
    def test_dataloader_workers(self, method, length):
        cache = self.container("listproxy", length)
        ds = CacheDataset(DATA, make_transform(self.log), cache_rate=0.5, runtime_cache=cache, progress=False)
        loader = DataLoader(
            ds, batch_size=1, num_workers=2, multiprocessing_context=method, timeout=TIMEOUT, collate_fn=first_item
        )
        for _ in range(2):
            got = sorted((item["src"], item["img"]) for item in loader)
            self.assertEqual([s for s, _ in got], DATA)
            for src, img in got:
                self.assertTrue(torch.equal(img, torch.full((3, 4), float(src) + 1)), src)
        self.assertEqual(len(cache), max(length, 5))
        self.assertEqual(len(ds._cache), 5)
        # shared with the workers: the parent sees what they cached; cached items ran once, the others every epoch
        self.assertEqual([d["src"] if d is not None else None for d in ds._cache], DATA[:5])
        counts = executions(self.log)
        self.assertEqual({k: counts[k] for k in DATA[:5]}, dict.fromkeys(DATA[:5], 1))
        self.assertEqual({k: counts[k] for k in DATA[5:]}, dict.fromkeys(DATA[5:], 2))

    def test_not_resizable(self):
        class Fixed:  # item assignment but neither slice assignment nor deletion
            def __init__(self):
                self.items = [None] * 3

            def __len__(self):
                return len(self.items)

            def __getitem__(self, i):
                return self.items[i]

            def __setitem__(self, i, v):
                if isinstance(i, slice):
                    raise TypeError("no slices")
                self.items[i] = v

            def __delitem__(self, i):
                raise TypeError("no deletion")

        with self.assertRaisesRegex(ValueError, r"length 3.*cache_num=10"):
            CacheDataset(DATA, make_transform(), runtime_cache=Fixed(), progress=False)

    def test_read_only_refused(self):
        """The fork writes (key, item) in the slots: a tuple, long enough or not, is refused at once, clearly."""
        with self.assertRaisesRegex(TypeError, "runtime_cache of type tuple has no item assignment"):
            CacheDataset(DATA[:3], make_transform(), runtime_cache=(10, 20, 30), progress=False)
        ds = CacheDataset(DATA[:3], make_transform(), runtime_cache=[], progress=False)
        ds.runtime_cache = (10, 20, 30)
        with self.assertRaisesRegex(TypeError, "has no item assignment"):
            ds.set_data(DATA[3:6])
        self.assertEqual((ds.data, ds.cache_num), (DATA[:3], 3))  # as it was

    @parameterized.expand([("same_length", (0.5,) * 6), ("different_lengths", (0.3, 0.5, 1.0, 0.5, 0.3, 1.0))])
    def test_concurrent_resize(self, _, rates):
        """
        Processes build datasets on one ListProxy at once (a barrier lines them up) and read every item.

        The container ends at least as long as the largest cache_num, however the growths interleave (never trimmed:
        another dataset may hold the slots past its own), and every item read is right.
        """
        ctx = multiprocessing.get_context(START_METHODS[0])  # the start method changes nothing here: fork if it can
        for trial in range(3):
            cache = self.manager.list([None] * (trial * 7))
            start = ctx.Barrier(len(rates))
            procs = [ctx.Process(target=_build_and_read, args=(cache, rate, start)) for rate in rates]
            for p in procs:
                p.start()
            self.assertEqual(join_all(self, procs), [0] * len(procs))  # every child read right items
            entries = list(cache)
            self.assertTrue(any(e is not None for e in entries))
            for i, entry in enumerate(entries):
                if entry is not None:  # slot i caches DATA[i] in every dataset
                    check_item(self, entry[1], DATA[i], added=0.0)
            self.assertGreaterEqual(len(cache), max(int(len(DATA) * rate) for rate in rates))


def _build_and_read(cache, rate, start) -> None:
    start.wait(TIMEOUT)
    ds = CacheDataset(DATA, make_transform(), cache_rate=rate, runtime_cache=cache, progress=False)
    for _ in range(3):
        for i in range(len(DATA)):
            item = ds[i]
            assert item["src"] == DATA[i] and torch.equal(item["img"], torch.full((3, 4), DATA[i] + 1.0)), (i, item)


def fingerprint_with_lambda() -> str:
    offset = {"a": 1.5}
    return str(transforms_hashing([Load(), Lambdad("img", lambda x: x + offset["a"]), Scale(2.0)]))


def _send_fingerprint(conn) -> None:
    conn.send(fingerprint_with_lambda())
    conn.close()


def _set_data_child(cache) -> None:
    ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
    ds.set_data([200 + i for i in range(10)])
    for i in range(10):
        assert ds[i]["src"] == 200 + i and torch.equal(ds[i]["img"], torch.full((3, 4), 201.0 + i)), i


class TestNeverWrongOrStale(ManagerTestCase):
    @parameterized.expand([("list",), ("listproxy",), ("thread",)])
    def test_set_data_same_container(self, kind):
        cache = self.container(kind)
        ds = CacheDataset(DATA, make_transform(self.log), runtime_cache=cache, progress=False)
        container = getattr(ds._cache, "cache", None)
        for i in range(10):
            check_item(self, ds[i], DATA[i])
        new = [100 + i for i in range(6)] + DATA[6:]  # the last four stay the same
        ds.set_data(new)
        for i in range(10):
            check_item(self, ds[i], new[i])
        if kind != "thread":  # as upstream, "thread" starts a new private list at every set_data
            self.assertIs(ds._cache.cache, container)  # the same container, resynced
            self.assertEqual([executions(self.log)[k] for k in DATA[6:]], [1] * 4)  # unchanged inputs stay cached
        ds.set_data(DATA[:4])
        self.assertEqual(len(ds._cache), 4)
        if not isinstance(cache, str):
            self.assertEqual(len(cache), 10)  # never trimmed
        for i in range(4):
            check_item(self, ds[i], DATA[i])

    @parameterized.expand([(m,) for m in START_METHODS])
    def test_set_data_between_epochs_workers(self, method):
        cache = self.manager.list()
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        longest = 0
        for data in (DATA, [50 + i for i in range(12)], DATA[:3]):
            ds.set_data(data)
            longest = max(longest, len(data))
            loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=method, timeout=TIMEOUT)
            got = []
            for batch in loader:
                got.extend(int(s) for s in batch["src"])
                for s, img in zip(batch["src"], batch["img"]):
                    self.assertTrue(torch.equal(img, torch.full((3, 4), float(s) + 1)), int(s))
            self.assertEqual(sorted(got), sorted(data))
            self.assertEqual(len(cache), longest)  # grown, never trimmed
            self.assertEqual([e[1]["src"] for e in cache[: len(data)]], list(data))  # filled by the workers

    @parameterized.expand([("list",), ("listproxy",)])
    def test_two_datasets_share_a_container(self, kind):
        cache = self.container(kind)
        a = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        b = CacheDataset([20 + i for i in range(10)], make_transform(), runtime_cache=cache, progress=False)
        for _ in range(3):
            for i in range(10):
                check_item(self, a[i], DATA[i])
                check_item(self, b[i], 20 + i)

    @parameterized.expand([("list",), ("listproxy",)])
    def test_same_data_other_transforms_share_a_container(self, kind):
        """A training and a validation dataset over the same inputs, one cache: each gets its own transforms' items."""
        cache = self.container(kind)
        train = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        val = CacheDataset(DATA, Compose([Load(), Scale(10.0), RandAdd()]), runtime_cache=cache, progress=False)
        for _ in range(2):
            for i in range(10):
                check_item(self, train[i], DATA[i])
                self.assertTrue(torch.equal(val[i]["img"], torch.full((3, 4), 10.0 * DATA[i] + 1)), i)

    def test_fingerprint_of_lambdas(self):
        """Lambdas in the cached transforms: same code and closure values share, anything else does not."""

        def fp(transforms):
            first_random = Compose(transforms).get_index_of_first(lambda t: isinstance(t, RandomizableTransform))
            digest = transforms_hashing(transforms[:first_random])
            self.assertIsNotNone(digest)  # lambdas do not make it fall back to a random tag
            return digest

        def scaled(factor):
            return Lambda(lambda x: x * factor)

        self.assertEqual(fp([Lambda(lambda x: x + 1)]), fp([Lambda(lambda x: x + 1)]))
        self.assertNotEqual(fp([Lambda(lambda x: x + 1)]), fp([Lambda(lambda x: x + 2)]))
        self.assertEqual(fp([scaled(2)]), fp([scaled(2)]))
        self.assertNotEqual(fp([scaled(2)]), fp([scaled(3)]))
        self.assertNotEqual(fp([Load()]), fp([Load(), Scale(2.0)]))
        self.assertEqual(fp([Load(), RandAdd(), Scale(2.0)]), fp([Load(), RandAdd(), Scale(3.0)]))  # not cached

    def test_fingerprint_same_in_another_process(self):
        """Fresh interpreters (other ranks, other hash seeds) compute the same fingerprint of a pipeline with a lambda."""
        ctx = multiprocessing.get_context("spawn")
        got = []
        for _ in range(2):
            recv, send = ctx.Pipe(duplex=False)
            self.addCleanup(recv.close)
            proc = ctx.Process(target=_send_fingerprint, args=(send,))
            proc.start()
            send.close()
            got.append(recv.recv() if recv.poll(TIMEOUT) else "no fingerprint from the child process")
            self.assertEqual(join_all(self, [proc]), [0])
        self.assertNotEqual(fingerprint_with_lambda(), "None")
        self.assertEqual(got, [fingerprint_with_lambda()] * 2)

    def test_other_process_set_data(self):
        """A child process calls set_data with other data on the shared container; the parent stays right."""
        cache = self.manager.list()
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        for i in range(10):
            check_item(self, ds[i], DATA[i])
        proc = multiprocessing.get_context("spawn").Process(target=_set_data_child, args=(cache,))
        proc.start()
        self.assertEqual(join_all(self, [proc]), [0])
        self.assertEqual([e[1]["src"] for e in cache if e is not None][:4], [200, 201, 202, 203])
        for _ in range(2):
            for i in range(10):
                check_item(self, ds[i], DATA[i])

    @parameterized.expand([("list",), ("listproxy",)])
    def test_prefilled(self, kind):
        junk = [("junk", i) for i in range(4)] + [("not-the-key", {"src": -1})] + [{"src": -2}] * 5
        cache = self.manager.list(junk) if kind == "listproxy" else list(junk)
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        for _ in range(2):
            for i in range(10):
                check_item(self, ds[i], DATA[i])

    @parameterized.expand([(False,), (True,), ("thread",), ("process",), ("list",), ("listproxy",)])
    def test_hash_as_key_duplicates(self, mode):
        data = [{"id": 1}, {"id": 1}, {"id": 5}, {"id": 7}, {"id": 5}]
        cache = self.container(mode) if mode in ("list", "listproxy") else mode
        ds = CacheDataset(data, make_transform(self.log), hash_as_key=True, runtime_cache=cache, progress=False)
        self.assertEqual(ds.cache_num, 3)
        for _ in range(2):
            for i, d in enumerate(data):
                check_item(self, ds[i], d["id"])
        self.assertEqual(executions(self.log), Counter({1: 1, 5: 1, 7: 1}))


class TestValues(unittest.TestCase):
    @parameterized.expand([("proc3ss",), ("Process",), ("",), ("THREAD",)])
    def test_bad_strings(self, value):
        with self.assertRaisesRegex(ValueError, r"runtime_cache=.*accepted strings contain 'thread' or 'process'"):
            CacheDataset(DATA, make_transform(), runtime_cache=value, progress=False)

    @parameterized.expand([(7,), (1.5,), ((1, 2),), (object(),), (b"process",)])
    def test_bad_types(self, value):
        with self.assertRaisesRegex((TypeError, ValueError), r"runtime_cache of type .*; accepted"):
            CacheDataset(DATA, make_transform(), runtime_cache=value, progress=False)

    @parameterized.expand([(None,), (False,), (0,)])
    def test_eager(self, value):
        """As upstream, 0 (== False) fills the cache in the constructor."""
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "log")
            ds = CacheDataset(DATA, make_transform(log), runtime_cache=value, progress=False)
            self.assertEqual(executions(log), Counter(DATA))  # all computed before any read
            self.assertEqual([d["src"] for d in ds._cache], DATA)
            for _ in range(2):
                for i in range(10):
                    check_item(self, ds[i], DATA[i])
            self.assertEqual(executions(log), Counter(DATA))

    @parameterized.expand([(True,), ("thread",), ("threads",), ("process",), ("processes",)])
    def test_modes(self, value):
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "log")
            ds = CacheDataset(DATA, make_transform(log), runtime_cache=value, progress=False)
            self.assertEqual(executions(log), Counter())  # filled at the first read, not in the constructor
            for _ in range(2):
                for i in range(10):
                    check_item(self, ds[i], DATA[i])
            self.assertEqual(executions(log), Counter(DATA))

    def test_smartcache_refuses(self):
        with self.assertRaisesRegex(NotImplementedError, r"runtime_cache=False"):
            SmartCacheDataset(DATA, make_transform(), runtime_cache=True)


class TestFaults(ManagerTestCase):
    def setUp(self):
        super().setUp()
        patcher = mock.patch.object(dataset_module._unreachable, "warned", False, create=True)  # once per process
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_manager_killed_mid_epoch_main(self):
        cache = self.manager.list()
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        for i in range(5):
            check_item(self, ds[i], DATA[i])
        self.kill_manager()
        with self.assertWarnsRegex(RuntimeWarning, "unreachable"):
            check_item(self, ds[5], DATA[5])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per process only
            for _ in range(2):
                for i in range(10):
                    check_item(self, ds[i], DATA[i])
            ds.set_data(DATA[:5])  # a resync with a dead server neither raises nor hangs
            check_item(self, ds[4], 4)

    @parameterized.expand([(m,) for m in START_METHODS])
    def test_manager_killed_mid_epoch_workers(self, method):
        cache = self.manager.list()
        ds = CacheDataset(DATA * 4, make_transform(), runtime_cache=cache, progress=False)
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=method, timeout=TIMEOUT)
        got = []
        t0 = time.monotonic()
        for n, batch in enumerate(loader):
            if n == 3:
                self.kill_manager()
            got.extend(int(s) for s in batch["src"])
            for s, img in zip(batch["src"], batch["img"]):
                self.assertTrue(torch.equal(img, torch.full((3, 4), float(s) + 1)), int(s))
        self.assertLess(time.monotonic() - t0, TIMEOUT)
        self.assertEqual(sorted(got), sorted(DATA * 4))

    def test_dead_container(self):
        class Dead:
            def __len__(self):
                raise BrokenPipeError("gone")

            def __getitem__(self, *args):
                raise BrokenPipeError("gone")

            __setitem__ = __getitem__

        with self.assertWarnsRegex(RuntimeWarning, "unreachable"):
            ds = CacheDataset(DATA, make_transform(), runtime_cache=Dead(), progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            for _ in range(2):
                check_item(self, ds[0], 0)


def _ddp_worker(rank: int, world: int, init: str, caches: list, rate: float, out_dir: str) -> None:
    span = datetime.timedelta(seconds=TIMEOUT)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=span)
    try:
        for n, cache in enumerate(caches):
            log = os.path.join(out_dir, f"log{n}")
            ds = CacheDataset(DATA, make_transform(log), cache_rate=rate, runtime_cache=cache, progress=False)
            sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=1)
            loader = DataLoader(
                ds, batch_size=2, sampler=sampler, num_workers=2, timeout=TIMEOUT, multiprocessing_context=WORKER_METHOD
            )
            seen = []
            for epoch in range(3):
                sampler.set_epoch(epoch)
                for batch in loader:
                    for s, img in zip(batch["src"], batch["img"]):
                        assert torch.equal(img, torch.full((3, 4), float(s) + 1)), (rank, int(s))
                        seen.append(int(s))
            with open(os.path.join(out_dir, f"seen{n}-rank{rank}"), "w") as f:
                f.write(" ".join(map(str, seen)))
            dist.barrier()
    finally:
        dist.destroy_process_group()


class TestDistributed(ManagerTestCase):
    @parameterized.expand([(0.5,), (1.0,)])
    def test_two_gloo_ranks_share_listproxy(self, rate):
        """ListProxies made in the parent, empty, shorter and longer than cache_num, shared by 2 spawned gloo ranks."""
        lengths = (0, 3, 20)
        caches = [self.manager.list([None] * n) for n in lengths]
        init = "file://" + os.path.join(self.tmp, "rdzv")
        run_ranks(self, _ddp_worker, (2, init, caches, rate, self.tmp))
        cache_num = int(len(DATA) * rate)
        for n, cache in enumerate(caches):
            self.assertGreaterEqual(len(cache), max(cache_num, lengths[n]), f"initial length {lengths[n]}")  # never
            # trimmed; two ranks may grow it at once
            self.assertEqual([e[1]["src"] for e in cache[:cache_num]], DATA[:cache_num])
            seen = []
            for r in range(2):
                with open(os.path.join(self.tmp, f"seen{n}-rank{r}")) as f:
                    seen += [int(x) for x in f.read().split()]
            self.assertEqual(sorted(seen), sorted(DATA * 3))  # 3 epochs, each item once per epoch across ranks
            counts = executions(os.path.join(self.tmp, f"log{n}"))
            # a cached item is computed at most once per rank (a ListProxy has no claims, so both ranks may miss it
            # at once), never once per epoch as without a cache; the others every epoch
            for k in DATA[:cache_num]:
                self.assertIn(counts[k], (1, 2), k)
            for k in DATA[cache_num:]:
                self.assertEqual(counts[k], 3, k)


class TestKeys(unittest.TestCase):
    def test_unpicklable_members_count_by_type(self):
        a, b = CountedLoad("x"), CountedLoad("x")
        self.assertIsNotNone(transforms_hashing([a]))
        self.assertEqual(transforms_hashing([a]), transforms_hashing([b]))  # other lock and Value, same type
        self.assertNotEqual(transforms_hashing([a]), transforms_hashing([CountedLoad("y")]))  # picklable state counts
        self.assertNotEqual(transforms_hashing([a]), transforms_hashing([Load("x")]))  # and the type


if __name__ == "__main__":
    unittest.main()
