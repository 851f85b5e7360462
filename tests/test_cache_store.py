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
import threading
import time
import unittest
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from parameterized import parameterized

from monai.data import MetaTensor
from monai.data.cache_store import SharedCacheStore

FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
needs_fork = unittest.skipIf(FORK is None, "needs the fork start method")
TIMEOUT = 120


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

    def new_store(self) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        return store

    def files(self, store: SharedCacheStore, where: str = "") -> list[str]:
        return sorted(n for n in os.listdir(os.path.join(store.path, where)) if where or n.endswith(".item"))


@needs_store
class TestItems(StoreTestCase):
    @parameterized.expand(CASES)
    def test_round_trip(self, _, make):
        store = self.new_store()
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(store.put("k", {"f": lambda x: x}))  # pickle cannot store it: warned once per store
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


@needs_store
class TestSecurity(StoreTestCase):
    @parameterized.expand(
        [("mode", "0o755, open to other users"), ("link", "symbolic link"), ("file", "not a directory"), ("uid", "uid")]
        + [("unmarked", "not a directory that a store made")]  # a directory of the user's, given by mistake
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
            with self.assertRaisesRegex(PermissionError, message + ".*unpickled"):
                SharedCacheStore(path)
        if kind not in ("link", "file"):
            self.assertEqual(sorted(os.listdir(path)), [".lock", "a.item", "notes.txt"])  # nothing removed

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


def _slow_writer(store: SharedCacheStore) -> None:
    real_write = os.pwrite

    def slow_write(fd, data, offset):
        time.sleep(0.01)
        return real_write(fd, memoryview(data)[:4096], offset)

    os.pwrite = slow_write  # type: ignore[assignment]
    store.put("big", np.zeros(1 << 20, dtype=np.uint8))  # 256 slow writes: killed long before the end


@needs_store
class TestLifetime(StoreTestCase):
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


if __name__ == "__main__":
    unittest.main()
