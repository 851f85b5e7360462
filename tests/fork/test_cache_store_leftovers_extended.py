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
The tests of PR 02's cleaners of leftovers that do not fit its exported ``test_cache_store_leftovers.py``: a directory
without a lock file, one named so without the mark, a kept store, and a root on a network file system.
"""

from __future__ import annotations

import errno
import os
import tempfile
import unittest
from unittest import mock

from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _locks as locks
from tests.layer.test_cache_store import LONG, StoreTestCase, _backdate, needs_store


def _made(root: str) -> str:
    """A store directory as its creator makes it first: private, with the mark file that stores write, no lock file yet."""
    path = tempfile.mkdtemp(prefix=locks.PREFIX, dir=root)
    os.close(os.open(os.path.join(path, ".monai-cache"), os.O_WRONLY | os.O_CREAT, 0o600))
    return path


@needs_store
class TestLeftoversExtended(StoreTestCase):
    def test_directory_without_lock_file(self):
        creating = _made(self.root)  # its creator may be making it, or died
        os.mkdir(os.path.join(self.root, "not-a-store"))
        _backdate(os.path.join(self.root, "not-a-store"), 2 * LONG)
        with mock.patch.object(locks, "_MIN_AGE", LONG):
            self.assertEqual(locks.cleanup_leftovers(self.root), [])  # young: kept
            _backdate(creating, 2 * LONG)
            self.assertEqual(locks.cleanup_leftovers(self.root), [creating])
        creating = _made(self.root)
        _backdate(creating, 60)  # a minute is old enough with the real minimum age
        self.assertEqual(locks.cleanup_leftovers(self.root), [creating])
        self.assertEqual(os.listdir(self.root), ["not-a-store"])  # only stores are removed

    def test_a_store_whose_creator_is_stopped(self):
        """A store whose creator holds ``.lock-new`` (stopped before it renamed it, a frozen container) is kept."""
        import fcntl

        creating = _made(self.root)
        fd = os.open(os.path.join(creating, ".lock-new"), os.O_RDWR | os.O_CREAT, 0o600)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _backdate(creating, 60)
        self.assertEqual(locks.cleanup_leftovers(self.root), [])
        fcntl.flock(fd, fcntl.LOCK_UN)  # it died
        self.assertEqual(locks.cleanup_leftovers(self.root), [creating])

    def test_a_shortage_of_descriptors_is_no_refusal(self):
        """Only a link or a file where a directory is expected is refused as a security matter; else the error."""
        store = self.new_store()
        with mock.patch("os.open", side_effect=OSError(errno.EMFILE, "Too many open files")):
            with self.assertRaises(OSError) as caught:
                locks.Dir(store.path, mark=True)
        self.assertEqual(caught.exception.errno, errno.EMFILE)

    def test_what_cannot_be_removed_stays_marked(self):
        """A store that its last user cannot empty (here: a directory open to others in it) keeps its mark for the
        next cleaner, which removes it once it can."""
        store = SharedCacheStore(root=self.root)
        os.mkdir(os.path.join(store.path, "shared"), 0o755)
        os.chmod(os.path.join(store.path, "shared"), 0o755)
        store.close()
        self.assertEqual(sorted(os.listdir(store.path)), [".monai-cache", "shared"])
        os.rmdir(os.path.join(store.path, "shared"))
        _backdate(store.path, 60)
        self.assertEqual(locks.cleanup_leftovers(self.root), [store.path])

    def test_directory_named_so_without_the_mark_kept(self):
        mine = os.path.join(self.root, locks.PREFIX + "mine")  # named like a store, made by the user
        os.mkdir(mine, 0o700)
        for name in (".lock", "a.item", "notes.txt"):
            with open(os.path.join(mine, name), "w") as f:
                f.write(name)
        _backdate(mine, 60)  # as old as a crashed run's store
        self.new_store()  # cleans the leftovers of this root
        self.assertEqual(sorted(os.listdir(mine)), [".lock", "a.item", "notes.txt"])

    def test_a_kept_store_is_never_removed(self):
        """A store that ``mark_kept`` made (for a subclass that keeps items across runs): no last user removes it."""
        kept = os.path.join(self.root, locks.PREFIX + "kept")  # named as a store, and as old as a crashed run's
        os.mkdir(kept, 0o700)
        os.close(os.open(os.path.join(kept, ".lock"), os.O_CREAT | os.O_WRONLY, 0o600))  # as an interrupted call left
        locks.mark_kept(locks.Dir(kept))
        locks.mark_kept(locks.Dir(kept))  # a store kept already: nothing to do
        store = SharedCacheStore(kept)
        self.assertTrue(store.put("a", 1))
        with mock.patch.object(locks, "try_hold", wraps=locks.try_hold) as try_hold:
            store.close()  # its last user: never takes the lock exclusively, so a process that joins is never refused
        self.assertEqual(try_hold.call_count, 0)
        _backdate(kept, 60)
        self.new_store()  # cleans the leftovers of this root
        self.assertEqual(SharedCacheStore(kept).get("a"), 1)
        mine = os.path.join(self.root, "mine")
        os.mkdir(mine, 0o700)
        open(os.path.join(mine, "notes.txt"), "w").close()
        with self.assertRaisesRegex(ValueError, "holds \\['notes.txt'\\] and no store kept"):
            locks.mark_kept(locks.Dir(mine))
        self.assertEqual(os.listdir(mine), ["notes.txt"])  # nothing made in it

    def test_not_on_a_network_file_system(self):
        leftover = _made(self.root)
        _backdate(leftover, 60)  # a crashed run's store: removed, on a node-local file system
        fake = os.path.join(self.root, "mountinfo")
        with open(fake, "w") as f:
            f.write("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
            f.write(f"36 22 0:40 / {os.path.realpath(self.root)} rw - nfs4 server:/export rw\n")
        with mock.patch.object(locks, "_MOUNTINFO", fake):
            self.assertEqual(locks.fs_type(os.path.join(self.root, "x")), "nfs4")
            with self.assertWarnsRegex(RuntimeWarning, "network file system \\(nfs4\\).*not removed"):
                self.assertEqual(locks.cleanup_leftovers(self.root), [])  # its lock may be another node's
            self.assertTrue(os.path.isdir(leftover))
            self.assertEqual(locks.fs_type("/elsewhere"), "ext4")
        self.assertEqual(locks.cleanup_leftovers(self.root), [leftover])


if __name__ == "__main__":
    unittest.main()
