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
The tests of PR 02's store that do not fit its exported ``test_cache_store.py``: a removed directory, the arguments,
participants and worker copies, and a forked child that never removes the store.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import unittest
import warnings

from monai.data.cache_store import SharedCacheStore
from tests.test_cache_store import FORK, TIMEOUT, StoreTestCase, needs_fork, needs_store


@needs_store
class TestFaultsExtended(StoreTestCase):
    def test_directory_removed(self):
        store = self.new_store()
        store.put("k", 1)
        shutil.rmtree(store.path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(
                [store.get("k"), store.put("k", 2), store.get_or_compute("k", lambda: 3)], [None, False, 3]
            )
        self.assertEqual(len(caught), 1, [str(w.message) for w in caught])
        self.assertFalse(os.path.exists(store.path))  # never made again


@needs_store
class TestSecurityExtended(StoreTestCase):
    def test_arguments_and_new_directory(self):
        store = self.new_store()
        self.assertEqual((os.lstat(store.path).st_mode & 0o777, os.path.dirname(store.path)), (0o700, self.root))
        self.assertTrue(os.path.basename(store.path).startswith("monai-cache-"))
        with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
            SharedCacheStore(os.path.join(self.root, "nope"))
        with self.assertRaises(ValueError):
            SharedCacheStore(store.path, root=self.root)


@needs_store
class TestLifetimeExtended(StoreTestCase):
    def test_participants_and_worker_copies(self):
        first = self.new_store()
        second = SharedCacheStore(first.path)
        copy = pickle.loads(pickle.dumps(first))  # what a DataLoader worker gets: no participant
        first.close()
        first.close()
        self.assertEqual((first.get("k", "closed"), os.path.isdir(first.path)), ("closed", True))
        copy.put("k", 1)
        copy.close()
        self.assertEqual(second.get("k"), 1)
        del second  # the last one, collected
        gc.collect()
        self.assertFalse(os.path.exists(first.path))
        with self.assertWarnsRegex(RuntimeWarning, "gone"):
            late = pickle.loads(pickle.dumps(first))
        self.assertEqual((late.get("k"), late.put("k", 2), late.get_or_compute("k", lambda: 3)), (None, False, 3))

    @needs_fork
    def test_forked_child_never_removes(self):
        store = self.new_store()
        for how in ("close", "collect"):
            proc = FORK.Process(target=store.close if how == "close" else gc.collect)  # type: ignore[union-attr]
            proc.start()
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
            self.assertEqual(proc.exitcode, 0)
            self.assertTrue(os.path.isdir(store.path), how)


if __name__ == "__main__":
    unittest.main()
