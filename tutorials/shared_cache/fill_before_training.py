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
Recipe: fill one cache per node before training, the work split across the node's ranks, and read its statistics.

    torchrun --standalone --nproc_per_node=2 fill_before_training.py

Every rank calls ``create_shared_cache()`` once, then ``ds.fill()``: each rank computes its share of the items (with its
share of the node's CPUs in threads, and a progress bar), skips the items another rank is computing and waits for them
at the end, so when ``fill`` returns the node's cache is full and every item was computed once on the machine. ``fill``
makes no collective call. The first epoch then runs at cached speed: no rank computes an item in training.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, create_shared_cache
from monai.transforms import Compose, RandFlipd, Transform


class Load(Transform):
    """Deterministic, so its output is cached. Appends one line per execution to ``log``, to count them."""

    # the log path is read when called, not kept as an attribute (an attribute that differs by rank would be part of
    # the cache key, and the ranks would share nothing)
    def __call__(self, d: dict) -> dict:
        time.sleep(0.05)  # as reading and resampling a volume would take
        with open(os.environ["RECIPE_EXECUTION_LOG"], "a") as f:
            f.write(f"{d['id']}\n")
        return {"id": d["id"], "image": torch.full((1, 64, 64), float(d["id"]))}


def executions(log: str) -> int:
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return len(f.read().split())


def train(log: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = create_shared_cache()  # COLLECTIVE: every rank calls it once, here

    data = [{"id": i} for i in range(32)]
    os.environ["RECIPE_EXECUTION_LOG"] = log  # this rank's log; its fill threads and DataLoader workers write to it
    transform = Compose([Load(), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    ds = CacheDataset(data, transform, runtime_cache=store, num_workers=2, progress=rank == 0)
    ds.fill()  # this rank's share, then the others' items as they are published: no collective call
    filled_by_me = executions(log)

    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())
        if rank == 0:
            print(f"epoch {epoch}: items computed by rank 0 so far: {executions(log)}")

    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (filled_by_me, executions(log)))
    if rank == 0:
        print(f"computed by each rank during fill: {[f for f, _ in gathered]}, in total: {[n for _, n in gathered]}")
        assert sum(n for _, n in gathered) == len(data), "every item computed once on the machine, none in training"
        assert all(f > 0 for f, _ in gathered), "the ranks split the work"
    store.close()  # optional: the store goes when the last rank closes it or exits


def main() -> None:
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run me with: torchrun --standalone --nproc_per_node=2 fill_before_training.py")
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
