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

import errno
import gc
import multiprocessing
import os
import shutil
import struct
import tempfile
import threading
import unittest
import warnings
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai.data import _cache_budget as budget
from monai.data import _cache_locks as locks
from monai.data._cache_budget import default_reserve
from monai.data.cache_store import SharedCacheStore

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 120
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


def _killed_writer(path: str) -> None:
    from monai.data import _cache_format

    def die(fd, chunks):
        os.write(fd, b"partial")
        os._exit(9)

    _cache_format.write_item = die
    SharedCacheStore(path).put("killed", np.ones(40_000))


def _warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@needs_store
class TestBudget(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self, **kwargs) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root, **kwargs)
        self.addCleanup(store.close)
        return store

    def refuse(self, store: SharedCacheStore, item=1) -> str:
        """Put an item that the budget refuses; the one warning."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(store.put("refused", item))
        (message,) = _warnings(caught)
        return message

    def items(self, store: SharedCacheStore) -> list[str]:
        return [n for n in os.listdir(store.path) if n.endswith(".item")]

    def test_cap_refuses_past_max_bytes(self):
        store = self.new_store(max_bytes=3 * ITEM + 3 * 4096, reserve=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                item = store.get_or_compute(f"k{i}", lambda i=i: np.full(40_000, float(i)))
                np.testing.assert_array_equal(item, np.full(40_000, float(i)))  # stored or not, the right item
        self.assertEqual(sorted(self.items(store)), ["k0.item", "k1.item", "k2.item"])
        (message,) = _warnings(caught)  # once per process
        for option in ("max_bytes", "--shm-size", "--ipc=host", "MONAI_CACHE_ROOT"):
            self.assertIn(option, message)
        proc = multiprocessing.get_context().Process(target=_refused_elsewhere, args=(store.path,))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        proc.join(TIMEOUT)
        self.assertEqual((proc.exitcode, len(self.items(store))), (0, 3))

    def test_cap_holds_for_all_writers(self):
        store = self.new_store(max_bytes=8 * 2**20, reserve=0)
        ctx = multiprocessing.get_context("spawn")
        start = ctx.Barrier(4)
        procs = [ctx.Process(target=_writer, args=(store.path, start, f"w{i}")) for i in range(4)]
        for p in procs:
            p.start()
            self.addCleanup(lambda p=p: (p.is_alive() and p.kill(), p.join(TIMEOUT)))
        for p in procs:
            p.join(TIMEOUT)
        self.assertEqual([p.exitcode for p in procs], [0] * 4)
        sizes = [os.path.getsize(os.path.join(store.path, n)) for n in self.items(store)]
        self.assertLessEqual(sum(sizes), 8 * 2**20)  # 24 MiB offered by 4 processes
        self.assertEqual(len(sizes), 7)  # 8 items of 1 MiB and their headers do not fit: 7 do

    def test_bytes_given_back(self):
        store = self.new_store(max_bytes=2 * ITEM + 2 * 4096, reserve=0)
        self.assertTrue(store.put("a", np.ones(40_000)) and store.put("a", np.zeros(40_000)))  # replaced: counted once
        self.assertTrue(store.put("b", np.ones(40_000)))
        self.assertIn("max_bytes", self.refuse(store, np.ones(40_000)))
        store.discard(["a"])
        proc = multiprocessing.get_context("spawn").Process(target=_killed_writer, args=(store.path,))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 9)  # died while writing: the room of a it had counted
        (dead,) = os.listdir(os.path.join(store.path, ".tmp"))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            self.assertFalse(store.put("c", np.ones(40_000)))  # its file is young: it may still be writing
        os.utime(os.path.join(store.path, ".tmp", dead), (1, 1))
        self.assertTrue(store.put("c", np.ones(40_000)))  # its file is removed and its bytes given back
        self.assertEqual(os.listdir(os.path.join(store.path, ".tmp")), [])

    def test_a_count_left_too_high_is_made_again(self):
        store = self.new_store(max_bytes=2 * ITEM + 2 * 4096, reserve=0)
        self.assertTrue(store.put("a", np.ones(40_000)))
        with open(os.path.join(store.path, budget.USED_FILE), "r+b") as f:  # as a process killed at the wrong time
            f.write(struct.pack("<qq", 10 * ITEM, 9))  # leaves it: items removed, their bytes not given back
        room = store._room()
        with mock.patch.object(room, "recount", wraps=room.recount) as recount:
            self.assertTrue(store.put("b", np.ones(40_000)))  # refused by the count, which is made again: room
            sizes = [os.path.getsize(os.path.join(store.path, n)) for n in self.items(store)]
            with open(os.path.join(store.path, budget.USED_FILE), "rb") as f:
                self.assertEqual((struct.unpack("<qq", f.read()), recount.call_count), ((sum(sizes), 2), 1))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                refused = [store.put(key, np.ones(40_000)) for key in "cde"]
        self.assertEqual((refused, recount.call_count), ([False] * 3, 2))  # made again once: nothing changed since

    def used(self, store: SharedCacheStore) -> tuple[int, int]:
        with open(os.path.join(store.path, budget.USED_FILE), "rb") as f:
            return struct.unpack("<qq", f.read())

    def test_a_writer_s_file_is_made_once_its_bytes_are_counted(self):
        """A recount counts the temporary files of writers: only those whose bytes the count already holds."""
        store, made = self.new_store(reserve=0), []
        real = locks.open_temp
        with mock.patch.object(locks, "open_temp", lambda *args: (made.append(self.used(store)), real(*args))[1]):
            self.assertTrue(store.put("a", np.ones(40_000)))
        size = os.path.getsize(os.path.join(store.path, "a.item"))
        self.assertEqual((made, self.used(store)), ([(size, 0)], (size, 1)))  # counted, then made; then published

    def test_a_recount_during_a_refused_write_leaves_the_count_right(self):
        """Two threads refused at once: the recount that one makes must not keep the bytes of the other's item."""
        store, others = self.new_store(max_bytes=0, reserve=0), []
        real = locks.open_temp

        def open_temp(*args):  # the other thread writes, and is refused, while this one makes its file
            held = real(*args)
            if not others:
                others.append(threading.Thread(target=store.put, args=("a", np.ones(40_000))))
                others[0].start()
                others[0].join(TIMEOUT / 10)  # not past a lock that this thread might hold
            return held

        with warnings.catch_warnings(), mock.patch.object(locks, "open_temp", open_temp):
            warnings.simplefilter("ignore")
            self.assertFalse(store.put("b", np.ones(40_000)))
            for thread in others:
                thread.join(TIMEOUT)
        self.assertEqual(
            (self.used(store), os.listdir(os.path.join(store.path, ".tmp")), self.items(store)), ((0, 0), [], [])
        )

    @parameterized.expand(
        [("full", errno.ENOSPC, budget.Budget, "create"), ("read_only", errno.EROFS, tempfile, "mkdtemp")]
    )
    def test_no_room_to_make_a_store(self, _, code, where, what):
        with mock.patch.object(where, what, side_effect=OSError(code, os.strerror(code))):
            with self.assertWarnsRegex(RuntimeWarning, "cannot make a store.*MONAI_CACHE_ROOT"):
                store = self.new_store()  # the job goes on, without the cache
        self.assertEqual((store.get_or_compute("k", lambda: 3), store.put("k", 1), store.get("k")), (3, False, None))
        self.assertEqual(os.listdir(self.root), [])  # nothing left behind

    def test_reserve(self):
        full = self.new_store(reserve=2**62)  # more than any file system has free: nothing is stored
        self.assertIn("(reserve)", self.refuse(full, np.ones(10)))
        self.assertEqual((full.get_or_compute("k", lambda: 3), self.items(full), full.get("k")), (3, [], None))
        self.assertTrue(self.new_store(reserve=0).put("k", np.ones(10)))

    def test_default_reserve(self):
        self.assertEqual(default_reserve(64 * 2**20), 32 * 2**20)  # half of Docker's default /dev/shm
        self.assertEqual(default_reserve(256 * 2**30), 4 * 2**30)  # at most 4 GiB of a large one
        with mock.patch.dict(os.environ, {"MONAI_CACHE_RESERVE_BYTES": ""}):
            store = self.new_store()
        with mock.patch("os.statvfs") as statvfs:  # a 64 MiB file system with 40 MiB free
            statvfs.return_value = mock.Mock(f_bavail=40 * 256, f_blocks=64 * 256, f_frsize=4096)
            self.assertTrue(store.put("fits", np.ones(2**20 // 8)))  # 40 - 1 MiB >= 32 MiB
            message = self.refuse(store, np.ones(9 * 2**20 // 8))  # 40 - 9 MiB < 32 MiB
        self.assertIn("32 MiB are kept free", message)

    def test_environment(self):
        sub = os.path.join(self.root, "elsewhere")
        os.mkdir(sub, 0o700)
        env = {"MONAI_CACHE_ROOT": sub, "MONAI_CACHE_MAX_BYTES": "0", "MONAI_CACHE_RESERVE_BYTES": "0"}
        with mock.patch.dict(os.environ, env):
            store = SharedCacheStore()
            self.addCleanup(store.close)
        self.assertEqual(os.path.dirname(store.path), sub)
        self.assertIn("max_bytes=0", self.refuse(store))  # the cap of 0 bytes from the environment
        with mock.patch.dict(os.environ, {"MONAI_CACHE_RESERVE_BYTES": str(2**62)}):
            self.assertIn("(reserve)", self.refuse(self.new_store()))
        with mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": os.path.join(self.root, "missing")}):
            with self.assertRaisesRegex(FileNotFoundError, "MONAI_CACHE_ROOT"):
                SharedCacheStore()
        bad = [("MONAI_CACHE_MAX_BYTES", "lots"), ("MONAI_CACHE_RESERVE_BYTES", "1e6"), ("MONAI_CACHE_MAX_BYTES", "²")]
        for name, value in bad:
            with mock.patch.dict(os.environ, {name: value}):
                with self.assertRaisesRegex(ValueError, f"{name}='{value}'"):
                    SharedCacheStore(root=sub)
        self.assertEqual(os.listdir(sub), [os.path.basename(store.path)])  # nothing left by the refused ones

    @parameterized.expand([("negative", {"reserve": -1}), ("float", {"max_bytes": 1.5}), ("bool", {"max_bytes": True})])
    def test_bad_values(self, _, kwargs):
        with self.assertRaisesRegex(ValueError, "non-negative number of bytes"):
            SharedCacheStore(root=self.root, **kwargs)
        self.assertEqual(os.listdir(self.root), [])  # nothing was created

    @parameterized.expand([("reserve",), ("max_bytes",)])
    def test_budget_only_at_creation(self, name):
        store = self.new_store()
        with self.assertRaisesRegex(ValueError, "only used to create a new store"):
            SharedCacheStore(store.path, **{name: 10})

    def test_a_new_store_at_a_freed_stores_address_still_warns(self):
        """Warnings are once per store and process: a store that reuses the id() of a freed one warns too."""
        seen: dict[int, int] = {}
        for attempt in range(50):
            store = SharedCacheStore(root=self.root, reserve=2**62)
            self.assertIn("(reserve)", self.refuse(store), f"attempt {attempt}")
            seen[id(store)] = seen.get(id(store), 0) + 1
            store.close()
            del store
            gc.collect()
            if max(seen.values()) >= 2:
                return
        self.skipTest("no store reused the address of a freed one in 50 attempts")


if __name__ == "__main__":
    unittest.main()
