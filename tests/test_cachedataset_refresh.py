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
import time
import unittest
from collections import Counter
from multiprocessing import Manager

import numpy as np
import torch
import torch.distributed as dist
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader, SharedCacheStore, create_shared_cache
from monai.transforms import Compose, RandomizableTransform, Transform

N = 6
TIMEOUT = 300


class Load(Transform):
    """Reads an input file (rewritten in place by the tests) and logs each computation to ``log``."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, path):
        with open(self.log, "a") as f:
            f.write(os.path.basename(path) + "\n")
        return {"path": path, "img": torch.as_tensor(np.load(path))}


class AddOne(RandomizableTransform):
    def __call__(self, d):
        d["img"] += 1
        return d


def write_inputs(tmp: str, offset: float) -> list[str]:
    paths = [os.path.join(tmp, f"in{i}.npy") for i in range(N)]
    for i, p in enumerate(paths):
        np.save(p, np.full((2, 3), offset + i))
    return paths


def computed(log: str) -> Counter:
    with open(log) as f:
        return Counter(f.read().split())


class TestRefresh(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.log = os.path.join(self.tmp, "log")

    def check(self, ds: CacheDataset, offset: float) -> None:
        for i in range(N):
            self.assertTrue(torch.equal(ds[i]["img"], torch.full((2, 3), offset + i + 1.0)), (i, ds[i]["img"]))

    @parameterized.expand([("eager",), ("thread",), ("process",), ("listproxy",), ("store",)])
    def test_inputs_rewritten_in_place(self, mode):
        cache: object = {"eager": False, "thread": True, "process": "process"}.get(mode)
        if mode == "listproxy":
            manager = Manager()
            self.addCleanup(manager.shutdown)
            cache = manager.list()
        if mode == "store":
            cache = SharedCacheStore()
            self.addCleanup(cache.close)
        paths = write_inputs(self.tmp, 0.0)
        ds = CacheDataset(paths, Compose([Load(self.log), AddOne()]), runtime_cache=cache, progress=False)
        self.check(ds, 0.0)
        write_inputs(self.tmp, 100.0)  # the same paths, so the same content keys
        if mode not in ("eager", "thread"):  # those two fill a new cache at every set_data, as upstream
            ds.set_data(paths)
        self.check(ds, 0.0)  # still the cached items: set_data keeps the items of unchanged keys
        ds.refresh()
        self.check(ds, 100.0)
        self.check(ds, 100.0)  # and cached again
        self.assertEqual(computed(self.log), Counter({os.path.basename(p): 2 for p in paths}))


def _rank(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        store = create_shared_cache(timeout=TIMEOUT)
        paths = [os.path.join(tmp, f"in{i}.npy") for i in range(N)]
        ds = CacheDataset(paths, Compose([Load(os.path.join(tmp, "log")), AddOne()]), runtime_cache=store)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=False)
        loader = DataLoader(ds, batch_size=1, sampler=sampler)
        for epoch, offset in enumerate((0.0, 0.0, 100.0)):
            dist.barrier()  # every rank has finished the epoch
            if epoch == 2 and rank == 0:  # one rank per node (this one node) rewrites the inputs and drops the items
                write_inputs(tmp, 100.0)
                ds.refresh()
            dist.barrier()  # no rank reads before the items are dropped
            for batch in loader:
                i = int(os.path.basename(batch["path"][0])[2:-4])
                assert torch.equal(batch["img"][0], torch.full((2, 3), offset + i + 1.0)), (rank, epoch, i)
        dist.barrier()
        store.close()
    finally:
        dist.destroy_process_group()


class TestRefreshDistributed(unittest.TestCase):
    def test_one_rank_refreshes_for_the_node(self):
        """2 gloo ranks share one store: rank 0 refreshes between epochs, both read the new items, computed once."""
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        paths = write_inputs(tmp, 0.0)
        ctx = torch.multiprocessing.spawn(_rank, args=(2, tmp), nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                self.fail("the ranks did not finish in time")
        # each input computed once per version across the node: before and after the refresh
        self.assertEqual(computed(os.path.join(tmp, "log")), Counter({os.path.basename(p): 2 for p in paths}))


if __name__ == "__main__":
    unittest.main()
