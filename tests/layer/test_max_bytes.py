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

import functools
import multiprocessing
import os
import struct
import time
import unittest
import warnings
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai_sharedcache import SharedCacheStore, _flock, budget, persist
from tests.layer import test_cache_store as core

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 120
# fork where it can: spawned writers import torch and MONAI each, for 30 s of 8 processes on 2 cores
CTX = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
ITEM = 8 * 40_000  # bytes of the float64 arrays below, without the file's header


def _refused_elsewhere(path: str) -> None:
    store = SharedCacheStore(path)  # another process that joins the store: the creator's budget holds for it too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.get_or_compute("child", lambda: np.ones(40_000)).sum() == 40_000  # refused, still returned


def _writer(path: str, start, name: str) -> None:
    store = SharedCacheStore(path)
    start.wait(TIMEOUT)  # all writers at once: each must see the others' bytes before its next write
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(6):
            store.put(f"{name}-{i}", np.full(2**17, float(i)))  # 1 MiB each
    store.close()


def _same_key_writer(path: str, start) -> None:
    import monai_sharedcache._format as fmt  # the writer, made slow

    write = fmt.write_item

    def slow(fd, chunks):
        time.sleep(0.2)  # every writer has looked for an earlier copy before any publishes, unless they take turns
        write(fd, chunks)

    fmt.write_item = slow
    store = SharedCacheStore(path)
    start.wait(TIMEOUT)
    assert store.put("same", np.ones(40_000))
    store.close()


def _slow_replacing_writer(path: str, writing) -> None:
    import monai_sharedcache._format as fmt

    write = fmt.write_item

    def slow(fd, chunks):
        writing.set()
        time.sleep(0.5)  # the other process removes the item meanwhile, unless it waits for this write's turn
        write(fd, chunks)

    fmt.write_item = slow
    store = SharedCacheStore(path)
    assert store.put("same", np.zeros(40_000))
    store.close()


def _killed_writer(path: str) -> None:
    import monai_sharedcache._format as fmt  # the writer, made to die half way

    def die(fd, chunks):
        os.write(fd, b"partial")
        os._exit(9)

    fmt.write_item = die
    SharedCacheStore(path).put("killed", np.ones(40_000))


@needs_store
class TestMaxBytes(unittest.TestCase):
    setUp = core.StoreTestCase.setUp
    new_store = functools.partialmethod(core.StoreTestCase.new_store, SharedCacheStore)  # the layer's store
    refuse = core.StoreTestCase.refuse

    def items(self, store: SharedCacheStore) -> list[str]:
        return [n for n in os.listdir(store.path) if n.endswith(".item")]

    def start(self, *procs: multiprocessing.process.BaseProcess) -> None:
        for p in procs:
            p.start()
            self.addCleanup(lambda p=p: (p.is_alive() and p.kill(), p.join(TIMEOUT)))

    def finish(self, *procs: multiprocessing.process.BaseProcess) -> None:
        for p in procs:
            p.join(TIMEOUT)
        self.assertEqual([p.exitcode for p in procs], [0] * len(procs))

    def used(self, store: SharedCacheStore) -> tuple[int, int]:
        """The bytes and the items that the store counts."""
        with open(os.path.join(store.path, budget.USED_FILE), "rb") as f:
            return struct.unpack("<qqqd", f.read())[:2]

    def test_cap_refuses_past_max_bytes(self):
        store = self.new_store(max_bytes=3 * ITEM + 3 * 4096, reserve=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                item = store.get_or_compute(f"k{i}", lambda i=i: np.full(40_000, float(i)))
                np.testing.assert_array_equal(item, np.full(40_000, float(i)))  # stored or not, the right item
        self.assertEqual(sorted(self.items(store)), ["k0.item", "k1.item", "k2.item"])
        (message,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]  # once per process
        for option in ("max_bytes", "--shm-size", "--ipc=host", "MONAI_CACHE_ROOT"):
            self.assertIn(option, message)
        proc = multiprocessing.get_context().Process(target=_refused_elsewhere, args=(store.path,))
        self.start(proc)
        self.finish(proc)
        self.assertEqual(len(self.items(store)), 3)

    def test_cap_holds_for_all_writers(self):
        store = self.new_store(max_bytes=8 * 2**20, reserve=0)
        ctx = CTX
        start = ctx.Barrier(4)
        procs = [ctx.Process(target=_writer, args=(store.path, start, f"w{i}")) for i in range(4)]
        self.start(*procs)
        self.finish(*procs)
        sizes = [os.path.getsize(os.path.join(store.path, n)) for n in self.items(store)]
        self.assertLessEqual(sum(sizes), 8 * 2**20)  # 24 MiB offered by 4 processes
        # 8 items of 1 MiB and their headers do not fit, 7 do; a recount while a write ends counts it twice, and may
        # refuse one that fits until the next recount
        self.assertIn(len(sizes), (6, 7))

    def test_one_key_counted_once(self):
        """8 processes write one key at once (as after a claim timeout): one item, and its bytes once, are counted."""
        store = self.new_store(max_bytes=100 * ITEM, reserve=0)
        ctx = CTX
        start = ctx.Barrier(8)
        procs = [ctx.Process(target=_same_key_writer, args=(store.path, start)) for _ in range(8)]
        self.start(*procs)
        self.finish(*procs)
        self.assertEqual(self.used(store), (os.path.getsize(os.path.join(store.path, "same.item")), 1))
        self.assertEqual(store.stats()["filled"], 1)

    def test_removal_during_a_write_of_its_key(self):
        """A key removed while another process writes it anew: the count stays what the store holds."""
        store = self.new_store(max_bytes=100 * ITEM, reserve=0)
        self.assertTrue(store.put("same", np.ones(40_000)))
        ctx = CTX
        writing = ctx.Event()
        proc = ctx.Process(target=_slow_replacing_writer, args=(store.path, writing))
        self.start(proc)
        self.assertTrue(writing.wait(TIMEOUT))
        store.discard(["same"])  # after the write, in its turn
        self.finish(proc)
        sizes = [os.path.getsize(os.path.join(store.path, n)) for n in self.items(store)]
        self.assertEqual(self.used(store), (sum(sizes), len(sizes)))

    def test_recount_misses_no_write_that_ends_meanwhile(self):
        """A write published, and its file of a write under way removed, while the store counts: counted, not missed."""
        store = self.new_store(max_bytes=2**20, reserve=0)
        writes = store._subdir(budget.WRITES_DIR)  # the store's own directory of the writes under way
        under_way = _flock.hold(writes, f"{'0' * 16}-{ITEM}")  # another writer's reservation, alive
        real_items = persist.items

        def items_then_the_write_ends(at):
            found = real_items(at)
            with open(os.path.join(store.path, "w.item"), "wb") as f:
                f.write(bytes(ITEM))  # published
            writes.unlink(f"{'0' * 16}-{ITEM}")
            under_way.close()
            return found

        with mock.patch.object(persist, "items", items_then_the_write_ends):
            nbytes, _ = store._recount()
        self.assertGreaterEqual(nbytes, ITEM)

    def test_bytes_given_back(self):
        store = self.new_store(max_bytes=2 * ITEM + 2 * 4096, reserve=0)
        self.assertTrue(store.put("a", np.ones(40_000)) and store.put("a", np.zeros(40_000)))  # replaced: counted once
        self.assertTrue(store.put("b", np.ones(40_000)))
        self.assertIn("max_bytes", self.refuse(store, np.ones(40_000)))
        store.discard(["a"])
        proc = CTX.Process(target=_killed_writer, args=(store.path,))
        self.start(proc)
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 9)  # died while writing: its bytes stay counted
        (dead,) = os.listdir(os.path.join(store.path, ".tmp"))
        self.assertTrue(store.put("c", np.ones(40_000)))  # the count would refuse it: counted again, it fits
        self.assertEqual(os.listdir(os.path.join(store.path, ".tmp")), [])  # the dead writer's file, removed then

    def test_a_count_left_too_high_is_made_again(self):
        store = self.new_store(max_bytes=2 * ITEM + 2 * 4096, reserve=0)
        self.assertTrue(store.put("a", np.ones(40_000)))
        with open(os.path.join(store.path, budget.USED_FILE), "r+b") as f:  # as a process killed at the wrong time
            f.write(struct.pack("<qqqd", 10 * ITEM, 9, 5, 0.0))  # leaves it: items removed, bytes not given back
        used = store._used
        with mock.patch.object(used, "recount", wraps=used.recount) as recount:
            self.assertTrue(store.put("b", np.ones(40_000)))  # refused by the count, which is made again: room
            sizes = [os.path.getsize(os.path.join(store.path, n)) for n in self.items(store)]
            self.assertEqual((self.used(store), recount.call_count), ((sum(sizes), 2), 1))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                refused = [store.put(key, np.ones(40_000)) for key in "cde"]
        self.assertEqual((refused, recount.call_count), ([False] * 3, 1))  # not again: no writer died, and recently

    def test_environment(self):
        sub = os.path.join(self.root, "elsewhere")
        os.mkdir(sub, 0o700)
        env = {"MONAI_CACHE_ROOT": sub, "MONAI_CACHE_MAX_BYTES": "0", "MONAI_CACHE_RESERVE_BYTES": "0"}
        with mock.patch.dict(os.environ, env):
            store = SharedCacheStore()
            self.addCleanup(store.close)
        self.assertEqual(os.path.dirname(store.path), sub)
        self.assertIn("max_bytes=0", self.refuse(store))  # the cap of 0 bytes from the environment
        bad = [("MONAI_CACHE_MAX_BYTES", "lots"), ("MONAI_CACHE_MAX_BYTES", "²")]
        for name, value in bad:
            with mock.patch.dict(os.environ, {name: value}):
                with self.assertRaisesRegex(ValueError, f"{name}='{value}'"):
                    SharedCacheStore(root=sub)
        self.assertEqual(os.listdir(sub), [os.path.basename(store.path)])  # nothing left by the refused ones

    @parameterized.expand([("negative", -1), ("float", 1.5), ("bool", True), ("text", "100")])
    def test_bad_values(self, _, value):
        with self.assertRaisesRegex(ValueError, "non-negative integer number of bytes"):
            SharedCacheStore(root=self.root, max_bytes=value)
        self.assertEqual(os.listdir(self.root), [])  # nothing was created

    def test_numpy_integers(self):
        store = self.new_store(max_bytes=np.int64(2 * ITEM), reserve=np.uint32(0))
        self.assertEqual((store.max_bytes, store.reserve, type(store.max_bytes)), (2 * ITEM, 0, int))

    def test_budget_recorded_for_every_user(self):
        store = self.new_store(max_bytes=ITEM, reserve=0)
        joined = SharedCacheStore(store.path)
        self.addCleanup(joined.close)
        self.assertEqual((joined.max_bytes, joined.reserve), (ITEM, 0))  # the creator's
        self.assertEqual(SharedCacheStore(store.path, reserve=5).reserve, 5)  # a reserve of its own, as the core's
        with self.assertRaisesRegex(ValueError, "max_bytes is recorded by a new store"):
            SharedCacheStore(store.path, max_bytes=10)
        with open(os.path.join(store.path, ".budget"), "w") as f:
            f.write('{"reserve": "1000000", "max_bytes": [1]}')  # damaged: the defaults
        self.assertEqual((SharedCacheStore(store.path).max_bytes, SharedCacheStore(store.path).reserve), (None, None))


if __name__ == "__main__":
    unittest.main()
