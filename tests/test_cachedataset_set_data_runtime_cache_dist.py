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
from torch.utils.data import DataLoader  # batch_size=None: the items as they are

from monai.data import CacheDataset, DistributedSampler
from monai.transforms import ToTensor
from tests.test_utils import DistCall, DistTestCase


class TestCacheDatasetSetDataRuntimeCacheDist(DistTestCase):
    @DistCall(nnodes=1, nproc_per_node=2, timeout=120)
    def test_ranks_set_data(self):
        """Ranks that share one container call ``set_data`` between epochs: each gets the new data's items."""
        manager = Manager() if dist.get_rank() == 0 else None
        obj_list = [manager.list() if manager else None]
        dist.broadcast_object_list(obj_list, src=0)
        dataset = CacheDataset(data=list(range(6)), transform=ToTensor(track_meta=False), runtime_cache=obj_list[0])
        for data in (list(range(6)), [10 + i for i in range(6)], [5, 4, 3]):
            dist.barrier()  # no rank reads the old items any more
            dataset.set_data(data)
            dist.barrier()  # every rank emptied the slots: none empties an item that another one stored
            sampler = DistributedSampler(dataset=dataset, shuffle=False)
            dataloader = DataLoader(dataset=dataset, sampler=sampler, batch_size=None, num_workers=1, timeout=120)
            self.assertEqual([int(d) for d in dataloader], [data[i] for i in sampler])
        dist.barrier()
        self.assertEqual(sorted(int(dataset._cache[i]) for i in range(3)), [3, 4, 5])  # every rank's items
        del dataloader  # its workers hold the container: gone before the Manager is
        dist.barrier()
        if manager:
            manager.shutdown()


if __name__ == "__main__":
    unittest.main()
