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

import multiprocessing
import os
import tempfile
import threading
import unittest
from multiprocessing import Manager
from unittest import mock

import torch
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader
from monai.data.utils import json_hashing
from monai.transforms import Compose, Lambda, RandomizableTransform, Transform

DATA = list(range(8))
MODES = [False, True, "thread", "process", "list", "listproxy"]


class Load(Transform):
    """Deterministic: appends each input it computes to the file ``log``, if given."""

    def __init__(self, log: str | None = None) -> None:
        self.log = log

    def __call__(self, x):
        src = x["id"] if isinstance(x, dict) else x
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{src}\n")
        return {"src": src, "img": torch.full((2, 3), float(src))}


class AddOne(RandomizableTransform):
    """Random: adds 1 in place, so an item shared with the cache would come back with 2, then 3."""

    def __call__(self, d):
        d["img"] += 1
        return d


def _read_all(cache, log: str) -> None:
    organs = {"liver", "spleen", "kidney", "lung", "heart", "brain"}  # pickled in an order of PYTHONHASHSEED's
    pipeline = Compose([Load(log), Lambda(lambda d: {**d, "organs": len(organs)}), AddOne()])
    ds = CacheDataset(DATA, pipeline, runtime_cache=cache)
    assert [ds[i]["src"] for i in DATA] == DATA


def computed(log: str) -> list[int]:
    with open(log) as f:
        return sorted(int(x) for x in f.read().split())


def _name_key(d: dict) -> bytes:
    return d["name"].encode()


class TestRuntimeCache(unittest.TestCase):
    def setUp(self) -> None:
        self.manager = Manager()
        self.addCleanup(self.manager.shutdown)
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.log = os.path.join(tmp.name, "log")

    def container(self, mode, length: int = 0):
        return {"list": [None] * length, "listproxy": self.manager.list([None] * length)}.get(mode, mode)

    def check(self, item: dict, src: int) -> None:
        self.assertEqual(item["src"], src)
        self.assertTrue(torch.equal(item["img"], torch.full((2, 3), src + 1.0)), f"item {src}: {item['img']}")

    @parameterized.expand([(m, r) for m in MODES for r in (0.5, 1.0)])
    def test_sequence_indexing(self, mode, rate):
        ds = CacheDataset(DATA, Compose([Load(), AddOne()]), cache_rate=rate, runtime_cache=self.container(mode))
        for _ in range(2):  # the second time from the cache
            for i in range(-len(DATA), len(DATA)):
                self.check(ds[i], DATA[i])
        for i in (len(DATA), -len(DATA) - 1, 100):
            with self.assertRaises(IndexError):
                ds[i]
        self.assertEqual([d["src"] for d in list(ds)], DATA)  # iteration stops at IndexError
        self.assertEqual([d["src"] for d in ds[2:7:2]], [2, 4, 6])
        self.assertEqual([d["src"] for d in ds[[5, -1]]], [5, 7])
        self.assertEqual(len(ds), len(DATA))
        self.assertEqual(len(ds._cache), ds.cache_num)

    @parameterized.expand([(m, n) for m in ("list", "listproxy") for n in (0, 3, 20)])
    def test_container_sized_in_workers(self, mode, length):
        cache = self.container(mode, length)
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), cache_rate=0.5, runtime_cache=cache)
        self.assertEqual(len(cache), 4)
        workers = 2 if mode == "listproxy" else 0  # a list is private to the process
        loader = DataLoader(ds, batch_size=1, num_workers=workers, timeout=60 if workers else 0)
        for _ in range(2):
            for i, item in enumerate(loader):
                self.check({k: v[0] for k, v in item.items()}, DATA[i])
        self.assertEqual(computed(self.log), [0, 1, 2, 3] + [4, 4, 5, 5, 6, 6, 7, 7])  # cached items once

    def test_set_data_resyncs_the_same_container(self):
        cache, previous = self.manager.list(), []
        ds = CacheDataset(DATA, Compose([Load(self.log), AddOne()]), runtime_cache=cache)
        for data in (DATA, [10, 11, 12] + DATA[3:] + [20], [10, 11]):
            ds.set_data(data)
            kept = [i < len(previous) and previous[i] == x for i, x in enumerate(data)]
            self.assertEqual([slot is not None for slot in cache], kept)  # the slots of other inputs are emptied
            previous = data
            loader = DataLoader(ds, batch_size=1, num_workers=2, timeout=60)
            for _ in range(2):
                for i, item in enumerate(loader):
                    self.check({k: v[0] for k, v in item.items()}, data[i])
        self.assertEqual(computed(self.log), sorted(DATA + [10, 11, 12, 20]))  # unchanged inputs stay cached

    @parameterized.expand([(m,) for m in MODES])
    def test_hash_as_key(self, mode):
        data = [{"id": 1}, {"id": 1}, {"id": 5}, {"id": 7}, {"id": 5}]
        ds = CacheDataset(
            data, Compose([Load(self.log), AddOne()]), hash_as_key=True, runtime_cache=self.container(mode)
        )
        for _ in range(2):
            for i, d in enumerate(data):
                self.check(ds[i], d["id"])
        self.assertEqual(computed(self.log), [1, 5, 7])

    @parameterized.expand([("list",), ("listproxy",)])
    def test_prefilled_or_shared_container(self, mode):
        junk = [None, ("junk", 1), {"src": -1}, ("k", {"src": -2}), 5]
        cache = self.manager.list(junk) if mode == "listproxy" else list(junk)
        other = CacheDataset([40, 41], Compose([Load(), AddOne()]), runtime_cache=cache)
        ds = CacheDataset(DATA, Compose([Load(), AddOne()]), runtime_cache=cache)
        scaled = CacheDataset(
            DATA, Compose([Load(), Lambda(lambda d: {**d, "img": d["img"] * 10}), AddOne()]), runtime_cache=cache
        )
        for _ in range(2):
            for i in range(len(DATA)):
                self.check(ds[i], DATA[i])
                self.assertEqual(scaled[i]["img"][0, 0].item(), 10.0 * DATA[i] + 1)
            self.check(other[1], 41)

    def test_hash_transform(self):
        """Datasets share items where their ``hash_transform`` agree, and only there, whatever their transforms."""
        cache: list = []
        scaled = Compose([Load(), Lambda(lambda d: {**d, "img": d["img"] * 10}), AddOne()])
        ds = CacheDataset(DATA, Compose([Load(), AddOne()]), runtime_cache=cache, hash_transform=lambda t: b"v1")
        same = CacheDataset(DATA, scaled, runtime_cache=cache, hash_transform=lambda t: b"v1")
        other = CacheDataset(DATA, scaled, runtime_cache=cache, hash_transform=lambda t: b"v2")
        self.check(ds[1], 1)
        self.check(same[1], 1)  # the item of `ds`: equal hashes say that the cached transforms are the same
        self.assertEqual(other[1]["img"][0, 0].item(), 11.0)
        with_json = CacheDataset(DATA, scaled, runtime_cache=cache, hash_transform=json_hashing)  # as PersistentDataset
        self.assertEqual(with_json[1]["img"][0, 0].item(), 11.0)

    def test_processes_share_items(self):
        """Processes with other PYTHONHASHSEED build the same pipeline (a set and a lambda in it): the same keys."""
        cache, spawn = self.manager.list(), multiprocessing.get_context("spawn")
        for seed in ("1", "2"):
            with mock.patch.dict(os.environ, {"PYTHONHASHSEED": seed}):  # a hung child goes with this process
                child = spawn.Process(target=_read_all, args=(cache, self.log), daemon=True)
                child.start()
            child.join(120)
            self.assertEqual(child.exitcode, 0)
        self.assertEqual(computed(self.log), DATA)  # once each, in the first process

    def test_own_containers_hash_no_data(self):
        data = [{"id": i, "lock": threading.Lock()} for i in DATA]  # pickle cannot store a lock
        self.check(CacheDataset(data, Compose([Load(), AddOne()]), runtime_cache=True)[3], 3)

    @parameterized.expand([(m,) for m in MODES])
    def test_refresh(self, mode):
        """Inputs changed under the same key (here in place) keep their items until ``refresh`` drops them."""
        data = [{"name": str(i), "id": i} for i in DATA]
        ds = CacheDataset(
            data, Compose([Load(self.log), AddOne()]), runtime_cache=self.container(mode), hash_func=_name_key
        )
        for d in data:
            self.check(ds[d["id"]], d["id"])
            d["id"] += 100
        if mode in ("list", "listproxy"):  # the same container: set_data keeps the items of unchanged keys
            ds.set_data(data)
        for i in DATA:
            self.check(ds[i], i)
        ds.refresh()
        for _ in range(2):  # computed again, then cached again
            for i in DATA:
                self.check(ds[i], i + 100)
        self.assertEqual(computed(self.log), DATA + [i + 100 for i in DATA])

    @parameterized.expand(
        [("proc", ValueError), ("", ValueError), (1.5, TypeError), ({}, TypeError), ((1,), TypeError)]
    )
    def test_bad_values(self, value, error):
        with self.assertRaisesRegex(error, "runtime_cache.*accepted"):
            CacheDataset(DATA, Load(), runtime_cache=value)

    def test_worker_warning(self):
        ds = CacheDataset(DATA, Load(), runtime_cache=True)
        with mock.patch("monai.data.dataset.get_worker_info", return_value=object()):  # as in a DataLoader worker
            with self.assertWarnsRegex(UserWarning, "is filled in a DataLoader worker"):
                ds[0]


if __name__ == "__main__":
    unittest.main()
