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
Recipe: your own ``multiprocessing`` ``ListProxy``, made in the parent and shared by ``mp.spawn`` ranks.

    python bring_your_own_listproxy.py

This is the pattern upstream MONAI asks for since 1.1. With the upstream series it is checked: the list may have any
length (a shorter one is grown in place to ``cache_num``), may hold anything (only items stored for the very same input
and transforms are served), and every filled slot is a ``(key, item)`` tuple. For new code prefer
``create_shared_cache()`` (no server process, no authkey, no per-tensor file descriptors, each item computed once).
"""

from __future__ import annotations

import os
import sys
import tempfile
from multiprocessing import Manager

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader
from monai.data.utils import pickle_hashing
from monai.transforms import Compose, RandFlipd, Transform

WORLD_SIZE = 2
WORKER_CONTEXT = "fork" if sys.platform.startswith("linux") else None  # see mp_spawn.py


class Load(Transform):
    """Deterministic, so its output is cached. Appends one line per execution to a log, to count them."""

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


def rank_main(rank: int, world_size: int, tmp: str, cache) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        os.environ["RECIPE_EXECUTION_LOG"] = os.path.join(tmp, f"rank{rank}.log")  # DataLoader workers inherit it
        data = [{"id": i} for i in range(16)]
        transform = Compose([Load(), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
        ds = CacheDataset(data, transform, runtime_cache=cache)  # grows the shared list in place: len 16
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
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    with Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        # any length, any content: ["stale", None] is grown to 16 slots, and "stale" is never served
        cache = manager.list(["stale", None])
        torch.multiprocessing.spawn(rank_main, args=(WORLD_SIZE, tmp, cache), nprocs=WORLD_SIZE)

        # the parent sees what the ranks cached: one (key, item) tuple per slot, the key being
        # CacheDataset.cache_key: hash_func of the input, then hash_transform of the cached transforms
        entries = list(cache)
        assert len(entries) == 16 and all(isinstance(e, tuple) and len(e) == 2 for e in entries)
        assert [item["id"] for _, item in entries] == list(range(16))
        inputs = [pickle_hashing({"id": i}).decode() for i in range(16)]  # an input that names no file: by pickle
        assert all(key.startswith(h) for (key, _), h in zip(entries, inputs))
        transforms = {key[len(h) :] for (key, _), h in zip(entries, inputs)}
        assert len(transforms) == 1 and transforms != {""}, "both ranks' transforms have the same hash"
        key, item = entries[0]
        print(f"slot 0: key={key!r} item id={item['id']}")
        computed = sum(executions(os.path.join(tmp, f"rank{r}.log")) for r in range(WORLD_SIZE))
        # a ListProxy has no claims: a rank may compute an item that another rank is computing at the same time
        print(f"computed {computed} times for 16 items")
        assert computed >= 16
    print("ok")


if __name__ == "__main__":
    main()
