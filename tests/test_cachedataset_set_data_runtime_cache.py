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


class TestCacheDatasetSetDataRuntimeCache(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.log = os.path.join(tmp.name, "log")
        self.transform = Compose([Load(self.log), AddOne()])

    def computed(self) -> list[int]:
        with open(self.log) as f:
            return sorted(int(x) for x in f.read().split())

    def check(self, item: dict, src: int) -> None:
        self.assertEqual(item["src"], src)
        torch.testing.assert_close(item["img"], torch.full((2, 3), src + 1.0))

    def test_set_data_resyncs_in_workers(self):
        """#5633: after ``set_data``, DataLoader workers got the old data's items from a shared container."""
        manager = Manager()
        self.addCleanup(manager.shutdown)
        cache = manager.list()
        ds = CacheDataset(DATA, self.transform, runtime_cache=cache)
        for data in (DATA, [10 + i for i in DATA], [20, 21]):  # each unlike the items in the slots before it
            ds.set_data(data)
            loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
            self.assertEqual([item["src"] for item in loader], data)
            for i in range(len(data)):  # the items that the workers stored
                self.check(ds[i], data[i])
        self.assertEqual(self.computed(), sorted(DATA + [10 + i for i in DATA] + [20, 21]))

    @parameterized.expand([("list",), ("proxy",)])
    def test_set_data_empties_the_slots(self, kind):
        cache: list = []
        if kind == "proxy":
            manager = Manager()
            self.addCleanup(manager.shutdown)
            cache = manager.list()  # type: ignore[assignment]
        ds = CacheDataset(DATA, self.transform, runtime_cache=cache)
        for i in DATA:
            self.check(ds[i], i)
        ds.set_data(DATA[::-1])
        for _ in range(2):
            for i in DATA:
                self.check(ds[i], 7 - i)
        self.assertEqual(self.computed(), sorted(DATA * 2))  # the new data's items, each once

    def test_constructor_keeps_the_items(self):
        """A container that another dataset over the same data filled is used as it is: nothing is computed again."""
        cache: list = []
        first = CacheDataset(DATA, self.transform, runtime_cache=cache)
        for i in DATA:
            self.check(first[i], i)
        second = CacheDataset(DATA, self.transform, runtime_cache=cache)
        for i in DATA:
            self.check(second[i], i)
        self.assertEqual(self.computed(), DATA)

    def test_read_only_container_is_refused_and_kept(self):
        """``set_data`` cannot empty the slots of a tuple: a clear error, and the dataset as it was."""
        ds = CacheDataset(DATA[:3], Compose([Load(self.log)]), runtime_cache=(10, 20, 30))
        with self.assertRaisesRegex(TypeError, "set_data cannot empty runtime_cache of type tuple"):
            ds.set_data([7, 8, 9])
        self.assertEqual((ds.data, ds.cache_num), (DATA[:3], 3))
        self.assertEqual([ds[i] for i in range(3)], [10, 20, 30])

    def test_own_containers(self):
        """The containers that the dataset makes itself are new at every ``set_data``, as before."""
        for mode in (True, "thread"):
            ds = CacheDataset(DATA, self.transform, runtime_cache=mode)
            self.check(ds[3], 3)
            ds.set_data(DATA[::-1])
            self.check(ds[3], 4)


if __name__ == "__main__":
    unittest.main()
