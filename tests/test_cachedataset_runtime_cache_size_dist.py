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
import torch.distributed as dist

from monai.data import CacheDataset, DataLoader, DistributedSampler
from monai.transforms import ToTensor
from tests.test_utils import DistCall, DistTestCase


class TestCacheDatasetRuntimeCacheSizeDist(DistTestCase):
    @DistCall(nnodes=1, nproc_per_node=2, timeout=120)
    def test_empty_shared_container(self):
        """#5633: ranks share an empty ``Manager().list()``, resized in place, read by DataLoader workers."""
        data = [1, 2, 3, 4, 5]
        manager = Manager() if dist.get_rank() == 0 else None
        obj_list = [manager.list() if manager else None]
        dist.broadcast_object_list(obj_list, src=0)
        dataset = CacheDataset(data=data, transform=ToTensor(track_meta=False), runtime_cache=obj_list[0])
        self.assertGreaterEqual(len(obj_list[0]), 5)  # two ranks may grow it at once: slots past 5 are never read
        sampler = DistributedSampler(dataset=dataset, shuffle=False, even_divisible=False)
        dataloader = DataLoader(
            dataset=dataset, sampler=sampler, batch_size=1, num_workers=2, persistent_workers=True, timeout=120
        )
        for _ in range(2):
            got = [int(d[0]) for d in dataloader]
            self.assertEqual(got, data[dist.get_rank() :: 2])
            dist.barrier()
        for j in range(dataset.cache_num):  # every rank's items, in the shared slots (those past cache_num unused)
            c = dataset._cache[j]
            self.assertIsInstance(c, torch.Tensor)
            self.assertEqual(int(c), j + 1)
        del dataloader  # its workers hold the container: gone before the Manager is
        dist.barrier()
        if manager:
            manager.shutdown()


if __name__ == "__main__":
    unittest.main()
