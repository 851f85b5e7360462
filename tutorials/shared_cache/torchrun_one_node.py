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
"""
Recipe: DDP ranks started by ``torchrun`` on one machine share one cache.

    torchrun --standalone --nproc_per_node=2 torchrun_one_node.py

(``torchrun`` is ``python -m torch.distributed.run``.) Every rank calls ``create_shared_cache()`` once, after
``init_process_group``; the ranks and their DataLoader workers then share one store, so every item is computed once
on the machine and held once in its memory. With GPUs the same code runs on nccl: the exchange inside
``create_shared_cache`` goes over a short-lived gloo group, and the cache holds CPU data.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, create_shared_cache
from monai.transforms import Compose, RandFlipd, Transform


class Load(Transform):
    """Deterministic, so its output is cached. Appends one line per execution to ``log``, to count them."""

    # the log path is read when called, not kept as an attribute: the cached transforms must be configured the same
    # on every rank, since a hash of them is part of every cache key (a per-rank attribute would split the cache)
    def __call__(self, d: dict) -> dict:
        with open(os.environ["RECIPE_EXECUTION_LOG"], "a") as f:
            f.write(f"{d['id']}\n")
        return {"id": d["id"], "image": torch.full((1, 8, 8), float(d["id"]))}


def executions(log: str) -> int:
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return len(f.read().split())


def train(log: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = create_shared_cache()  # COLLECTIVE: every rank calls it once, here

    data = [{"id": i} for i in range(16)]
    os.environ["RECIPE_EXECUTION_LOG"] = log  # this rank's log; DataLoader workers inherit it
    transform = Compose([Load(), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    ds = CacheDataset(data, transform, runtime_cache=store)  # no collective call in the constructor
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in loader:
            assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())

    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (store.path, executions(log)))
    if rank == 0:
        paths = {path for path, _ in gathered}
        computed = [n for _, n in gathered]
        print(f"stores: {sorted(paths)}  computed per rank: {computed}")
        assert len(paths) == 1, "one store for the machine"
        assert sum(computed) == len(data), "every item computed once on the machine"
    store.close()  # optional: the store goes when the last rank closes it or exits


def main() -> None:
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run me with: torchrun --standalone --nproc_per_node=2 torchrun_one_node.py")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        with tempfile.TemporaryDirectory() as tmp:  # this rank's execution log
            train(os.path.join(tmp, "executions.log"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if os.environ["RANK"] == "0":
        print("ok")


if __name__ == "__main__":
    main()
