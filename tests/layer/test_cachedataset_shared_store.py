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
import unittest
from unittest import mock

import torch
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, RandomizableTransform, Transform
from monai_sharedcache import SharedCacheStore, refresh

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
TIMEOUT = 120
MIB = 2**20


class Load(Transform):
    def __init__(self, log: str, numel: int = 12) -> None:
        self.log, self.numel = log, numel

    def __call__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return {"src": i, "img": torch.full((self.numel,), float(i))}


class AddOne(RandomizableTransform):
    def __call__(self, d):
        d["img"] += 1  # in place: an item shared with the cache would come back with 2, then 3
        return d


def _computed(log: str) -> list[int]:
    with open(log) as f:
        return sorted(int(x) for x in f.read().split())


class TestSharedStore(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.root, self.log = os.path.join(self.tmp, "shm"), os.path.join(self.tmp, "log")
        os.mkdir(self.root, 0o700)
        patcher = mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": self.root})
        patcher.start()
        self.addCleanup(patcher.stop)

    def check_epochs(self, ds: CacheDataset, ctx=None, epochs: int = 2) -> None:
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx, timeout=TIMEOUT)
        for _ in range(epochs):
            batches = list(loader)
            self.assertEqual(torch.cat([b["src"] for b in batches]).tolist(), list(range(len(ds))))
            for b in batches:
                self.assertTrue(torch.equal(b["img"], b["src"].float().view(-1, 1).expand_as(b["img"]) + 1))

    @parameterized.expand([(ctx,) for ctx in multiprocessing.get_all_start_methods()])
    @needs_store
    def test_workers_share_one_store(self, ctx):
        store = SharedCacheStore(root=self.root)
        ds = CacheDataset(
            list(range(8)),
            Compose([Load(self.log), AddOne()]),
            runtime_cache=store,
            hash_transform=store.hash_transform,
            copy_cache=True,
        )
        self.check_epochs(ds, ctx)
        self.assertEqual(_computed(self.log), list(range(8)))  # once each, in the workers
        del ds, store
        gc.collect()
        self.assertEqual(os.listdir(self.root), [])  # removed with its last user

    @needs_store
    def test_refresh_drops_the_items_of_the_dataset_only(self):
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        store.put("other", 1)  # an item of another dataset
        ds = CacheDataset(
            list(range(4)),
            Compose([Load(self.log), AddOne()]),
            runtime_cache=store,
            hash_transform=store.hash_transform,
            progress=False,
        )
        self.check_epochs(ds)
        refresh(ds)
        self.check_epochs(ds)
        self.assertEqual(_computed(self.log), sorted(list(range(4)) * 2))  # once before the refresh, once after
        self.assertEqual(store.get("other"), 1)

    @unittest.skipIf(FORK is None, "the file system is faked in this process and its forked workers")
    @needs_store
    def test_docker_default_shm(self):
        """
        Docker's default ``/dev/shm`` of 64 MB (faked: 41 MiB free, less what is stored) and items of 4 MiB: the store
        keeps half of it free for the DataLoader's batches, and items past that are computed without being stored.
        """

        def statvfs(_):
            used = 0
            for d, _, names in os.walk(self.root):
                for name in names:
                    try:
                        used += os.path.getsize(os.path.join(d, name))
                    except OSError:  # removed meanwhile
                        pass
            return mock.Mock(f_bavail=(41 * MIB - used) // 4096, f_blocks=64 * 256, f_frsize=4096)

        with mock.patch("os.statvfs", statvfs):
            store = SharedCacheStore(root=self.root)
            self.addCleanup(store.close)
            ds = CacheDataset(
                list(range(8)),
                Compose([Load(self.log, MIB), AddOne()]),
                runtime_cache=store,
                hash_transform=store.hash_transform,
            )
            self.check_epochs(ds, FORK)
            free = statvfs(None).f_bavail * 4096
        stored = 16 - len(_computed(self.log))  # a stored item is computed once, a refused one in each epoch
        self.assertIn(stored, (1, 2, 3))
        self.assertGreaterEqual(free, 32 * MIB - 5 * MIB)  # the reserve (half), less one item of the other writer

    def test_without_fcntl(self):
        with mock.patch.object(SharedCacheStore, "supported", False):
            with self.assertRaisesRegex(NotImplementedError, "fcntl.*runtime_cache='process'"):
                SharedCacheStore()


if __name__ == "__main__":
    unittest.main()
