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
from torch.utils.data import DataLoader  # batch_size=None: the items as they are

from monai.data import CacheDataset, KeyedCache
from monai.data.utils import json_hashing
from monai.transforms import Compose, Lambda, RandomizableTransform, Transform

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


class Store(KeyedCache):
    """The protocol and nothing else: ``get`` and ``put``, each call recorded."""

    def __init__(self) -> None:
        self.items: dict = {}
        self.calls: list = []

    def get(self, key):
        self.calls.append(("get", key))
        return self.items.get(key)

    def put(self, key, item) -> None:
        self.calls.append(("put", key))
        self.items[key] = item


class DictCache(KeyedCache):
    """A keyed cache over a ``dict`` or a ``Manager().dict()`` (which DataLoader workers share)."""

    def __init__(self, items) -> None:
        self.items = items

    def get(self, key):
        return self.items.get(key)

    def put(self, key, item) -> None:
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
        self.assertIsInstance(store, KeyedCache)
        ds = CacheDataset(
            DATA, Compose([Load(self.log), AddOne()]), cache_rate=0.5, runtime_cache=store, hash_transform=json_hashing
        )
        self.assertEqual(store.calls, [])  # the constructor asks nothing
        for _ in range(2):
            for i in DATA:
                self.assertEqual(ds[i]["src"], i)
                torch.testing.assert_close(ds[i]["img"], torch.full((2, 3), i + 1.0))
        keys = [ds.cache_key(i) for i in range(4)]
        self.assertEqual(sorted(store.items), sorted(keys))
        self.assertEqual([c for c in store.calls if c[0] == "put"], [("put", k) for k in keys])
        self.assertEqual(self.computed(), sorted([0, 1, 2, 3] + [4, 5, 6, 7] * 4))  # the cached half once
        ds.set_data(DATA[::-1])  # no resync: the keys follow the inputs
        self.assertEqual(ds[0]["src"], 7)
        self.assertEqual(self.computed().count(7), 5)  # data[0] is now 7, which was not cached: computed once more

    def test_datasets_share_by_content(self):
        """Datasets of other lengths and orders, ``hash_as_key`` or not, share a keyed cache by their keys."""
        cache = DictCache({})
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_transform=json_hashing)
        self.assertEqual([d["src"] for d in ds], DATA)
        other = CacheDataset(
            DATA[::-1] + [5, 8],
            Compose([Load(self.log), AddOne()]),
            runtime_cache=cache,
            hash_as_key=True,
            hash_transform=lambda t: b"other",
        )  # other keys
        again = CacheDataset(
            DATA[2:], Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_transform=json_hashing
        )
        self.assertEqual([d["src"] for d in again], DATA[2:])
        self.assertEqual(self.computed(), DATA)  # `again` computed nothing
        self.assertEqual([d["src"] for d in other], DATA[::-1] + [5, 8])
        self.assertEqual(len(cache.items), 8 + 9)

    def test_hash_transform_separates_pipelines(self):
        """Other cached transforms, other keys: as ``PersistentDataset``'s ``hash_transform``, nested ``Compose`` too."""
        cache = DictCache({})
        one = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_transform=json_hashing)
        nested = Compose([Compose([Load(self.log), Lambda(lambda d: d)]), AddOne()])
        two = CacheDataset(DATA, nested, runtime_cache=cache, hash_transform=json_hashing)
        self.assertEqual(one[1]["src"], two[1]["src"])
        self.assertEqual(self.computed(), [1, 1])
        # the transforms before the first random one of the flattened list, their names as JSON cannot serialize them
        self.assertEqual(two.transform_hash, json_hashing("LoadLambda").decode())
        self.assertEqual(two.cache_key(2), two.hash_func(2).decode() + two.transform_hash)

    def test_cache_key(self):
        no_transforms = lambda t: b""  # noqa: E731
        cache = Store()
        nothing = {"hash_transform": no_transforms}
        keys = {"hash_func": json_hashing, **nothing}
        ds = CacheDataset(DATA, Compose([Load(self.log)]), cache_rate=0.5, runtime_cache=cache, **keys)
        self.assertEqual(ds.cache_key(2), json_hashing(2).decode())  # the input's hash, then the transforms' (none)
        self.assertEqual(ds.cache_key(-5), ds.cache_key(3))
        self.assertIsNone(ds.cache_key(4))  # not cached
        with self.assertRaises(IndexError):
            ds.cache_key(8)
        dup = CacheDataset(
            [5, 5, 6], Compose([Load(self.log)]), hash_as_key=True, cache_num=1, runtime_cache=cache, **keys
        )
        self.assertEqual([dup.cache_key(i) is None for i in range(3)], [False, False, True])
        for hash_func, key in ((lambda x: bytes([x, 255]), "01ff"), (lambda x: f"in {x}", "in 1")):  # not ASCII: hex
            ds = CacheDataset(DATA, Compose([Load(self.log)]), runtime_cache=cache, hash_func=hash_func, **nothing)
            self.assertEqual(ds.cache_key(1), key)

    def test_needs_hash_transform(self):
        """Datasets of other transforms may share a keyed cache: without hash_transform, their keys would collide."""
        with self.assertRaisesRegex(ValueError, "a keyed runtime_cache .* give hash_transform"):
            CacheDataset(DATA, Compose([Load(self.log)]), runtime_cache=Store())

    def test_dict_is_still_a_container_of_slots(self):
        """A ``dict``, and any class that does not opt in, is a container of slots by index, as before."""

        class GetPut(dict):  # get and put, but not a KeyedCache
            def put(self, key, item):
                self[key] = item

        self.assertNotIsInstance(GetPut(), KeyedCache)
        slots = GetPut.fromkeys(range(4))
        ds = CacheDataset(DATA[:4], Compose([Load(self.log), AddOne()]), runtime_cache=slots)
        self.assertEqual([d["src"] for d in ds], DATA[:4])
        self.assertEqual(sorted(slots), [0, 1, 2, 3])
        self.assertTrue(all(slots.values()))

    def test_manager_dict_in_workers(self):
        """DataLoader workers share a keyed cache over a ``Manager().dict()``: one item per input, across epochs."""
        manager = Manager()
        self.addCleanup(manager.shutdown)
        cache = DictCache(manager.dict())
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache, hash_transform=json_hashing)
        loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
        for _ in range(3):
            self.assertEqual([d["src"] for d in loader], DATA)
        self.assertEqual(self.computed(), DATA)
        self.assertEqual(sorted(cache.items.keys()), sorted(ds.cache_key(i) for i in DATA))


if __name__ == "__main__":
    unittest.main()
