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
One rank of ``bench_ddp.py``: the training script of MONAI's DDP tutorial, run by the launcher of ``bench_ddp.py``
with a torchrun-like environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and
``PYTHONPATH`` set to the tree of its variant (pristine upstream 1.6.1 or the fork)::

    python benchmarks/bench_ddp_rank.py <config.json>

It writes ``rank<r>.json`` (times, computations, cache statistics) into the config's ``work`` directory. Rank 0
writes the shared store's directory into ``store_dir.txt`` there, for the launcher's memory sampler.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, partition_dataset
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandCropByPosNegLabeld,
    RandRotate90d,
    ScaleIntensityd,
    Transform,
)
from monai.utils import set_determinism


class CountComputations(Transform):
    """
    Deterministic pass-through, the last cached transform: appends one line to ``log`` (``O_APPEND``, atomic for a
    short write) each time an item's cached part is computed, in whichever process. It holds only a path, so it
    pickles, and is not ``Randomizable``, so the cached part ends after it.
    """

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, data: dict) -> dict:
        name = os.path.basename(str(getattr(data["image"], "meta", {}).get("filename_or_obj", "")))
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{name} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return data


def count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def transforms(log: str, crop: int) -> Compose:
    keys = ["image", "label"]
    return Compose(
        [
            LoadImaged(keys, image_only=True),
            EnsureChannelFirstd(keys),
            ScaleIntensityd("image"),
            CountComputations(log),
            # the first random transform: everything before it is cached, everything from it runs at every epoch
            RandCropByPosNegLabeld(keys, "label", spatial_size=(crop,) * 3, pos=1, neg=1, num_samples=2),
            RandRotate90d(keys, prob=0.5, spatial_axes=(0, 2)),
        ]
    )


def main(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    variant, work = cfg["variant"], cfg["work"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # the ranks and their DataLoader workers share the cores
    set_determinism(seed=0)
    log = os.path.join(work, "computations.log")
    transform = transforms(log, cfg["crop"])
    files = cfg["files"]
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid()}

    dist.barrier()
    start = time.perf_counter()  # time to first batch counts from here: the start of the dataset's setup
    store = None
    sampler: DistributedSampler | None = None
    if variant == "upstream_partition":  # each rank caches its own part only, shuffles within it
        part = partition_dataset(files, num_partitions=world, shuffle=True, even_divisible=True, seed=0)[rank]
        ds = CacheDataset(part, transform, num_workers=cfg["cache_threads"], progress=False)
        loader = DataLoader(ds, batch_size=cfg["batch_size"], shuffle=True, num_workers=cfg["workers"])
    else:
        if variant.startswith("shared"):
            from monai.data import create_shared_cache

            store = create_shared_cache()  # collective: every rank calls it once
            if rank == 0:
                with open(os.path.join(work, "store_dir.txt"), "w") as f:
                    f.write(store.path)
        ds = CacheDataset(
            files,
            transform,
            num_workers=cfg["cache_threads"],
            progress=False,
            runtime_cache=store if store is not None else False,
        )
        if variant == "shared_fill":
            ds.fill()  # this rank's share, then the others' items: every item is in the store when it returns
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"])
    out["setup_s"] = time.perf_counter() - start
    dist.barrier()
    out["computations_after_setup"] = count_lines(log)

    net = UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
    model = DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loss_fn = DiceLoss(sigmoid=True)
    out["epoch_s"], out["computations_after_epoch"], out["loss"] = [], [], []
    for epoch in range(cfg["epochs"]):
        if sampler is not None:
            sampler.set_epoch(epoch)
        dist.barrier()
        epoch_start, total, steps = time.perf_counter(), 0.0, 0
        for batch in loader:
            if "first_batch_s" not in out:
                out["first_batch_s"] = time.perf_counter() - start
                # also from the start of this process (its launch, set by the launcher): imports, init included
                out["first_batch_from_launch_s"] = time.time() - float(os.environ["BENCH_DDP_LAUNCHED"])
            opt.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        dist.barrier()
        out["epoch_s"].append(time.perf_counter() - epoch_start)
        out["computations_after_epoch"].append(count_lines(log))
        out["loss"].append(total / max(steps, 1))
    if hasattr(ds, "cache_stats"):
        out["cache_stats"] = ds.cache_stats()
    del loader, ds
    if store is not None:
        store.close()  # the directory goes with the last rank that closes it
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
