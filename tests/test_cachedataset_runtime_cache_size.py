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

import collections
import os
import tempfile
import unittest
from multiprocessing import Manager

import torch
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, Transform

DATA = list(range(8))


class Load(Transform):
    """Deterministic: appends each input that it computes to the file ``log``."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, x):
        with open(self.log, "a") as f:
            f.write(f"{x}\n")
        return torch.full((2, 3), float(x))


def computed(log: str) -> list[int]:
    with open(log) as f:
        return sorted(int(x) for x in f.read().split())


class FixedSlots:
    """A container of a fixed number of slots, with a length and item access, and neither a sequence nor a mapping."""

    def __init__(self, n):
        self.slots = [None] * n

    def __len__(self):
        return len(self.slots)

    def __getitem__(self, i):
        return self.slots[i]

    def __setitem__(self, i, v):
        self.slots[i] = v


class TestCacheDatasetRuntimeCacheSize(unittest.TestCase):
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

    @parameterized.expand([(m, n) for m in ("list", "proxy") for n in (0, 3, 20)])
    def test_resized_and_read_by_workers(self, mode, length):
        """#5633: an empty, short or long container, read by DataLoader workers."""
        cache = self.manager.list([None] * length) if mode == "proxy" else [None] * length
        ds = CacheDataset(DATA, Compose([Load(self.log)]), cache_rate=0.5, runtime_cache=cache)
        self.assertEqual(len(cache), max(length, 4))  # grown to cache_num, never trimmed
        workers = 2 if mode == "proxy" else 0  # a list is private to the process that fills it
        loader = DataLoader(ds, batch_size=1, num_workers=workers, timeout=60 if workers else 0)
        for _ in range(2):
            self.assertEqual([int(b[0, 0, 0]) for b in loader], DATA)
        self.assertEqual(computed(self.log), [0, 1, 2, 3] + [4, 4, 5, 5, 6, 6, 7, 7])  # the cached half once

    def test_set_data_grows_the_same_container(self):
        """``set_data`` grows the container that the dataset was given, and never trims it."""
        cache = self.manager.list()
        ds = CacheDataset(DATA, Compose([Load(self.log)]), runtime_cache=cache)
        for data in (DATA[:3], DATA + [8, 9]):
            ds.set_data(data)
            self.assertEqual(len(cache), max(len(data), len(DATA)))
            self.assertEqual([int(ds[i][0, 0]) for i in range(len(data))], data)

    def test_containers_without_extend_as_before(self):
        """A mapping that makes its slots, with or without a length, is used as it is, as in 1.6.1."""

        class Slots:
            def __init__(self):
                self.slots: dict = {}

            def __getitem__(self, i):
                return self.slots.get(i)

            def __setitem__(self, i, v):
                self.slots[i] = v

        for cache in (collections.defaultdict(lambda: None), Slots()):
            ds = CacheDataset(DATA, Compose([Load(self.log)]), runtime_cache=cache)
            self.assertEqual([int(ds[i][0, 0]) for i in DATA], DATA)

    @parameterized.expand([((None, None),), (range(3),), (b"xyz",), (FixedSlots(3),)])
    def test_too_short(self, cache):
        with self.assertRaisesRegex(ValueError, rf"\(length {len(cache)}\) cannot hold cache_num=8 slots; accepted"):
            CacheDataset(DATA, Compose([Load(self.log)]), runtime_cache=cache)

    def test_not_a_container(self):
        with self.assertRaisesRegex(TypeError, "runtime_cache of type int is not a container; accepted"):
            CacheDataset(DATA, Compose([Load(self.log)]), runtime_cache=7)

    def test_filled_read_only_container_as_before(self):
        """A tuple that holds every item is read as it is (it is never written)."""
        ds = CacheDataset(DATA[:3], Compose([Load(self.log)]), runtime_cache=(10, 20, 30))
        self.assertEqual([ds[i] for i in range(3)], [10, 20, 30])

    def test_failed_set_data_changes_nothing(self):
        class Fixed(list):
            def extend(self, other):  # a container of a fixed size
                raise TypeError("fixed size")

        ds = CacheDataset(DATA[:4], Compose([Load(self.log)]), runtime_cache=Fixed([None] * 4))
        self.assertEqual(int(ds[1][0, 0]), 1)
        with self.assertRaisesRegex(ValueError, "cannot hold cache_num=8 slots"):
            ds.set_data(DATA)
        self.assertEqual((ds.data, ds.cache_num), (DATA[:4], 4))
        self.assertEqual([int(ds[i][0, 0]) for i in range(4)], DATA[:4])

    def test_long_enough_fixed_size(self):
        """A container of ``cache_num`` slots or more is used as it is, whatever it can do besides indexing."""
        cache = FixedSlots(8)
        ds = CacheDataset(DATA, Compose([Load(self.log)]), cache_rate=0.5, runtime_cache=cache)
        for _ in range(2):
            self.assertEqual([int(ds[i][0, 0]) for i in DATA], DATA)
        self.assertEqual(len(cache), 8)
        self.assertEqual(computed(self.log), [0, 1, 2, 3] + [4, 4, 5, 5, 6, 6, 7, 7])


if __name__ == "__main__":
    unittest.main()
