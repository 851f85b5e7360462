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
import os
import pickle
import shutil
import tempfile
import unittest
import warnings
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai.data import _cache_locks as locks
from monai.data.cache_store import SharedCacheStore

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")


class _Narrow(SharedCacheStore):
    """A store whose room is a 64 MiB file system with 40 MiB free: what a subclass (a memory limit) may report."""

    def free_space(self) -> tuple[int, int] | None:
        return 40 * 2**20, 64 * 2**20


@needs_store
class TestReserve(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self, cls: type[SharedCacheStore] = SharedCacheStore, **kwargs) -> SharedCacheStore:
        store = cls(root=self.root, **kwargs)
        self.addCleanup(store.close)
        return store

    def refuse(self, store: SharedCacheStore, item=1) -> str:
        """Put an item that the reserve refuses; the one warning."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(store.put("refused", item))
        (message,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        return message

    def items(self, store: SharedCacheStore) -> list[str]:
        return [n for n in os.listdir(store.path) if n.endswith(".item")]

    def test_reserve(self):
        full = self.new_store(reserve=2**62)  # more than any file system has free: nothing is stored
        message = self.refuse(full, np.ones(10))
        for part in ("(reserve)", "--shm-size", "--ipc=host", "MONAI_CACHE_ROOT"):
            self.assertIn(part, message)
        self.assertEqual((full.get_or_compute("k", lambda: 3), self.items(full), full.get("k")), (3, [], None))
        self.assertTrue(self.new_store(reserve=0).put("k", np.ones(10)))

    @parameterized.expand([("full", errno.ENOSPC, locks, "create"), ("read_only", errno.EROFS, tempfile, "mkdtemp")])
    def test_no_room_to_make_a_store(self, _, code, where, what):
        with mock.patch.object(where, what, side_effect=OSError(code, os.strerror(code))):
            with self.assertWarnsRegex(RuntimeWarning, "cannot make a store.*MONAI_CACHE_ROOT"):
                store = self.new_store()  # the job goes on, without the cache
        self.assertEqual((store.get_or_compute("k", lambda: 3), store.put("k", 1), store.get("k")), (3, False, None))
        self.assertEqual(os.listdir(self.root), [])  # nothing left behind
        copy = pickle.loads(pickle.dumps(store))  # stays without a cache, and never opens a path
        self.assertEqual((copy.put("k", 1), copy.get("k")), (False, None))


if __name__ == "__main__":
    unittest.main()
