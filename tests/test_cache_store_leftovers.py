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
import pickle
import shutil
import signal
import tempfile
import time
import unittest
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai.data import _cache_locks as locks
from monai.data.cache_store import SharedCacheStore

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 120
LONG = 3600.0  # patched in as the minimum age, so that "young" cannot depend on how fast a loaded machine runs


def _create_and_wait(root, conn) -> None:
    store = SharedCacheStore(root=root)
    conn.send(store.path)  # a pipe, not a queue: a queue's lock may die with a killed child
    time.sleep(TIMEOUT)  # to be killed


def _join_and_wait(path, event, conn) -> None:
    store = SharedCacheStore(path)
    conn.send(True)
    event.wait(TIMEOUT) and store.close()


def _slow_writer(store: SharedCacheStore, conn) -> None:
    real = os.pwrite  # each write of the item is of a page, and tells the parent that the temporary file exists

    def slow(fd: int, data, at: int) -> int:
        if memoryview(data).nbytes <= 16:  # not the item: the store's count of bytes and items (the fork's layer)
            return real(fd, data, at)
        conn.send(1)
        time.sleep(0.01)
        return real(fd, memoryview(data)[:4096], at)

    os.pwrite = slow
    store.put("big", np.zeros(1 << 20, dtype=np.uint8))  # 256 slow writes: killed long before the end


def _backdate(path: str, seconds: float) -> None:
    os.utime(path, (time.time() - seconds,) * 2)


def _made(root: str) -> str:
    """A store directory as its creator makes it first: private, with the mark file that stores write, no lock file yet."""
    path = tempfile.mkdtemp(prefix=locks.PREFIX, dir=root)
    os.close(os.open(os.path.join(path, ".monai-cache"), os.O_WRONLY | os.O_CREAT, 0o600))
    return path


@needs_store
class TestLeftovers(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)
        self.ctx = multiprocessing.get_context()

    def new_store(self) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        return store

    def start(self, target, *args):
        """Start ``target(*args, sender)`` in a child process, killed at the end of the test; the child, a receiver."""
        receiver, sender = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=(*args, sender))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        return proc, receiver

    @parameterized.expand([("next_store",), ("cleanup_leftovers",)])
    def test_killed_creator_removed_at_once(self, how):
        proc, receiver = self.start(_create_and_wait, self.root)
        path = receiver.recv() if receiver.poll(TIMEOUT) else self.fail("no path from the creator")
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        self.assertTrue(os.path.isdir(path))
        with mock.patch.object(locks, "_MIN_AGE", LONG):  # its lock file tells that nobody uses it: no age needed
            if how == "cleanup_leftovers":
                self.assertEqual(locks.cleanup_leftovers(self.root), [path])
            left = [] if how == "cleanup_leftovers" else [os.path.basename(self.new_store().path)]
        self.assertEqual(os.listdir(self.root), left)

    def test_store_in_use_kept(self):
        store = self.new_store()
        reader = pickle.loads(pickle.dumps(store))  # what a DataLoader worker gets: it does not participate
        event = self.ctx.Event()
        proc, receiver = self.start(_join_and_wait, store.path, event)
        self.assertTrue(receiver.poll(TIMEOUT), "the child did not join")
        store.close()
        _backdate(store.path, 2 * locks._MIN_AGE)
        self.assertEqual(locks.cleanup_leftovers(self.root), [])
        self.new_store()
        self.assertEqual((reader.get_or_compute("k", lambda: 4), reader.get("k")), (4, 4))
        event.set()
        proc.join(TIMEOUT)
        self.assertEqual((proc.exitcode, os.path.exists(store.path)), (0, False))  # the last one removed it

    def test_temp_files_of_writers(self):
        store = self.new_store()
        tmp = os.path.join(store.path, ".tmp")
        proc, receiver = self.start(_slow_writer, store)
        self.assertTrue(receiver.poll(TIMEOUT), "the writer did not start")
        (name,) = os.listdir(tmp)
        with mock.patch.object(locks, "_MIN_AGE", 0.0):  # every temporary file is old enough
            self.assertTrue(store.put("a", 1))
        self.assertEqual(os.listdir(tmp), [name])  # locked by its live writer: never removed
        proc.kill()
        proc.join(TIMEOUT)
        with mock.patch.object(locks, "_MIN_AGE", LONG):
            self.assertTrue(store.put("b", 2))
            self.assertEqual(os.listdir(tmp), [name])  # its writer was killed, but young: another may be starting it
            _backdate(os.path.join(tmp, name), 2 * LONG)
            self.assertTrue(store.put("c", 3))
        self.assertEqual((os.listdir(tmp), store.get("big"), store.get("c")), ([], None, 3))


if __name__ == "__main__":
    unittest.main()
