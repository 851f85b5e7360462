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
from monai.data.utils import json_hashing, pickle_hashing
from monai.transforms import Compose, Lambda, RandomizableTransform, Transform

DATA = list(range(8))


class Load(Transform):
    """Deterministic: appends each input that it computes to the file ``log``, if given."""

    def __init__(self, log: str | None = None, scale: float = 1.0) -> None:
        self.log, self.scale = log, scale

    def __call__(self, x):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{x}\n")
        return {"src": x, "img": torch.full((2, 3), float(x) * self.scale)}


class AddOne(RandomizableTransform):
    """Random: adds 1 in place, so an item shared with the cache would come back with 2, then 3."""

    def __call__(self, d):
        d["img"] += 1
        return d


class TestCacheDatasetRuntimeCacheKeys(unittest.TestCase):
    @property
    def manager(self):
        """A Manager, started for the tests that use one."""
        if not hasattr(self, "_manager"):
            self._manager = Manager()
            self.addCleanup(self._manager.shutdown)
        return self._manager

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.log = os.path.join(tmp.name, "log")

    def computed(self) -> list[int]:
        with open(self.log) as f:
            return sorted(int(x) for x in f.read().split())

    def check(self, item: dict, src: int, scale: float = 1.0) -> None:
        self.assertEqual(item["src"], src)
        torch.testing.assert_close(item["img"], torch.full((2, 3), src * scale + 1.0))

    def test_set_data_resyncs_the_same_container(self):
        """#5633: ``set_data`` served the items of the old data from a shared container."""
        cache = self.manager.list()
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache)
        for data in (DATA, [10, 11, 12] + DATA[3:] + [20], [10, 11]):
            ds.set_data(data)
            loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
            for _ in range(2):
                for i, item in enumerate(loader):
                    self.check(item, data[i])
        self.assertEqual(set(self.computed()), set(DATA + [10, 11, 12, 20]))

    @parameterized.expand([("list",), ("proxy",)])
    def test_prefilled_or_shared_container(self, mode):
        """A pre-filled container, and datasets over other data or transforms that share one."""
        junk = [None, ("junk", 1), {"src": -1}, ("k", {"src": -2}), (b"k", 5), 5]
        cache = self.manager.list(junk) if mode == "proxy" else list(junk)
        ds = CacheDataset(DATA, Compose([Load(), AddOne()]), runtime_cache=cache)
        scaled = CacheDataset(
            DATA, Compose([Load(scale=10), AddOne()]), runtime_cache=cache, hash_transform=json_hashing
        )
        other = CacheDataset([40, 41], Compose([Load(), AddOne()]), runtime_cache=cache)  # shorter, last
        for _ in range(2):
            for i in DATA:
                self.check(ds[i], i)
                self.check(scaled[i], i, scale=10)
            self.check(other[1], 41)

    def test_hash_transform(self):
        """Datasets share items where their ``hash_transform`` agree, as with ``PersistentDataset``'s."""
        cache: list = []
        ds = CacheDataset(DATA, Compose([Load(), AddOne()]), runtime_cache=cache, hash_transform=lambda t: b"v1")
        same = CacheDataset(
            DATA, Compose([Load(scale=10), AddOne()]), runtime_cache=cache, hash_transform=lambda t: b"v1"
        )
        other = CacheDataset(
            DATA, Compose([Load(scale=10), AddOne()]), runtime_cache=cache, hash_transform=lambda t: b"v2"
        )
        self.check(ds[1], 1)
        self.check(same[1], 1)  # equal hashes say that the cached transforms are the same
        self.check(other[1], 1, scale=10)

    def test_cache_key(self):
        lambdas = Compose(
            [Load(), Lambda(lambda d: d), AddOne()]
        )  # JSON cannot serialize it: names, as PersistentDataset
        ds = CacheDataset(DATA, lambdas, cache_rate=0.5, runtime_cache=[], hash_transform=json_hashing)
        names = json_hashing("LoadLambda").decode()
        self.assertEqual(ds.cache_key(2), pickle_hashing(2).decode() + names)
        self.assertEqual(ds.cache_key(-5), ds.cache_key(3))
        self.assertIsNone(ds.cache_key(4))  # not cached
        with self.assertRaises(IndexError):
            ds.cache_key(8)
        dup = CacheDataset(
            [5, 5, 6], Compose([Load()]), hash_as_key=True, cache_num=1, runtime_cache=[], hash_transform=lambda t: b""
        )
        self.assertEqual([dup.cache_key(i) is None for i in range(3)], [False, False, True])
        self.assertEqual(dup.cache_key(0), pickle_hashing(5).decode())

    def test_own_containers_unchanged(self):
        """The lists of ``True`` and ``"thread"`` hold the items alone, as before (the list of ``"process"`` too)."""
        for mode in (True, "thread"):
            ds = CacheDataset(DATA, Compose([Load(), AddOne()]), runtime_cache=mode)
            self.check(ds[3], 3)
            self.assertIs(type(ds._cache), list)
            self.assertEqual(ds._cache[3]["src"], 3)

    def test_hash_func_of_digest_bytes(self):
        """A ``hash_func`` that returns raw digest bytes (not UTF-8) keys the slots too."""
        ds = CacheDataset(DATA, Compose([Load(), AddOne()]), runtime_cache=[], hash_func=lambda x: bytes([x, 0xFF]))
        self.assertNotEqual(ds.cache_key(1), ds.cache_key(2))
        for _ in range(2):
            self.check(ds[2], 2)

    def test_hash_func_of_str(self):
        """A ``hash_func`` that returns ``str`` keys the slots too."""
        ds = CacheDataset(
            DATA,
            Compose([Load(), AddOne()]),
            runtime_cache=[],
            hash_func=lambda x: f"input {x}",
            hash_transform=lambda t: b"",
        )
        self.assertEqual(ds.cache_key(2), "input 2")
        for _ in range(2):
            self.check(ds[2], 2)


if __name__ == "__main__":
    unittest.main()
