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
import tempfile
import unittest
from multiprocessing import Manager

import torch
from parameterized import parameterized
from torch.utils.data import DataLoader  # batch_size=None: the items as they are

from monai.data import CacheDataset
from monai.data.utils import json_hashing
from monai.transforms import Compose, RandomizableTransform, Transform

DATA = list(range(8))


class Load(Transform):
    """Deterministic: appends each input that it computes to the file ``log``."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, x):
        with open(self.log, "a") as f:
            f.write(f"{x}\n")
        return {"src": x, "img": torch.full((2, 3), float(x))}


class AddOne(RandomizableTransform):
    """Random: adds 1 in place, so an item shared with the cache would come back with 2, then 3."""

    def __call__(self, d):
        d["img"] += 1
        return d


class Store:
    """The protocol and nothing else: a ``get`` and an item assignment, each call recorded."""

    def __init__(self) -> None:
        self.items: dict = {}
        self.calls: list = []

    def get(self, key):
        self.calls.append(("get", key))
        return self.items.get(key)

    def __setitem__(self, key, item) -> None:
        self.calls.append(("set", key))
        self.items[key] = item


class TestCacheDatasetKeyedRuntimeCache(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.log = os.path.join(tmp.name, "log")

    def computed(self) -> list[int]:
        with open(self.log) as f:
            return sorted(int(x) for x in f.read().split())

    def test_protocol(self):
        store = Store()
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), cache_rate=0.5, runtime_cache=store)
        self.assertEqual(store.calls, [])  # the constructor asks nothing
        for _ in range(2):
            for i in DATA:
                self.assertEqual(ds[i]["src"], i)
                torch.testing.assert_close(ds[i]["img"], torch.full((2, 3), i + 1.0))
        keys = [ds.cache_key(i) for i in range(4)]
        self.assertEqual(sorted(store.items), sorted(keys))
        self.assertEqual([c for c in store.calls if c[0] == "set"], [("set", k) for k in keys])
        self.assertEqual(self.computed(), sorted([0, 1, 2, 3] + [4, 5, 6, 7] * 4))  # the cached half once
        ds.set_data(DATA[::-1])  # no resync: the keys follow the inputs
        self.assertEqual(ds[0]["src"], 7)
        self.assertEqual(self.computed().count(7), 5)  # data[0] is now 7, which was not cached: computed once more

    @parameterized.expand([("dict",), ("manager",)])
    def test_datasets_share_by_content(self, kind):
        """Datasets of other lengths and orders, ``hash_as_key`` or not, share a dict by their keys."""
        manager = Manager()
        self.addCleanup(manager.shutdown)
        cache = manager.dict() if kind == "manager" else {}
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_transform=json_hashing)
        self.assertEqual([d["src"] for d in ds], DATA)
        other = CacheDataset(
            DATA[::-1] + [5, 8], Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_as_key=True
        )  # other keys: no hash_transform
        again = CacheDataset(
            DATA[2:], Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_transform=json_hashing
        )
        self.assertEqual([d["src"] for d in again], DATA[2:])
        self.assertEqual(self.computed(), DATA)  # `again` computed nothing
        self.assertEqual([d["src"] for d in other], DATA[::-1] + [5, 8])
        self.assertEqual(len(cache), 8 + 9)

    def test_manager_dict_in_workers(self):
        """DataLoader workers share a ``Manager().dict()``: one item per input, across epochs."""
        manager = Manager()
        self.addCleanup(manager.shutdown)
        cache = manager.dict()
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache)
        loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
        for _ in range(3):
            self.assertEqual([d["src"] for d in loader], DATA)
        self.assertEqual(self.computed(), DATA)
        self.assertEqual(sorted(cache.keys()), sorted(ds.cache_key(i) for i in DATA))


if __name__ == "__main__":
    unittest.main()
