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
"""The checksums of a persistent store's items on a disk (``monai_sharedcache.checksum``)."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import tempfile
import unittest
import warnings
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai.transforms import Transform
from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _memory as memory
from monai_sharedcache import checksum
from tests.layer.layer_utils import keyed_dataset

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
SMALL, LARGE = 1_000, 3_000_000  # float32 elements: read into a buffer, and mapped (pooled where the fast path is on)


def _disk_with_attributes() -> str | None:
    """A new directory on a disk whose files take user extended attributes, or ``None``."""
    base = tempfile.mkdtemp()
    probe = os.path.join(base, "probe")
    try:
        if memory.fs_type(base) in memory.MEMORY_FS:
            raise OSError(errno.ENOTSUP, "tmpfs")
        with open(probe, "wb") as f:
            os.setxattr(f.fileno(), "user.probe", b"1")
        os.unlink(probe)
        return base
    except (OSError, AttributeError):
        shutil.rmtree(base, True)
        return None


def _item_files(path: str) -> list[str]:
    return sorted((n for n in os.listdir(path) if n.endswith(".item")), key=lambda n: os.path.getsize(f"{path}/{n}"))


def _flip(path: str, from_end: int = 100) -> None:
    """Flip one bit of an item's array bytes in place, as a failing disk would."""
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))


class Count(Transform):
    """Logs each computation to the file ``log`` (its state must not change: it is part of the items' keys)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, i: int) -> np.ndarray:
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return np.arange(SMALL if i == 0 else LARGE, dtype=np.float32) + i

    @property
    def calls(self) -> int:
        try:
            with open(self.log) as f:
                return len(f.readlines())
        except FileNotFoundError:
            return 0


@needs_store
class TestChecksums(unittest.TestCase):
    def setUp(self) -> None:
        base = _disk_with_attributes()
        if base is None:
            self.skipTest("needs a disk (not tmpfs) with user extended attributes for the temporary directory")
        self.addCleanup(shutil.rmtree, base, True)
        self.path = os.path.join(base, "cache")
        self.log = os.path.join(base, "log")

    def run_once(self, compute: Count) -> tuple[list[np.ndarray], list[str]]:
        """A run: a new store object on the path, a dataset of 2 items (small and large), each read; its warnings."""
        store = SharedCacheStore(self.path, persistent=True)
        self.addCleanup(store.close)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = keyed_dataset([0, 1], compute, store)
            items = [ds[0], ds[1]]
        store.close()
        return items, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    @parameterized.expand([("small", 0), ("large", 1)])
    def test_damaged_bytes_are_a_miss(self, _, which):
        compute = Count(self.log)
        self.run_once(compute)
        files = _item_files(self.path)
        self.assertEqual(len(files), 2)
        for name in files:
            self.assertTrue(os.getxattr(f"{self.path}/{name}", checksum.SUM).startswith((b"xxh3:", b"crc32:")))
        damaged = f"{self.path}/{files[which]}"
        _flip(damaged)
        items, warned = self.run_once(compute)
        np.testing.assert_array_equal(items[which], np.arange(SMALL if which == 0 else LARGE, dtype=np.float32) + which)
        self.assertEqual(compute.calls, 3)  # the damaged one computed anew, the other read
        (message,) = [w for w in warned if "not those written" in w]
        self.assertIn(self.path, message)
        with open(damaged, "rb") as f:  # removed, then written anew (maybe with the same inode number)
            algorithm, _, value = os.getxattr(damaged, checksum.SUM).partition(b":")
            self.assertEqual(checksum.digest(algorithm, f.read()), value)
        self.assertEqual(len(_item_files(self.path)), 2)
        gc.collect()  # the damaged read's view, in a reference cycle of its exception, pins the removed file
        store = SharedCacheStore(self.path, persistent=True)  # a new run frees what no mapping pins any more
        self.addCleanup(store.close)
        nbytes = sum(os.path.getsize(f"{self.path}/{name}") for name in _item_files(self.path))
        self.assertEqual((store.stats()["filled"], store.stats()["nbytes"]), (2, nbytes))  # the damaged one counted out
        store.close()
        self.assertEqual(self.run_once(compute)[1], [])  # the new copy is whole
        self.assertEqual(compute.calls, 3)

    def test_missing_checksum_is_a_miss(self):
        compute = Count(self.log)
        self.run_once(compute)
        os.removexattr(f"{self.path}/{_item_files(self.path)[1]}", checksum.SUM)  # not written whole by this store
        self.run_once(compute)
        self.assertEqual(compute.calls, 3)

    def test_checked_once_per_run(self):
        compute = Count(self.log)
        self.run_once(compute)
        with mock.patch.object(checksum, "digest", wraps=checksum.digest) as digest:
            self.run_once(compute)  # this run wrote nothing: both items read whole once
            self.assertEqual(digest.call_count, 2)
            first = SharedCacheStore(self.path, persistent=True)  # the run goes on: another process joins
            self.addCleanup(first.close)
            other = SharedCacheStore(self.path)
            self.addCleanup(other.close)
            for store in (first, other):
                ds = keyed_dataset([0, 1], compute, store)
                for _ in range(3):
                    np.testing.assert_array_equal(ds[1], np.arange(LARGE, dtype=np.float32) + 1)
            self.assertEqual(digest.call_count, 3)  # the new run's first read only; the joined store trusts it
        self.assertEqual(compute.calls, 2)

    def test_items_written_in_the_run_are_not_read_again(self):
        compute = Count(self.log)
        store = SharedCacheStore(self.path, persistent=True)
        self.addCleanup(store.close)
        ds = keyed_dataset([0, 1], compute, store)
        with mock.patch.object(checksum, "digest", wraps=checksum.digest) as digest:
            for _ in range(2):  # computed and written, then read
                self.assertEqual([ds[0][1], ds[1][1]], [1.0, 2.0])
        self.assertEqual((digest.call_count, compute.calls), (2, 2))  # at the writes only

    def test_without_xxhash(self):
        compute = Count(self.log)
        with mock.patch.object(checksum, "xxhash", None):
            self.run_once(compute)  # written with CRC-32
            files = _item_files(self.path)
            self.assertTrue(os.getxattr(f"{self.path}/{files[1]}", checksum.SUM).startswith(b"crc32:"))
            _flip(f"{self.path}/{files[1]}")
            self.assertEqual(self.run_once(compute)[0][1][5], 6.0)
        self.assertEqual(compute.calls, 3)

    @parameterized.expand([("file_system", True), ("platform", False)])
    def test_without_attributes(self, _, has_calls):
        """A file system without user extended attributes, or a platform without the calls (macOS)."""

        def unsupported(*args):
            raise OSError(errno.ENOTSUP, "not supported")

        compute = Count(self.log)
        patches = (
            (mock.patch.object(os, "setxattr", unsupported), mock.patch.object(os, "getxattr", unsupported))
            if has_calls
            else (mock.patch.object(checksum, "_ATTRIBUTES", False), mock.patch.object(os, "getxattr", unsupported))
        )
        with patches[0], patches[1]:
            warned = self.run_once(compute)[1]
            self.assertEqual(len([w for w in warned if "checksums" in w]), 1)  # once, and the items are kept
            self.assertEqual(len(_item_files(self.path)), 2)
            self.assertEqual(self.run_once(compute)[1], [])  # read unchecked
        self.assertEqual(compute.calls, 2)

    def test_store_in_memory_pays_nothing(self):
        store = SharedCacheStore(tempfile.mkdtemp(dir="/dev/shm") + "/cache", persistent=True)
        self.addCleanup(shutil.rmtree, os.path.dirname(store.path), True)
        self.addCleanup(store.close)
        with mock.patch.object(checksum, "digest") as digest:
            store.put("a", np.ones(LARGE, dtype=np.float32))
            self.assertEqual(store.get("a").sum(), LARGE)
        digest.assert_not_called()
        self.assertEqual(os.listxattr(f"{store.path}/{_item_files(store.path)[0]}"), [])


if __name__ == "__main__":
    unittest.main()
