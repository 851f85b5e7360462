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
PR 02's leftovers across PID namespaces (containers that share ``/dev/shm`` but not their processes): a store is kept
while a participant in any namespace lives, and removed at once when all of them are gone, however they ended.
Needs ``unshare --pid`` (root here).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import unittest
from typing import Any
from unittest import mock

import torch
from fork_utils import (
    TIMEOUT,
    end,
    participated,
    recv,
    skip_unless_linux,
    skip_unless_store,
    skip_unless_unshare,
    start_in_pid_namespace,
    stop,
)

from monai.data import SharedCacheStore
from monai_sharedcache import _locks as locks


def _child_create_and_wait(root: str, conn: Any) -> None:
    store = SharedCacheStore(root=root)
    store.put("x", torch.ones(3))
    conn.send(store.path)  # a pipe, not a queue: a queue's lock may die with a killed child
    time.sleep(TIMEOUT)  # to be killed


@skip_unless_store
@skip_unless_linux
@skip_unless_unshare
class TestPidNamespaces(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="test-store-namespaces-")
        self.addCleanup(shutil.rmtree, self.root, True)

    def test_participant_in_other_pid_namespace(self) -> None:
        """Processes of two PID namespaces share a store: it stays while either uses it and goes with the last."""
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        store.put("k", torch.arange(3))
        proc = start_in_pid_namespace(store.path)
        self.addCleanup(lambda: proc.poll() is None and stop(proc, kill=True))
        store.close()  # the creator leaves first
        self.assertTrue(os.path.isdir(store.path))  # the other namespace still uses it
        self.assertTrue(participated(store.path))
        self.assertEqual(locks.cleanup_leftovers(self.root), [])
        other = SharedCacheStore(store.path)  # one more from this namespace
        self.addCleanup(other.close)
        self.assertTrue(torch.equal(other.get("k"), torch.arange(3)))
        self.assertEqual(stop(proc), 0)
        self.assertTrue(os.path.isdir(store.path))  # this namespace still uses it
        other.close()
        self.assertFalse(os.path.exists(store.path))  # the last one removed it

    def test_all_participants_killed_across_pid_namespaces(self) -> None:
        """A store whose participants were all killed, one in another PID namespace, is removed by the next one."""
        ctx = multiprocessing.get_context()
        receiver, sender = ctx.Pipe(duplex=False)
        creator = ctx.Process(target=_child_create_and_wait, args=(self.root, sender))
        creator.start()
        self.addCleanup(end, creator)
        path = recv(receiver)
        other = start_in_pid_namespace(path)
        self.addCleanup(lambda: other.poll() is None and stop(other, kill=True))
        os.kill(creator.pid, signal.SIGKILL)  # type: ignore[arg-type]
        creator.join(TIMEOUT)
        self.assertTrue(os.path.isdir(path))
        self.assertEqual(locks.cleanup_leftovers(self.root), [])  # still in use in the other namespace
        stop(other, kill=True)
        self.assertTrue(os.path.isdir(path))
        with mock.patch.object(locks, "_MIN_AGE", 3600.0):  # no age wait: its lock file tells it all
            store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        self.assertEqual(os.listdir(self.root), [os.path.basename(store.path)])


if __name__ == "__main__":
    unittest.main()
