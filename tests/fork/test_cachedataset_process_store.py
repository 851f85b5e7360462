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

import gc
import multiprocessing
import os
import shutil
import tempfile
import threading
import unittest
from unittest import mock

import torch
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader, SharedCacheStore
from monai.transforms import Compose, Lambda, RandomizableTransform, Transform

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 120


class Load(Transform):
    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return {"src": i, "img": torch.full((12,), float(i))}


class AddOne(RandomizableTransform):
    def __call__(self, d):
        d["img"] += 1  # in place: an item shared with the cache would come back with 2, then 3
        return d


class Box:
    """An item of the user's own type, which a ListProxy held too."""

    def __init__(self, d: dict) -> None:
        self.d = d

    def __repr__(self) -> str:
        return f"Box({self.d})"


class TestProcessStore(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.root, self.log = os.path.join(self.tmp, "shm"), os.path.join(self.tmp, "log")
        os.mkdir(self.root, 0o700)
        patcher = mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": self.root})
        patcher.start()
        self.addCleanup(patcher.stop)

    def computed(self) -> list[int]:
        with open(self.log) as f:
            return sorted(int(x) for x in f.read().split())

    @parameterized.expand([(ctx,) for ctx in multiprocessing.get_all_start_methods()])
    @needs_store
    def test_workers_share_the_dataset_store(self, ctx):
        ds = CacheDataset(list(range(8)), Compose([Load(self.log), AddOne()]), runtime_cache="process", copy_cache=True)
        (path,) = [os.path.join(self.root, name) for name in os.listdir(self.root)]
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx, timeout=TIMEOUT)
        for _ in range(2):
            batches = list(loader)
            self.assertEqual(torch.cat([b["src"] for b in batches]).tolist(), list(range(8)))
            for b in batches:
                self.assertTrue(torch.equal(b["img"], b["src"].float().view(-1, 1).expand(-1, 12) + 1))
        self.assertEqual(self.computed(), list(range(8)))  # once each, in the workers
        del ds, loader
        gc.collect()
        self.assertFalse(os.path.exists(path))  # removed with the dataset
        self.assertEqual(os.listdir(self.root), [])

    @needs_store
    def test_set_data_makes_a_new_store_and_pickles_no_data(self):
        """As the Manager list was: a new store at every set_data, the old one removed; the data are never pickled."""
        data = [{"id": i, "lock": threading.Lock()} for i in range(4)]  # pickle cannot store a lock
        ds = CacheDataset(data, Compose([Lambda(lambda d: d["id"]), Load(self.log), AddOne()]), runtime_cache="process")
        for _ in range(2):
            (old,) = os.listdir(self.root)
            self.assertEqual([ds[i]["img"][0].item() for i in range(4) for _ in range(2)], [1, 1, 2, 2, 3, 3, 4, 4])
            ds.set_data(data)
            self.assertNotIn(old, os.listdir(self.root))
        self.assertEqual(self.computed(), [0, 0, 1, 1, 2, 2, 3, 3])  # once for each store

    @needs_store
    def test_a_root_that_cannot_hold_a_store(self):
        """A wrong MONAI_CACHE_ROOT is one warning that names it, and the items are computed without the cache."""
        with open(os.path.join(self.tmp, "afile"), "w"):
            pass
        for root in (os.path.join(self.tmp, "missing"), os.path.join(self.tmp, "afile")):
            with mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": root}):
                with self.assertWarnsRegex(RuntimeWarning, f"MONAI_CACHE_ROOT='{root}'.*an existing directory"):
                    ds = CacheDataset(list(range(4)), Compose([Load(self.log), AddOne()]), runtime_cache="process")
                self.assertEqual([ds[i]["img"][0].item() for _ in range(2) for i in range(4)], [1.0, 2.0, 3.0, 4.0] * 2)
        self.assertEqual(self.computed(), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])  # twice each, uncached
        self.assertEqual(sorted(os.listdir(self.tmp)), ["afile", "log", "shm"])

    @needs_store
    def test_items_of_any_type(self):
        ds = CacheDataset(list(range(3)), Compose([Load(self.log), Lambda(Box)]), runtime_cache="process")
        self.assertEqual([ds[i].d["src"] for i in range(3) for _ in range(2)], [0, 0, 1, 1, 2, 2])
        self.assertEqual(self.computed(), [0, 1, 2])  # once each: stored

    def test_without_fcntl_a_manager_list(self):
        with mock.patch.object(SharedCacheStore, "supported", False):
            ds = CacheDataset(list(range(4)), Compose([Load(self.log), AddOne()]), runtime_cache="process")
            self.assertEqual(os.listdir(self.root), [])
            self.assertEqual([ds[i]["img"][0].item() for i in range(4)] * 2, [1.0, 2.0, 3.0, 4.0] * 2)
        self.assertEqual(self.computed(), [0, 1, 2, 3])


if __name__ == "__main__":
    unittest.main()
