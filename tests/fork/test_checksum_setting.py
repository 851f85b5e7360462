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
"""``MONAI_CACHE_CHECKSUMS=0``: a persistent store on a disk that keeps checksums of its own writes and reads none."""

from __future__ import annotations

import os
import shutil
import unittest
from unittest import mock

import numpy as np

from monai.data import CacheDataset
from monai_sharedcache import SharedCacheStore, checksum
from tests.layer.test_checksum import LARGE, Count, _disk_with_attributes, _flip, _item_files


@unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
class TestChecksumsOff(unittest.TestCase):
    def setUp(self) -> None:
        base = _disk_with_attributes()
        if base is None:
            self.skipTest("needs a disk (not tmpfs) with user extended attributes for the temporary directory")
        self.addCleanup(shutil.rmtree, base, True)
        self.path, self.log = os.path.join(base, "cache"), os.path.join(base, "log")

    def run_once(self, compute: Count) -> list:
        store = SharedCacheStore(self.path, persistent=True)
        try:
            ds = CacheDataset([0, 1], compute, runtime_cache=store)
            return [np.array(ds[0]), np.array(ds[1])]
        finally:
            store.close()

    def test_off_writes_none_and_reads_unchecked(self):
        compute = Count(self.log)
        with mock.patch.dict(os.environ, {checksum.ENV: "0"}):
            self.run_once(compute)
            large = f"{self.path}/{_item_files(self.path)[1]}"
            with self.assertRaises(OSError):
                os.getxattr(large, checksum.SUM)  # written without one
            _flip(large)  # a damage that only a checksum would see
            with mock.patch.object(checksum, "digest", wraps=checksum.digest) as digest:
                items = self.run_once(compute)
            digest.assert_not_called()  # read unchecked: the file system's own checksums are trusted
            self.assertEqual(compute.calls, 2)
            self.assertFalse(np.array_equal(items[1], np.arange(LARGE, dtype=np.float32) + 1))
        items = self.run_once(compute)  # on again: an item without a checksum is a miss, computed anew
        self.assertEqual(compute.calls, 4)
        np.testing.assert_array_equal(items[1], np.arange(LARGE, dtype=np.float32) + 1)


if __name__ == "__main__":
    unittest.main()
