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
import hashlib
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import unittest
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from parameterized import parameterized

from monai.data import MetaTensor
from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _locks as locks

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 120
LONG = 3600.0  # patched in as the minimum age, so that "young" cannot depend on how fast a loaded machine runs


def _meta() -> MetaTensor:
    mt = MetaTensor(torch.arange(24.0).reshape(2, 3, 4), affine=torch.diag(torch.tensor([1.5, 2.0, 2.5, 1.0])))
    mt.meta["filename_or_obj"] = "case_001.nii.gz"
    mt.push_applied_operation({"class": "Flip", "id": 1, "extra_info": {"axes": [0]}})
    return mt


CASES = [
    ("large_tensor", lambda: torch.arange(50_000, dtype=torch.float32).reshape(50, 1000)),
    ("metatensor", lambda: {"image": _meta(), "label": _meta() > 5, "name": "case_001"}),
    ("ndarray_fortran", lambda: np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))),
    ("ndarray_strided", lambda: np.arange(60.0).reshape(6, 10)[::2, 1::3]),
    ("ndarray_object", lambda: np.array([{"a": 1}, "x", None], dtype=object)),
    ("dtypes", lambda: [torch.ones(3, dtype=d) for d in (torch.bool, torch.float16, torch.complex64, torch.int8)]),
    ("empty_and_0d", lambda: [torch.zeros(0, 3), torch.tensor(3.25), np.zeros((0, 4)), np.array(2.5)]),
    ("transposed", lambda: torch.arange(12.0).reshape(3, 4).T),
    ("plain", lambda: {"s": "ünïcödé", "b": b"\x00", "n": None, "i": -(2**70), "f": 2.5, "t": (1, [2])}),
]


def _same(test: unittest.TestCase, a, b) -> None:
    test.assertIs(type(a), type(b))
    if isinstance(a, (torch.Tensor, np.ndarray)):
        test.assertEqual((a.dtype, a.shape, a.tolist()), (b.dtype, b.shape, b.tolist()))
        _same(test, getattr(a, "__dict__", None), getattr(b, "__dict__", None))  # MetaTensor: meta, operations
    elif isinstance(a, (dict, list, tuple)):
        test.assertEqual(len(a), len(b))
        for x, y in zip(a.values() if isinstance(a, dict) else a, b.values() if isinstance(b, dict) else b):
            _same(test, x, y)
    else:
        test.assertEqual(a, b)


class StoreTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)
        self.ctx = multiprocessing.get_context()

    def new_store(self, cls: type[SharedCacheStore] = SharedCacheStore, **kwargs) -> SharedCacheStore:
        store = cls(root=self.root, **kwargs)
        self.addCleanup(store.close)
        return store

    def files(self, store: SharedCacheStore, where: str = "") -> list[str]:
        return sorted(n for n in os.listdir(os.path.join(store.path, where)) if where or n.endswith(".item"))

    def refuse(self, store: SharedCacheStore, item=1) -> str:
        """Put an item that the store refuses; the one warning."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(store.put("refused", item))
        (message,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        return message

    def start(self, target, *args):
        """Start ``target(*args, sender)`` in a child process, killed at the end of the test; the child, a receiver."""
        receiver, sender = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=(*args, sender))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        return proc, receiver


@needs_store
class TestItems(StoreTestCase):
    @parameterized.expand(CASES)
    def test_round_trip(self, name, make):
        store = self.new_store(weights_only=name != "ndarray_object")  # objects are pickles of any type
        self.assertTrue(store.put("k", make()))
        _same(self, make(), store.get("k"))
        self.assertIsNot(store.get("k"), store.get("k"))  # a new object graph at every read

    def test_reads_are_private_copy_on_write_views(self):
        store = self.new_store()
        store.put("k", {"t": torch.arange(1e5), "a": np.arange(5e4), "g": torch.ones(3, requires_grad=True)})
        digest = hashlib.sha256(Path(store.path, "k.item").read_bytes()).hexdigest()
        first, second = store.get("k"), store.get("k")
        self.assertEqual(first["t"].data_ptr() % 64, 0)
        self.assertNotEqual(first["t"].data_ptr(), second["t"].data_ptr())
        first["t"] += 1  # private to this reader
        first["a"][:] = -1
        self.assertEqual((second["t"][:2].tolist(), second["a"][:2].tolist()), ([0.0, 1.0], [0.0, 1.0]))
        self.assertEqual(hashlib.sha256(Path(store.path, "k.item").read_bytes()).hexdigest(), digest)
        self.assertFalse(store.get("k")["g"].requires_grad)  # stored detached

    def test_keys_and_refused_items(self):
        store = self.new_store()
        with self.assertWarnsRegex(RuntimeWarning, "cannot store some items .*CPU tensors.*runtime_cache=False"):
            self.assertFalse(store.put("k", {"img": torch.empty(3, device="meta")}))  # a stand-in for CUDA
            self.assertFalse(store.put("k", {"f": lambda x: x}))  # pickle cannot store it: a warning of its own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(store.put("k", {"f": lambda x: x}))  # warned once per store (and type refused)
        self.assertEqual((self.files(store), self.files(store, ".tmp")), ([], []))  # nothing left
        fn = lambda x: x  # noqa: E731
        self.assertEqual((caught, store.get_or_compute("k", lambda: {"f": fn})["f"], store.get("k")), ([], fn, None))
        store.put("a", 1)
        shutil.copy(os.path.join(store.path, "a.item"), os.path.join(store.path, "b.item"))
        self.assertEqual((store.get("b", "miss"), store.get("a")), ("miss", 1))  # the file of another key is a miss
        store.put("a/b c.nii", 2)  # a key that is no file name is stored under its digest
        self.assertIn(hashlib.sha256(b"a/b c.nii").hexdigest() + ".item", self.files(store))

    @parameterized.expand(
        [("garbage", lambda d: b"junk"), ("truncated", lambda d: d[:-7]), ("version", lambda d: d[:8] + b"c" + d[9:])]
    )
    def test_malformed_file_is_a_miss_and_removed(self, _, damage):
        store = self.new_store()
        store.put("k", {"x": "y" * 100})
        path = Path(store.path, "k.item")
        path.write_bytes(damage(path.read_bytes()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertEqual(store.get_or_compute("k", lambda: 1), 1)
        self.assertEqual(store.get("k"), 1)


@needs_store
class TestFaults(StoreTestCase):
    def test_full_file_system(self):
        store = self.new_store()
        store.put("old", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mock.patch.object(os, "pwrite", side_effect=OSError(errno.ENOSPC, "No space left on device")):
                self.assertEqual(store.get_or_compute("k", lambda: 2), 2)
                self.assertFalse(store.put("k2", 3))
            self.assertFalse(store.put("k3", 3))  # stops writing
        self.assertEqual([str(w.message).count("No space left") for w in caught], [1])  # one warning
        self.assertEqual((self.files(store), self.files(store, ".tmp"), store.get("old")), (["old.item"], [], 1))

    def test_reserve(self):
        full = self.new_store(reserve=2**62)  # more than any file system has free: nothing is stored
        message = self.refuse(full, np.ones(10))
        for part in ("(reserve)", "--shm-size", "--ipc=host", "MONAI_CACHE_ROOT"):
            self.assertIn(part, message)
        self.assertEqual((full.get_or_compute("k", lambda: 3), self.files(full), full.get("k")), (3, [], None))
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


@needs_store
class TestSecurity(StoreTestCase):
    @parameterized.expand(
        [("mode", "0o755, open to other users.*unpickled"), ("link", "symbolic link.*unpickled"), ("uid", "uid")]
        + [("unmarked", "not a directory that a store made.*unpickled")]  # a directory of the user's, by mistake
        + [("file", "is a file, not a store")]
    )
    def test_refuses(self, kind, message):
        path = os.path.join(self.root, "d")
        if kind == "link":
            os.symlink(self.new_store().path, path)
        elif kind == "file":
            open(path, "w").close()
        else:
            os.mkdir(path, 0o755 if kind == "mode" else 0o700)
            for name in (".lock", "notes.txt", "a.item"):  # joined, its close() would remove them
                open(os.path.join(path, name), "w").close()
        with mock.patch.object(os, "getuid", return_value=os.getuid() + (kind == "uid")):
            with self.assertRaisesRegex(NotADirectoryError if kind == "file" else PermissionError, message):
                SharedCacheStore(path)
        if kind not in ("link", "file"):
            self.assertEqual(sorted(os.listdir(path)), [".lock", "a.item", "notes.txt"])  # nothing removed

    def test_renamed_and_replaced_directory(self):
        store = self.new_store()
        store.put("k", "mine")
        moved = store.path + "-moved"
        os.rename(store.path, moved)
        os.mkdir(store.path, 0o700)  # a directory of the same name, without the store's items
        Path(store.path, "k.item").write_bytes(b"not an item")
        self.assertEqual(store.get("k"), "mine")  # read from the store's own directory, wherever it is now
        with self.assertRaisesRegex(PermissionError, "refusing .*not a directory that a store made"):
            pickle.loads(pickle.dumps(store))  # what a spawned DataLoader worker gets: it opens the path anew
        Path(store.path, ".monai-cache").touch()  # even with the mark, it is not the same directory
        with self.assertRaisesRegex(PermissionError, "no longer the directory of the store that was pickled"):
            pickle.loads(pickle.dumps(store))
        store.close()  # the last user removes what it made, through its descriptor: never the replacement's files
        self.assertEqual((os.listdir(moved), sorted(os.listdir(store.path))), ([], [".monai-cache", "k.item"]))
        os.rmdir(moved)


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
        if memoryview(data).nbytes < 64:  # not the item (its header is 64 bytes at least): the count of its bytes
            return real(fd, data, at)
        conn.send(1)
        time.sleep(0.01)
        return real(fd, memoryview(data)[:4096], at)

    os.pwrite = slow
    store.put("big", np.zeros(1 << 20, dtype=np.uint8))  # 256 slow writes: killed long before the end


def _backdate(path: str, seconds: float) -> None:
    os.utime(path, (time.time() - seconds,) * 2)


@needs_store
class TestLeftovers(StoreTestCase):
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
        self.assertTrue(store.put("a", 1))
        self.assertEqual(os.listdir(tmp), [name])  # locked by its live writer: never removed
        proc.kill()
        proc.join(TIMEOUT)
        self.assertTrue(store.put("b", 2))  # unlocked: its writer is dead, whatever the file's age
        self.assertEqual((os.listdir(tmp), store.get("big"), store.get("b")), ([], None, 2))


if __name__ == "__main__":
    unittest.main()
