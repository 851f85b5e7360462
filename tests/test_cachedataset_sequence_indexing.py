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

import unittest
from multiprocessing import Manager

import torch
from parameterized import parameterized

from monai.data import CacheDataset
from monai.transforms import Compose, Lambda, RandomizableTransform

DATA = list(range(8))


class AddOne(RandomizableTransform):
    """Random: adds 1 in place, so an item shared with the cache would come back with 2, then 3."""

    def __call__(self, d):
        d["img"] += 1
        return d


class TestCacheDatasetSequenceIndexing(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.manager = Manager()

    @classmethod
    def tearDownClass(cls):
        cls.manager.shutdown()

    @parameterized.expand([(m, r) for m in (False, True, "thread", "process", "proxy", "long") for r in (0.5, 1.0)])
    def test_sequence_indexing(self, mode, rate):
        cache = mode
        if mode in ("proxy", "long"):  # a container of cache_num slots, or 3 more
            cache = self.manager.list([None] * (int(len(DATA) * rate) + 3 * (mode == "long")))
        load = Lambda(lambda x: {"src": x, "img": torch.full((2, 3), float(x))})
        ds = CacheDataset(DATA, Compose([load, AddOne()]), cache_rate=rate, runtime_cache=cache)
        for _ in range(2):  # the second time from the cache
            for i in range(-len(DATA), len(DATA)):
                item = ds[i]
                self.assertEqual(item["src"], DATA[i])
                torch.testing.assert_close(item["img"], torch.full((2, 3), DATA[i] + 1.0))
        for i in (len(DATA), -len(DATA) - 1, 100):
            with self.assertRaises(IndexError):
                ds[i]
        self.assertEqual([d["src"] for d in list(ds)], DATA)  # iteration stops at the IndexError
        self.assertEqual([d["src"] for d in ds[2:7:2]], [2, 4, 6])
        self.assertEqual([d["src"] for d in ds[[5, -1]]], [5, 7])
        if mode == "long":  # a negative index fills the slot of its item, never one from the container's end
            self.assertEqual([c is not None for c in cache], [True] * ds.cache_num + [False] * 3)


if __name__ == "__main__":
    unittest.main()
