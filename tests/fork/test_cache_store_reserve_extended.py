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
The tests of PR 02's reserve that do not fit its exported ``test_cache_store_reserve.py``: its default, one reserve per
process, the environment variable, bad values, a store without room to be made, and a store made at a freed store's address.
"""

from __future__ import annotations

import errno
import gc
import os
import pickle
import threading
import unittest
import warnings
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _format as fmt
from tests.layer.test_cache_store import TIMEOUT, StoreTestCase, needs_store


class _Narrow(SharedCacheStore):
    """A store whose room is a 64 MiB file system with 40 MiB free: what a subclass (a memory limit) may report."""

    def free_space(self) -> tuple[int, int] | None:
        return 40 * 2**20, 64 * 2**20


class _FilledMeanwhile(SharedCacheStore):
    """A store whose file system others fill while it writes: 40 MiB free before the write, 20 MiB after it."""

    def free_space(self) -> tuple[int, int] | None:
        found = os.listdir(os.path.join(self.path, ".tmp"))
        return (20 if found else 40) * 2**20, 64 * 2**20


class _Sized(SharedCacheStore):
    """A store alone on a 64 MiB file system: what it holds, items and writes under way, is all that is used."""

    def free_space(self) -> tuple[int, int] | None:
        used = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(self.path) for n in names)
        return (64 << 20) - used, 64 << 20


@needs_store
class TestReserveExtended(StoreTestCase):
    def test_reserve_holds_under_concurrent_writers(self):
        """8 writers at once, each past the first check before any wrote, and a reserve that leaves room for 4 items."""
        store = self.new_store(_Sized, reserve=36 << 20)
        everyone_checked, real = threading.Barrier(8, timeout=TIMEOUT), fmt.write_item

        def wait_then_write(fd, chunks):
            everyone_checked.wait()  # each found room for its item before any byte was written
            real(fd, chunks)

        stored: list[bool] = []
        with mock.patch.object(fmt, "write_item", wait_then_write), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not storing items past the budget"
            threads = [
                threading.Thread(target=lambda i=i: stored.append(store.put(f"k{i}", np.full((6 << 20) // 8, i))))
                for i in range(8)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
        self.assertEqual(len(stored), 8)
        self.assertGreaterEqual(store.free_space()[0], 36 << 20)  # the reserve held, with every write published
        self.assertIn(sum(stored), range(1, 5))
        self.assertEqual(len(self.files(store)), sum(stored))
        self.assertEqual(self.files(store, ".tmp"), [])

    def test_reserve_checked_again_once_written(self):
        """Writers that pass the check at once do not eat the reserve together: the last to find it gone refuses."""
        store = self.new_store(_FilledMeanwhile, reserve=32 * 2**20)
        self.assertIn("32 MiB are kept free", self.refuse(store, np.ones(2**20 // 8)))
        self.assertEqual((self.files(store), self.files(store, ".tmp")), ([], []))
        self.assertIsNone(store.get("k"))

    def test_default_reserve_of_the_room_a_subclass_reports(self):
        with mock.patch.dict(os.environ, {"MONAI_CACHE_RESERVE_BYTES": ""}):
            store = self.new_store(_Narrow)
        self.assertIsNone(store._room_for(2**20))  # 40 - 1 MiB >= 32 MiB: half of Docker's default /dev/shm
        self.assertTrue(store.put("fits", np.ones(2**20 // 8)))
        self.assertIn("32 MiB are kept free", store._room_for(9 * 2**20))  # 40 - 9 MiB < 32 MiB
        self.assertIn("32 MiB are kept free", self.refuse(store, np.ones(9 * 2**20 // 8)))
        with mock.patch.dict(os.environ, {"MONAI_CACHE_RESERVE_BYTES": ""}):
            plain = self.new_store()
        with mock.patch("os.statvfs") as statvfs:  # 5 GiB free of 256 GiB: at most 4 GiB are kept
            statvfs.return_value = mock.Mock(f_bavail=5 * 2**18, f_blocks=64 * 2**20, f_frsize=4096)
            self.assertIsNone(plain._room_for(2**30 - 4096))
            self.assertIn("4096 MiB are kept free", plain._room_for(2**30 + 4096))

    def test_each_process_keeps_its_reserve(self):
        store = self.new_store(reserve=0)
        joined = SharedCacheStore(store.path, reserve=2**62)
        self.addCleanup(joined.close)
        self.assertIn("(reserve)", self.refuse(joined))
        self.assertTrue(store.put("k", 1))
        copy = pickle.loads(pickle.dumps(joined))  # a DataLoader worker's copy keeps it
        self.assertEqual((copy.reserve, copy.get("k")), (2**62, 1))

    def test_environment(self):
        with mock.patch.dict(os.environ, {"MONAI_CACHE_RESERVE_BYTES": str(2**62)}):
            store = self.new_store()
        self.assertIn("(reserve)", self.refuse(store))
        store.close()
        with mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": os.path.join(self.root, "missing")}):
            with self.assertWarnsRegex(RuntimeWarning, "MONAI_CACHE_ROOT=.*missing.*must be an existing directory"):
                self.assertFalse(SharedCacheStore().put("k", 1))
        for value in ("lots", "1e6", "²"):
            with mock.patch.dict(os.environ, {"MONAI_CACHE_RESERVE_BYTES": value}):
                with self.assertRaisesRegex(ValueError, f"MONAI_CACHE_RESERVE_BYTES='{value}'"):
                    SharedCacheStore(root=self.root)
        self.assertEqual(os.listdir(self.root), [])  # nothing left by the refused ones

    @parameterized.expand([("negative", -1), ("float", 1.5), ("bool", True), ("text", "100")])
    def test_bad_values(self, _, value):
        with self.assertRaisesRegex(ValueError, "reserve must be None or a non-negative number of bytes"):
            SharedCacheStore(root=self.root, reserve=value)
        self.assertEqual(os.listdir(self.root), [])  # nothing was created
        self.assertEqual(self.new_store(reserve=np.int64(5)).reserve, 5)  # numpy's integers are integers

    def test_uncached(self):
        why = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with mock.patch("monai_sharedcache.persist.prepare", side_effect=why):  # no room to make it
            with self.assertWarnsRegex(RuntimeWarning, "cannot make or open the store"):
                store = _Narrow(os.path.join(self.root, "kept"), persistent=True)
        self.assertIsInstance(store, _Narrow)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once already
            self.assertEqual((store.get_or_compute("k", lambda: 3), store.put("k", 1)), (3, False))
        self.assertEqual(os.listdir(self.root), [])

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
