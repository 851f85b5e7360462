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
DDP training with one runtime cache per node, shared by all ranks and their DataLoader workers.

Run on one machine (CPU with gloo, or GPUs with nccl)::

    torchrun --nproc_per_node=2 examples/shared_cache_ddp.py

The script trains a small 3D UNet with ``DistributedDataParallel`` twice on the same synthetic NIfTI dataset (made
on first use, by rank 0 only, in ``examples/data``), with a real MONAI pipeline: ``LoadImaged``,
``EnsureChannelFirstd``, ``Spacingd`` and ``ScaleIntensityd`` (deterministic, so cached) then
``RandCropByPosNegLabeld`` (random, run at every epoch). Each DataLoader uses a ``DistributedSampler`` and worker
processes.

1. ``per-rank``: ``CacheDataset(..., runtime_cache="process")`` on every rank. Each rank has its own store, shared
   only with its own workers, so every rank computes and holds (in ``/dev/shm``) each item it meets.
2. ``shared``: ``CacheDataset(..., runtime_cache=create_shared_cache())``. ``create_shared_cache`` is the one
   explicit *collective* call (every rank calls it once); the ranks of the node then share one store, so every item
   is computed once per node and held once, whichever rank or worker meets it first.

For each run it prints the time of every epoch, how many times the deterministic transforms ran (counted by a
small transform at the head of the deterministic chain), the total proportional set size (PSS, from
``/proc/<pid>/smaps_rollup``) of all ranks and their DataLoader workers, measured at the last batch of every epoch
while the workers are alive, and the size of the cache in shared memory (which no process's PSS shows, since the
cache files are only mapped while an item is being read). A plot of epoch times and memory is saved in
``examples/output``.

Flags scale the run up: ``--num-items``, ``--size``, ``--epochs``, ``--workers`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, create_test_image_3d
from monai.data.cache_store import SharedCacheStore
from monai.data.shared_cache import create_shared_cache
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandCropByPosNegLabeld,
    ScaleIntensityd,
    Spacingd,
    Transform,
)
from monai.utils import set_determinism

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1024 * 1024


class CountExecutions(Transform):
    """Deterministic pass-through that appends one line to ``log`` each time it runs (``O_APPEND`` is atomic)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, data: dict) -> dict:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.path.basename(str(data['image']))} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return data


def count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


# -- memory: PSS of a process and all its descendants ------------------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(pid: int) -> tuple[int, int]:
    """The summed PSS of ``pid`` and all its descendants (e.g. DataLoader workers), and how many processes."""
    children = _children_map()
    todo, total, count = [pid], 0, 0
    while todo:
        p = todo.pop()
        total += _pss_bytes(p)
        count += 1
        todo.extend(children.get(p, []))
    return total, count


# -- data ------------------------------------------------------------------------------------------------------------


def make_data(data_dir: str, num_items: int, size: int, rank: int) -> list[dict[str, str]]:
    """Synthetic 3D images and labels as NIfTI files, written by rank 0 only; the other ranks wait at a barrier."""
    import nibabel as nib

    files = [
        {"image": os.path.join(data_dir, f"img{i:03d}.nii.gz"), "label": os.path.join(data_dir, f"seg{i:03d}.nii.gz")}
        for i in range(num_items)
    ]
    manifest = os.path.join(data_dir, f"manifest-{num_items}-{size}.json")
    if rank == 0 and not os.path.exists(manifest):
        os.makedirs(data_dir, exist_ok=True)
        rs = np.random.RandomState(0)
        items = tqdm(files, desc="writing synthetic NIfTI") if tqdm is not None else files
        for item in items:
            im, seg = create_test_image_3d(size, size, size, num_seg_classes=1, rad_max=size // 6, random_state=rs)
            affine = np.diag([1.0, 1.0, 1.0, 1.0])
            nib.Nifti1Image(im.astype(np.float32), affine).to_filename(item["image"])
            nib.Nifti1Image(seg.astype(np.uint8), affine).to_filename(item["label"])
        with open(manifest, "w") as f:
            json.dump({"num_items": num_items, "size": size}, f)
    dist.barrier()
    return files


def make_transform(log: str, crop: int) -> Compose:
    keys = ["image", "label"]
    return Compose(
        [
            CountExecutions(log),  # deterministic: counted once per computed (cached) item
            LoadImaged(keys, image_only=True),
            EnsureChannelFirstd(keys),
            Spacingd(keys, pixdim=(1.25, 1.25, 1.25), mode=("bilinear", "nearest")),
            ScaleIntensityd("image"),
            # the first random transform: everything before it is cached, everything from it runs every epoch
            RandCropByPosNegLabeld(
                keys, label_key="label", spatial_size=(crop, crop, crop), pos=1, neg=1, num_samples=2
            ),
        ]
    )


# -- one training run ------------------------------------------------------------------------------------------------


def train_run(
    name: str, args: argparse.Namespace, files: list[dict[str, str]], device: torch.device, rank: int, world: int
) -> dict[str, Any]:
    log = os.path.join(args.out_dir, f"executions-{name}.log")
    if rank == 0 and os.path.exists(log):
        os.unlink(log)
    dist.barrier()

    if name == "shared":
        store = create_shared_cache()  # COLLECTIVE: every rank calls it, once, here
    else:
        # a private store per rank, shared with the rank's own workers only: what runtime_cache="process" makes,
        # created here so that its size can be reported
        store = SharedCacheStore()
    ds = CacheDataset(files, make_transform(log, args.crop), runtime_cache=store, progress=False)

    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)

    set_determinism(seed=args.seed)
    net = UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
    model = DistributedDataParallel(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loss_fn = DiceLoss(sigmoid=True)

    epoch_times: list[float] = []
    pss: list[int] = []
    losses: list[float] = []
    nprocs = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        start = time.perf_counter()
        batches = len(loader)
        it = loader
        if rank == 0 and tqdm is not None:
            it = tqdm(loader, total=batches, desc=f"{name} epoch {epoch + 1}/{args.epochs}", leave=False)
        mem = (0, 0)
        epoch_loss = 0.0
        for step, batch in enumerate(it):
            image, label = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad()
            loss = loss_fn(model(image), label)
            loss.backward()
            opt.step()
            epoch_loss += loss.item()
            if step == batches - 1:  # the workers are still alive at the last batch
                mem = tree_pss(os.getpid())
        dist.barrier()
        epoch_times.append(time.perf_counter() - start)
        mems: list[Any] = [None] * world
        dist.all_gather_object(mems, mem)
        pss.append(sum(m[0] for m in mems))
        losses.append(epoch_loss / max(batches, 1))
        if epoch == 0:
            nprocs = sum(m[1] for m in mems)

    # what the caches hold in shared memory: one store per rank, or one per node
    stats = (store.path, store.stats()["nbytes"])
    all_stats: list[Any] = [None] * world
    dist.all_gather_object(all_stats, stats)
    sizes = {path: nbytes for path, nbytes in all_stats if path}  # the ranks of a node report the same store
    dist.barrier()
    executions = count_lines(log)

    # per-rank: this rank's own store; shared: the node's store goes when its last rank closes it (or exits)
    store.close()
    del it, loader, sampler, ds
    gc.collect()
    dist.barrier()
    return {
        "name": name,
        "epoch_times": epoch_times,
        "pss_bytes": pss,
        "losses": losses,
        "executions": executions,
        "cache_bytes": sum(sizes.values()),
        "stores": len(sizes),
        "processes": nprocs,
    }


def report(results: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    print(
        f"\n{world} ranks x {args.workers} DataLoader workers, {args.num_items} items of {args.size}^3 voxels, "
        f"{args.epochs} epochs"
    )
    header = f"{'run':<9} {'epoch':>5} {'time [s]':>9} {'PSS of ranks+workers [MiB]':>27} {'loss':>7}"
    print(header)
    print("-" * len(header))
    for r in results:
        for e, (t, p, loss) in enumerate(zip(r["epoch_times"], r["pss_bytes"], r["losses"])):
            print(f"{r['name']:<9} {e + 1:>5} {t:>9.2f} {p / MIB:>27.1f} {loss:>7.3f}")
    print()
    for r in results:
        print(
            f"{r['name']:<9} deterministic-transform executions: {r['executions']:>4}   "
            f"cache stores: {r['stores']}   cache in shared memory: {r['cache_bytes'] / MIB:7.1f} MiB   "
            f"total time: {sum(r['epoch_times']):6.2f} s   processes measured: {r['processes']}"
        )


def plot(results: list[dict[str, Any]], out_dir: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for r in results:
        epochs = list(range(1, len(r["epoch_times"]) + 1))
        axes[0].plot(epochs, r["epoch_times"], marker="o", label=r["name"])
        axes[1].plot(epochs, [p / MIB for p in r["pss_bytes"]], marker="o", label=r["name"])
    names = [r["name"] for r in results]
    axes[2].bar(names, [r["cache_bytes"] / MIB for r in results], color=["C0", "C1"][: len(results)])
    for i, r in enumerate(results):
        axes[2].text(i, r["cache_bytes"] / MIB, f"{r['executions']} computed", ha="center", va="bottom")
    axes[0].set(title="epoch time", xlabel="epoch", ylabel="seconds")
    axes[1].set(title="PSS of all ranks + DataLoader workers", xlabel="epoch", ylabel="MiB")
    axes[2].set(title="cache in shared memory (/dev/shm)", ylabel="MiB")
    for ax in axes[:2]:
        ax.legend()
        ax.set_xticks(epochs)
    fig.tight_layout()
    path = os.path.join(out_dir, "shared_cache_ddp.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.path.join(HERE, "data"), help="synthetic NIfTI dataset (made once)")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "output"), help="plot, results and execution logs")
    parser.add_argument("--num-items", type=int, default=16, help="number of image/label pairs")
    parser.add_argument("--size", type=int, default=64, help="edge of the cubic images, in voxels")
    parser.add_argument("--crop", type=int, default=32, help="edge of the random training crops")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--batch-size", type=int, default=2, help="items per batch (2 crops each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if "RANK" not in os.environ:
        parser.error("run me with torchrun, e.g.: torchrun --nproc_per_node=2 examples/shared_cache_ddp.py")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # the ranks share the cores with each other and with the DataLoader workers
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    files = make_data(args.data_dir, args.num_items, args.size, rank)

    results = [train_run(name, args, files, device, rank, world) for name in ("per-rank", "shared")]

    if rank == 0:
        report(results, args, world)
        with open(os.path.join(args.out_dir, "shared_cache_ddp.json"), "w") as f:
            json.dump({"args": vars(args), "world": world, "results": results}, f, indent=1)
        path = plot(results, args.out_dir)
        if path:
            print(f"plot: {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
