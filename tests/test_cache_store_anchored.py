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

import os
import pickle
import shutil
import tempfile
import threading
import unittest
import warnings

from parameterized import parameterized

from monai.data import SharedCacheStore

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 60


def _tree(path: str) -> dict[str, bytes | None]:
    """Every entry under ``path`` (not following links), with the content of its regular files."""
    found: dict[str, bytes | None] = {}
    for where, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(where, name)
            regular = os.path.isfile(full) and not os.path.islink(full)
            found[os.path.relpath(full, path)] = open(full, "rb").read() if regular else None
    return found


@needs_store
class TestAnchoredStore(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        return store

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
        before = _tree(other.path)
        got: list = []
        reader = threading.Thread(target=lambda: got.append(store.get("k", "miss")), daemon=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader.start()
            reader.join(TIMEOUT)  # a FIFO opened without O_NONBLOCK would block here forever
        self.assertEqual(got, ["miss"])
        self.assertTrue(any("not an item the store wrote" in str(w.message) for w in caught))
        self.assertEqual(_tree(other.path), before)  # the target is untouched
        self.assertEqual(store.get_or_compute("k", lambda: "mine"), "mine")  # replaces the planted entry only
        self.assertEqual((store.get("k"), other.get("k")), ("mine", "planted"))

    def test_persistent_store_opens_without_a_look_at_its_items(self):
        path = os.path.join(self.root, "kept")
        store = SharedCacheStore(path, persistent=True)
        self.assertTrue(store.put("a", 1) and store.put("b", 2))
        store.close()
        writable, linked = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".item"))
        log = os.path.join(self.root, "log")
        with open(log, "w") as f:
            f.write("mine")
        os.chmod(writable, 0o666)
        os.unlink(linked)
        os.symlink(log, linked)
        again = SharedCacheStore(path, persistent=True)  # each item is checked when it is read, none at open
        self.addCleanup(again.close)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not an item the store wrote"
            self.assertEqual((again.get("a"), again.get("b")), (None, None))  # never unpickled
        self.assertEqual((again.get_or_compute("a", lambda: 3), again.get_or_compute("b", lambda: 4)), (3, 4))
        with open(log) as f:
            self.assertEqual(f.read(), "mine")  # the link was replaced, not followed
        self.assertFalse(os.path.islink(linked))  # a file of the store's own now

    def test_directory_it_did_not_make_is_refused_and_kept(self):
        mine = os.path.join(self.root, "mine")
        os.makedirs(os.path.join(mine, "sub"), 0o700)
        os.chmod(mine, 0o700)
        for name in (".lock", "notes.txt", "a.item", os.path.join("sub", "x")):
            with open(os.path.join(mine, name), "w") as f:
                f.write(name)
        before = _tree(mine)
        with self.assertRaisesRegex(PermissionError, "not a directory that a store made"):
            SharedCacheStore(mine)
        leftover = os.path.join(self.root, "monai-cache-mine")  # named like a store, made by the user
        shutil.copytree(mine, leftover)
        os.chmod(leftover, 0o700)
        os.utime(leftover, (1, 1))  # as old as a leftover of a crashed run
        self.new_store()  # cleans the leftovers of this root
        self.assertEqual((_tree(mine), _tree(leftover)), (before, before))

    def test_persistent_path_with_dot_entries_is_refused_and_kept(self):
        path = os.path.join(self.root, "data")
        for sub in (".tmp", ".counters"):
            os.makedirs(os.path.join(path, sub), 0o700)
            with open(os.path.join(path, sub, "0"), "w") as f:
                f.write(sub)
        for name in (".node-1", ".persistent", "x.item"):
            with open(os.path.join(path, name), "w") as f:
                f.write(name)
        os.chmod(path, 0o700)
        before = _tree(path)
        with self.assertRaisesRegex(ValueError, "not empty and holds no persistent store"):
            SharedCacheStore(path, persistent=True)
        self.assertEqual(_tree(path), before)
        os.makedirs(os.path.join(self.root, "new", "a"))
        old = os.umask(0o022)  # directories would be 0o755
        try:
            store = SharedCacheStore(os.path.join(self.root, "new", "a", "b", "c"), persistent=True)
        finally:
            os.umask(old)
        self.addCleanup(store.close)
        modes = [os.stat(os.path.join(self.root, "new", "a", *p)).st_mode & 0o777 for p in (("b",), ("b", "c"))]
        self.assertEqual(modes, [0o700, 0o700])  # the parents it made too

    def test_renamed_and_replaced_directory(self):
        store = self.new_store()
        store.put("k", "mine")
        moved = store.path + "-moved"
        os.rename(store.path, moved)
        os.mkdir(store.path, 0o700)  # a directory of the same name, without the store's items
        with open(os.path.join(store.path, "k.item"), "wb") as f:
            f.write(b"not an item")
        self.assertEqual(store.get("k"), "mine")  # read from the store's own directory, wherever it is now
        with self.assertRaisesRegex(PermissionError, "refusing .*not a directory that a store made"):
            pickle.loads(pickle.dumps(store))  # what a spawned DataLoader worker gets: it opens the path anew
        with open(os.path.join(store.path, ".monai-cache"), "w"):  # even with the mark, it is not the same directory
            pass
        with self.assertRaisesRegex(PermissionError, "no longer the directory of the store that was pickled"):
            pickle.loads(pickle.dumps(store))
        with open(os.path.join(store.path, "k.item"), "rb") as f:
            self.assertEqual(f.read(), b"not an item")
        shutil.rmtree(store.path)
        os.rename(moved, store.path)


if __name__ == "__main__":
    unittest.main()
