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
import shutil
import tempfile
import unittest
from collections import Counter
from multiprocessing import Manager

import numpy as np
import torch
import torch.distributed as dist
from parameterized import parameterized

from monai.data import CacheDataset, SharedCacheStore, create_shared_cache
from monai.data.utils import pickle_hashing
from monai.transforms import Compose, RandomizableTransform, Transform
from tests.test_utils import DistCall, DistTestCase, skip_if_quick

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
N = 6
TIMEOUT = 120


class Load(Transform):
    """Reads an input file (rewritten in place by the tests); logs each computation (one O_APPEND write)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, path: str) -> dict:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (os.path.basename(path) + "\n").encode())
        finally:
            os.close(fd)
        return {"path": path, "img": torch.as_tensor(np.load(path))}


class AddOne(RandomizableTransform):
    def __call__(self, d: dict) -> dict:
        d["img"] += 1  # in place: an item shared with the cache would drift
        return d


def write_inputs(tmp: str, offset: float) -> list[str]:
    paths = [os.path.join(tmp, f"in{i}.npy") for i in range(N)]
    for i, p in enumerate(paths):
        np.save(p, np.full((2, 3), offset + i))
    return paths


def name_key(path: str) -> bytes:
    """A content key of the input's name alone: a file rewritten in place keeps its key (and its items)."""
    return pickle_hashing(path)


def computed(log: str) -> Counter:
    with open(log) as f:
        return Counter(f.read().split())


class TestRefresh(DistTestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.log = os.path.join(self.tmp, "log")
        self.paths = write_inputs(self.tmp, 0.0)

    def check(self, ds: CacheDataset, offset: float) -> None:
        for i in range(N):
            img = ds[i]["img"]
            self.assertTrue(torch.equal(img, torch.full((2, 3), offset + i + 1.0)), (i, img))

    def check_refresh(self, cache: object, keeps_on_set_data: bool = True) -> None:
        paths = self.paths
        ds = CacheDataset(
            paths, Compose([Load(self.log), AddOne()]), runtime_cache=cache, progress=False, hash_func=name_key
        )
        self.check(ds, 0.0)
        write_inputs(self.tmp, 100.0)  # the same paths, so the same content keys under name_key
        if keeps_on_set_data:  # True, "thread" (and "process" without a store) fill a new list at set_data, as upstream
            ds.set_data(paths)
        self.check(ds, 0.0)  # still the cached items: set_data keeps the items of unchanged keys
        self.assertEqual(computed(self.log), Counter({os.path.basename(p): 1 for p in paths}))
        ds.refresh()
        self.check(ds, 100.0)
        self.check(ds, 100.0)  # and cached again
        self.assertEqual(computed(self.log), Counter({os.path.basename(p): 2 for p in paths}))

    @parameterized.expand([("eager", False, False), ("true", True, False), ("thread", "thread", False)])
    def test_private_caches(self, _, cache, keeps) -> None:
        self.check_refresh(cache, keeps)

    @parameterized.expand([("process",), ("list",), ("listproxy",)])
    def test_shared_caches(self, mode) -> None:
        cache: object = "process" if mode == "process" else []
        if mode == "listproxy":
            manager = Manager()
            self.addCleanup(manager.shutdown)
            cache = manager.list()
        self.check_refresh(cache, mode != "process" or SharedCacheStore.supported)

    @needs_store
    def test_store(self) -> None:
        store = SharedCacheStore(root=self.tmp)
        self.addCleanup(store.close)
        store.put("other", 1)  # an item of another dataset: kept
        self.check_refresh(store)
        self.assertEqual(store.get("other"), 1)

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_one_rank_refreshes_for_the_node(self) -> None:
        """2 ranks share one store: rank 0 refreshes between barriers, both then read the new items, computed once."""
        rank, store = dist.get_rank(), create_shared_cache(root=self.tmp, timeout=TIMEOUT)
        ds = CacheDataset(self.paths, Compose([Load(self.log), AddOne()]), runtime_cache=store, hash_func=name_key)
        for epoch, offset in enumerate((0.0, 0.0, 100.0)):
            dist.barrier()  # every rank has finished the epoch
            if epoch == 2 and rank == 0:  # one rank per node rewrites the inputs and drops the items
                write_inputs(self.tmp, 100.0)
                ds.refresh()
            dist.barrier()  # no rank reads before the items are dropped
            self.check(ds, offset)  # every item, in both ranks at once
        dist.barrier()
        # each input computed once per version across the node: before and after the refresh
        self.assertEqual(computed(self.log), Counter({f"in{i}.npy": 2 for i in range(N)}))
        store.close()


if __name__ == "__main__":
    unittest.main()
