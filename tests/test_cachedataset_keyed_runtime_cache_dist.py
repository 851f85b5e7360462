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

import torch.distributed as dist
from torch.utils.data import DataLoader

from monai.data import CacheDataset, DistributedSampler, KeyedCache
from monai.data.utils import json_hashing
from monai.transforms import ToTensor
from tests.test_utils import DistCall, DistTestCase


class DictCache(KeyedCache):
    """A keyed cache over a ``Manager().dict()``, which the ranks and their DataLoader workers share."""

    def __init__(self, items) -> None:
        self.items = items

    def get(self, key):
        return self.items.get(key)

    def put(self, key, item) -> None:
        self.items[key] = item


class TestCacheDatasetKeyedRuntimeCacheDist(DistTestCase):
    @DistCall(nnodes=1, nproc_per_node=2, timeout=120)
    def test_ranks_share_a_manager_dict(self):
        """Ranks and their DataLoader workers share one keyed cache: each item is stored once."""
        manager = Manager() if dist.get_rank() == 0 else None
        obj_list = [manager.dict() if manager else None]
        dist.broadcast_object_list(obj_list, src=0)
        data = list(range(10))
        dataset = CacheDataset(
            data=data,
            transform=ToTensor(track_meta=False),
            runtime_cache=DictCache(obj_list[0]),
            hash_transform=json_hashing,
        )
        sampler = DistributedSampler(dataset=dataset, shuffle=True)
        dataloader = DataLoader(
            dataset=dataset, sampler=sampler, batch_size=None, num_workers=2, persistent_workers=True, timeout=120
        )
        for epoch in range(3):
            sampler.set_epoch(epoch)
            self.assertEqual([int(d) for d in dataloader], [data[i] for i in sampler])
            dist.barrier()
        self.assertEqual(sorted(obj_list[0].keys()), sorted(dataset.cache_key(i) for i in data))
        self.assertEqual(sorted(int(v) for v in obj_list[0].values()), data)
        del dataloader  # its workers hold the container: gone before the Manager is
        dist.barrier()
        if manager:
            manager.shutdown()


if __name__ == "__main__":
    unittest.main()
