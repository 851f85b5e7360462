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
planted links and FIFOs, participants and worker copies, a forked child that never removes the store, and a killed
writer.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import shutil
import signal
import threading
import time
import unittest
import warnings
from pathlib import Path

import numpy as np
from parameterized import parameterized

from monai_sharedcache import SharedCacheStore
from tests.layer.test_cache_store import TIMEOUT, StoreTestCase, needs_store

FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
needs_fork = unittest.skipIf(FORK is None, "needs the fork start method")


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
    @parameterized.expand([("symlink",), ("hardlink",), ("fifo",)])
    def test_planted_item_file_is_a_miss(self, kind):
        store, other = self.new_store(), self.new_store()
        other.put("k", "planted")
        planted = os.path.join(store.path, "k.item")
        if kind == "symlink":
            os.symlink(os.path.join(other.path, "k.item"), planted)
        elif kind == "hardlink":
            os.link(os.path.join(other.path, "k.item"), planted)
        else:
            os.mkfifo(planted, 0o600)
        before = Path(other.path, "k.item").read_bytes()
        got: list = []
        reader = threading.Thread(target=lambda: got.append(store.get("k", "miss")), daemon=True)
        with self.assertWarnsRegex(RuntimeWarning, "not an item the store wrote"):
            reader.start()
            reader.join(TIMEOUT)  # a FIFO opened without O_NONBLOCK would block here forever
        self.assertEqual(got, ["miss"])
        self.assertEqual(Path(other.path, "k.item").read_bytes(), before)  # the target is untouched
        self.assertEqual(store.get_or_compute("k", lambda: "mine"), "mine")  # replaces the planted entry only
        self.assertEqual((store.get("k"), other.get("k")), ("mine", "planted"))

    def test_arguments_and_new_directory(self):
        store = self.new_store()
        self.assertEqual((os.lstat(store.path).st_mode & 0o777, os.path.dirname(store.path)), (0o700, self.root))
        self.assertTrue(os.path.basename(store.path).startswith("monai-cache-"))
        with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
            SharedCacheStore(os.path.join(self.root, "nope"))
        with self.assertRaises(ValueError):
            SharedCacheStore(store.path, root=self.root)


def _slow_writer(store: SharedCacheStore) -> None:
    real_write = os.pwrite

    def slow_write(fd, data, offset):
        time.sleep(0.01)
        return real_write(fd, memoryview(data)[:4096], offset)

    os.pwrite = slow_write  # type: ignore[assignment]
    store.put("big", np.zeros(1 << 20, dtype=np.uint8))  # 256 slow writes: killed long before the end


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
    def test_killed_writer_leaves_no_item(self):
        store = self.new_store()
        writer = FORK.Process(target=_slow_writer, args=(store,))  # type: ignore[union-attr]
        writer.start()
        deadline = time.monotonic() + TIMEOUT
        while not any(os.path.getsize(os.path.join(store.path, ".tmp", n)) for n in self.files(store, ".tmp")):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
        writer.join(TIMEOUT)
        self.assertEqual((self.files(store), store.get("big")), ([], None))  # no partial item
        self.assertTrue(store.put("big", 1))
        self.assertEqual(store.get("big"), 1)

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
