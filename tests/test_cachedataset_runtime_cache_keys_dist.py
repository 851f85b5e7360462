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

from monai.data import CacheDataset
from monai.transforms import ToTensor
from tests.test_utils import DistCall, DistTestCase


class TestCacheDatasetRuntimeCacheKeysDist(DistTestCase):
    @DistCall(nnodes=1, nproc_per_node=2, timeout=120)
    def test_ranks_with_other_data(self):
        """Ranks over their own data (another split) share one container: each reads only its own items."""
        manager = Manager() if dist.get_rank() == 0 else None
        obj_list = [manager.list([None] * 4) if manager else None]
        dist.broadcast_object_list(obj_list, src=0)
        data = [100 * dist.get_rank() + i for i in range(4)]
        dataset = CacheDataset(data=data, transform=ToTensor(track_meta=False), runtime_cache=obj_list[0])
        for order in (data, data, data[::-1]):
            if order != dataset.data:
                dataset.set_data(order)  # the same container, resynced
            dataloader = DataLoader(
                dataset=dataset, batch_size=None, num_workers=2, persistent_workers=True, timeout=120
            )
            for _ in range(2):
                self.assertEqual([int(d) for d in dataloader], order)
            dist.barrier()
        del dataloader  # its workers hold the container: gone before the Manager is
        dist.barrier()
        if manager:
            manager.shutdown()


if __name__ == "__main__":
    unittest.main()
