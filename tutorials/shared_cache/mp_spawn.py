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
Recipe: DDP ranks started with ``torch.multiprocessing.spawn`` share one cache per node.

    python mp_spawn.py

Every rank calls ``create_shared_cache()`` once, after ``init_process_group``: that is the one collective call. The
ranks and their DataLoader workers then fill and read one store, so each item is computed once on the node.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, create_shared_cache
from monai.transforms import Compose, RandFlipd, Transform

WORLD_SIZE = 2
# The DataLoader workers of a spawned rank are spawned too, unless told otherwise, and a spawned worker imports torch
# and MONAI again when it starts (seconds). On Linux "fork" starts them at once; persistent workers start only once.
WORKER_CONTEXT = "fork" if sys.platform.startswith("linux") else None


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


def rank_main(rank: int, world_size: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        store = create_shared_cache()  # COLLECTIVE: every rank calls it once, here
        log = os.path.join(tmp, f"rank{rank}.log")
        data = [{"id": i} for i in range(16)]
        os.environ["RECIPE_EXECUTION_LOG"] = log  # this rank's log; DataLoader workers inherit it
        transform = Compose([Load(), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
        ds = CacheDataset(data, transform, runtime_cache=store)  # no collective call in the constructor

        sampler = DistributedSampler(ds, shuffle=True, seed=0)
        loader = DataLoader(
            ds,
            batch_size=2,
            sampler=sampler,
            num_workers=2,
            multiprocessing_context=WORKER_CONTEXT,
            persistent_workers=True,
        )
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in loader:
                assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())

        # what happened on the node: one store, and every item computed once by one of the ranks or workers
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (store.path, executions(log)))
        if rank == 0:
            paths = {path for path, _ in gathered}
            computed = [n for _, n in gathered]
            print(f"stores: {sorted(paths)}  computed per rank: {computed}")
            assert len(paths) == 1
            assert sum(computed) == len(data)
        dist.barrier()  # optional: the store is removed when the last rank closes it or exits
        store.close()
    finally:
        dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # raises in the parent if any rank fails
        torch.multiprocessing.spawn(rank_main, args=(WORLD_SIZE, tmp), nprocs=WORLD_SIZE)
    print("ok")


if __name__ == "__main__":
    main()
