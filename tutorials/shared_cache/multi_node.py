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
r"""
Recipe: several machines, one cache per machine ("node").

On each machine, with the usual torchrun flags (here 2 machines of 2 ranks)::

    torchrun --nnodes=2 --node_rank=<0 or 1> --nproc_per_node=2 \
        --master_addr=<address of machine 0> --master_port=29500 multi_node.py

``create_shared_cache()`` groups the ranks by node identity: ``node_id=`` if given, else the environment variable
``MONAI_CACHE_NODE_ID``, else the host name. Each node gets its own store, which only its ranks use; no cached data
crosses the network. To try it on one machine, start both "nodes" there and tell them apart by their node identity::

    MONAI_CACHE_NODE_ID=node0 torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 \
        --master_addr=127.0.0.1 --master_port=29500 multi_node.py &
    MONAI_CACHE_NODE_ID=node1 torchrun --nnodes=2 --node_rank=1 --nproc_per_node=1 \
        --master_addr=127.0.0.1 --master_port=29500 multi_node.py
"""

from __future__ import annotations

import os
import socket
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
    # what create_shared_cache() uses by default; pass node_id=... to choose it yourself, e.g. when the machines
    # of a cluster do not have distinct host names
    node = os.environ.get("MONAI_CACHE_NODE_ID") or socket.gethostname()
    store = create_shared_cache()  # COLLECTIVE: every rank of every node calls it once, here

    data = [{"id": i} for i in range(16)]
    os.environ["RECIPE_EXECUTION_LOG"] = log  # this rank's log; DataLoader workers inherit it
    transform = Compose([Load(), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    ds = CacheDataset(data, transform, runtime_cache=store)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
    seen: set[int] = set()
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in loader:
            assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())
            seen.update(int(i) for i in batch["id"])

    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (node, store.path, executions(log), seen))
    if rank == 0:
        for n in sorted({g[0] for g in gathered}):
            mine = [g for g in gathered if g[0] == n]
            paths = {g[1] for g in mine}
            met = set().union(*(g[3] for g in mine))
            computed = sum(g[2] for g in mine)
            print(f"node {n}: store {sorted(paths)}, met {len(met)} items, computed {computed}")
            assert len(paths) == 1, "one store per node"
            assert computed == len(met), "each item computed once per node"
        stores = [g[1] for g in gathered]
        assert len(set(stores)) == len({g[0] for g in gathered}), "no store shared by two nodes"
    store.close()


def main() -> None:
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run me with torchrun, see the docstring")
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
