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
DDP training with upstream MONAI's default cache (every rank caches every item) against one runtime cache per node,
shared by all ranks and their DataLoader workers.

Run on one machine (CPU with gloo, or GPUs with nccl), from the repository after ``pip install .``::

    torchrun --nproc_per_node=2 examples/shared_cache_ddp.py

The script trains a small 3D UNet with ``DistributedDataParallel`` three times on the same synthetic NIfTI dataset
(made on first use, by rank 0 only, in ``examples/data``; items of about 66 MiB once cached), with a real MONAI
pipeline: ``LoadImaged``, ``EnsureChannelFirstd``, ``Spacingd`` and ``ScaleIntensityd`` (deterministic, so cached)
then ``RandCropByPosNegLabeld`` (random, run at every epoch). Each DataLoader uses a ``DistributedSampler`` and
worker processes.

1. ``upstream default``: ``CacheDataset(..., runtime_cache=False, copy_cache=True)``, upstream's code: the
   constructor of every rank computes and holds every item, and each worker deep-copies the item it reads.
2. ``shared, lazy``: ``CacheDataset(..., runtime_cache=create_shared_cache())``. ``create_shared_cache`` is the one
   explicit *collective* call (every rank calls it once); the ranks of the node then share one store in
   ``/dev/shm``, so every item is computed once per node, in the first epoch, by whichever rank or worker meets it
   first, and held once.
3. ``shared + fill()``: the same, and ``ds.fill()`` before training: the ranks compute their shares of the items
   (no collective call) and each returns when the node's cache is full.

It prints, per variant, the setup (dataset construction, ``fill()``) and every epoch: the time, how many times the
cached transforms ran in all processes (counted by a small transform at the end of the cached chain), the peak
memory footprint of the whole job (``benchmarks/procmem.py``, sampled by a thread of rank 0 every 0.25 s: anonymous
and shared memory of torchrun's agent, the ranks and their workers, the cache's files in ``/dev/shm`` included, each
page once), and ``ds.cache_stats()`` of every rank. Then a summary table (the time to first batch counts from the
start of the setup), ``shared_cache_ddp.json`` and a plot in ``examples/output``: footprint per phase, time to first
batch and epoch times, upstream's default beside ours.

What to expect (2 CPU ranks, 16 items): upstream's default computes every item once per rank and holds a copy per
rank; the shared store computes each item once per node and holds it once, one copy of the data less. Lazily, the
first batch comes soonest, but the first epoch computes the items in the 4 DataLoader workers at once: it is the
longest epoch and has the highest peak. ``fill()`` computes them before training, one thread per rank
(``--cache-threads``).
The losses are identical: every variant trains on the same items.

Flags scale the run: ``--num-items``, ``--size``, ``--epochs``, ``--workers`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, create_shared_cache, create_test_image_3d
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import procmem  # the repository's memory sampler (standard library only)
except ImportError:  # pragma: no cover - the example was copied out of the repository
    procmem = None  # type: ignore[assignment]

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

HERE = Path(__file__).resolve().parent
MIB = 1024 * 1024
VARIANTS = {
    "upstream default": "CacheDataset(runtime_cache=False, copy_cache=True): each rank computes and holds every item",
    "shared, lazy": "CacheDataset(runtime_cache=create_shared_cache()): one store per node, filled in epoch 1",
    "shared + fill()": "the same, then ds.fill(): the ranks fill the node's store before training",
}


class CountComputations(Transform):
    """Deterministic pass-through that appends one line to ``log`` each time it runs (``O_APPEND`` is atomic)."""

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
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system, so that one variant's garbage is not in the next's footprint."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# -- data ------------------------------------------------------------------------------------------------------------


def make_data(data_dir: str, num_items: int, size: int, rank: int) -> list[dict[str, str]]:
    """Synthetic 3D images and labels as NIfTI files, written by rank 0 only; the other ranks wait at a barrier."""
    import nibabel as nib

    folder = os.path.join(data_dir, f"{num_items}x{size}")
    files = [
        {"image": os.path.join(folder, f"img{i:03d}.nii.gz"), "label": os.path.join(folder, f"seg{i:03d}.nii.gz")}
        for i in range(num_items)
    ]
    if rank == 0 and not os.path.exists(os.path.join(folder, "done.json")):
        os.makedirs(folder, exist_ok=True)
        rs = np.random.RandomState(0)
        items = tqdm(files, desc="writing synthetic NIfTI") if tqdm is not None else files
        for item in items:
            im, seg = create_test_image_3d(size, size, size, num_seg_classes=1, rad_max=size // 6, random_state=rs)
            nib.Nifti1Image(im.astype(np.float32), np.eye(4)).to_filename(item["image"])
            nib.Nifti1Image(seg.astype(np.uint8), np.eye(4)).to_filename(item["label"])
        with open(os.path.join(folder, "done.json"), "w") as f:
            json.dump({"num_items": num_items, "size": size}, f)
    dist.barrier()
    return files


def make_transform(log: str, crop: int) -> Compose:
    keys = ["image", "label"]
    return Compose(
        [
            LoadImaged(keys, image_only=True),
            EnsureChannelFirstd(keys),
            Spacingd(keys, pixdim=(1.25, 1.25, 1.25), mode=("bilinear", "nearest")),
            ScaleIntensityd("image"),
            CountComputations(log),  # the last deterministic transform: counts every computed (cached) item
            # the first random transform: everything before it is cached, everything from it runs every epoch
            RandCropByPosNegLabeld(keys, label_key="label", spatial_size=(crop,) * 3, pos=1, neg=1, num_samples=2),
        ]
    )


# -- measuring -------------------------------------------------------------------------------------------------------


class Phase:
    """Rank 0 samples the footprint of the whole job (torchrun's agent and all below it) during one phase."""

    def __init__(self, root: int, store_dir: str | None) -> None:
        dirs = [store_dir] if store_dir else []
        self.sampler = procmem.PeakSampler(root, store_dirs=dirs, interval=0.25).start() if procmem and root else None

    def stop(self) -> int | None:
        return self.sampler.stop()["footprint_bytes"] if self.sampler is not None else None


def gather(obj: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def stats_lines(all_stats: list[dict[str, Any]]) -> list[str]:
    """``ds.cache_stats()`` of every rank, two lines each: this process's counts, and the dataset's and cache's."""
    lines = []
    for rank, stats in enumerate(all_stats):
        proc, cache, dataset = stats["process"], dict(stats["cache"]), stats["dataset"]
        filled, capacity, nbytes = dataset["filled"], dataset["capacity"], cache.pop("nbytes")
        cache.pop("filled")
        size = "?" if nbytes is None else f"{nbytes / MIB:.1f} MiB"
        counts = ", ".join(f"{k} {v}" for k, v in proc.items())
        others = ", ".join(f"{k} {v}" for k, v in cache.items())
        prefix = f"    rank {rank} ds.cache_stats()  "
        lines.append(f"{prefix}process: {counts}")
        lines.append(f"{' ' * len(prefix)}dataset: filled {filled}/{capacity}; cache: {size}, {others}")
    return lines


def mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:,.0f} MiB"


# -- one training run ------------------------------------------------------------------------------------------------


def train_run(
    name: str, args: argparse.Namespace, files: list, device: torch.device, rank: int, world: int, root: int
) -> dict[str, Any]:
    log = os.path.join(args.out_dir, "computations-" + re.sub(r"\W+", "-", name).strip("-") + ".log")
    if rank == 0:
        print(f"\n== {name}: {VARIANTS[name]}", flush=True)
        if os.path.exists(log):
            os.unlink(log)
    dist.barrier()

    start = time.perf_counter()  # setup and time to first batch count from here
    store = None if name == "upstream default" else create_shared_cache()  # COLLECTIVE: every rank, once
    phase = Phase(root if rank == 0 else 0, store.path if store is not None else None)
    ds = CacheDataset(
        files,
        make_transform(log, args.crop),
        runtime_cache=store if store is not None else False,
        copy_cache=True,
        num_workers=args.cache_threads,
        progress=rank == 0,
    )
    if name == "shared + fill()":
        ds.fill()  # this rank's share, then the others': returns when every item is in the node's store
    setup_s = time.perf_counter() - start
    dist.barrier()
    result: dict[str, Any] = {"name": name, "setup_s": max(gather(setup_s, world)), "epoch_s": [], "loss": []}
    result["footprint"] = [phase.stop()]
    result["computed"] = [count_lines(log)]
    stats = gather(ds.cache_stats(), world)
    result["cache_stats"] = [stats]
    if rank == 0:
        print(
            f"  setup   {result['setup_s']:6.1f} s  computed {result['computed'][0]:3d}  "
            f"peak footprint {mib(result['footprint'][0])}",
            flush=True,
        )
        print("\n".join(stats_lines(stats)), flush=True)

    sampler: DistributedSampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    set_determinism(seed=args.seed)
    net = UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
    model = DistributedDataParallel(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loss_fn = DiceLoss(sigmoid=True)
    first_batch = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        phase = Phase(root if rank == 0 else 0, store.path if store is not None else None)
        epoch_start, epoch_loss, steps = time.perf_counter(), 0.0, 0
        it = loader
        if rank == 0 and tqdm is not None:
            it = tqdm(loader, desc=f"{name} epoch {epoch + 1}/{args.epochs}", leave=False)
        for batch in it:
            if first_batch is None:
                first_batch = time.perf_counter() - start
            image, label = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad()
            loss = loss_fn(model(image), label)
            loss.backward()
            opt.step()
            epoch_loss, steps = epoch_loss + loss.item(), steps + 1
        dist.barrier()
        result["epoch_s"].append(time.perf_counter() - epoch_start)
        result["footprint"].append(phase.stop())
        result["computed"].append(count_lines(log))
        result["loss"].append(sum(gather(epoch_loss / max(steps, 1), world)) / world)
        stats = gather(ds.cache_stats(), world)
        result["cache_stats"].append(stats)
        if rank == 0:
            new = result["computed"][-1] - result["computed"][-2]
            print(
                f"  epoch {epoch + 1} {result['epoch_s'][-1]:6.1f} s  computed {new:3d}  "
                f"peak footprint {mib(result['footprint'][-1])}  loss {result['loss'][-1]:.4f}",
                flush=True,
            )
            print("\n".join(stats_lines(stats)), flush=True)
    result["first_batch_s"] = max(gather(first_batch, world))

    del it, loader, sampler, ds
    if store is not None:
        store.close()  # the node's store goes when its last rank closes it (or exits)
    release_freed_memory()
    dist.barrier()
    return result


# -- report ----------------------------------------------------------------------------------------------------------


def report(results: list[dict[str, Any]], args: argparse.Namespace, world: int, baseline: int | None, copy: int):
    item = copy / max(args.num_items, 1)
    print(
        f"\n{world} ranks x {args.workers} DataLoader workers, {args.num_items} items of {mib(int(item))} once cached "
        f"(one copy of the data: {mib(copy)}), {args.epochs} epochs; footprint before any dataset: {mib(baseline)}"
    )
    epochs = [f"epoch {e + 1} s" for e in range(args.epochs)]
    head = ["variant", "computed", "setup s", "1st batch s", *epochs, "peak footprint", "x upstream", "loss"]
    peaks = [max((f for f in r["footprint"] if f is not None), default=None) for r in results]
    rows = []
    for r, peak in zip(results, peaks):
        ratio = f"{peak / peaks[0]:.2f}" if peak and peaks[0] else "n/a"
        row = [r["name"], str(r["computed"][-1]), f"{r['setup_s']:.1f}", f"{r['first_batch_s']:.1f}"]
        rows.append(row + [f"{t:.1f}" for t in r["epoch_s"]] + [mib(peak), ratio, f"{r['loss'][-1]:.4f}"])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))


def plot(results: list[dict[str, Any]], args: argparse.Namespace, baseline: int | None, copy: int) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    colors = ["0.55", "C0", "C2"]  # upstream's default in grey
    phases = ["setup", *[f"epoch {e + 1}" for e in range(args.epochs)]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(results)
    x = np.arange(len(phases))
    for i, r in enumerate(results):
        foot = [(f or 0) / MIB for f in r["footprint"]]
        axes[0].bar(x + (i - (len(results) - 1) / 2) * width, foot, width, label=r["name"], color=colors[i % 3])
        times = [r["first_batch_s"], *r["epoch_s"]]
        axes[1].bar(x + (i - (len(results) - 1) / 2) * width, times, width, label=r["name"], color=colors[i % 3])
    if baseline:
        axes[0].axhline(baseline / MIB, color="k", ls="--", lw=1, label="before any dataset")
        axes[0].axhline((baseline + copy) / MIB, color="k", ls=":", lw=1, label="the same + one copy of the data")
    axes[0].set(title="peak memory footprint of the job (procmem)", ylabel="MiB", xticks=x, xticklabels=phases)
    axes[1].set(title="time to first batch (from the setup's start) and epochs", ylabel="seconds", xticks=x)
    axes[1].set_xticklabels(["1st batch", *phases[1:]])
    for ax in axes:
        ax.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = os.path.join(args.out_dir, "shared_cache_ddp.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=str(HERE / "data"), help="synthetic NIfTI dataset (made once)")
    parser.add_argument("--out-dir", default=str(HERE / "output"), help="plot, results and computation logs")
    parser.add_argument("--num-items", type=int, default=16, help="number of image/label pairs")
    parser.add_argument("--size", type=int, default=256, help="edge of the cubic images, in voxels")
    parser.add_argument("--crop", type=int, default=64, help="edge of the random training crops")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--cache-threads", type=int, default=1, help="CacheDataset(num_workers=...) of every rank")
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
        if procmem is None:
            print("benchmarks/procmem.py not found (run from the repository): no memory numbers")
    files = make_data(args.data_dir, args.num_items, args.size, rank)

    # the footprint of the whole job: torchrun's agent (the parent of the ranks of this node) and all below it
    parents = set(gather(os.getppid(), world))
    root = parents.pop() if len(parents) == 1 else os.getpid()
    baseline = procmem.tree_snapshot(root)["footprint_bytes"] if procmem and rank == 0 else None
    if rank == 0:
        print(
            "ds.cache_stats(): 'process' counts the events of the rank itself (its DataLoader workers count for "
            "themselves), 'cache' the cache's contents and, for a shared store, the events of all its processes"
        )
    results = [train_run(name, args, files, device, rank, world, root) for name in VARIANTS]

    if rank == 0:
        copy = results[0]["cache_stats"][0][0]["cache"]["nbytes"]  # rank 0's own cache of upstream's default
        report(results, args, world, baseline, copy)
        with open(os.path.join(args.out_dir, "shared_cache_ddp.json"), "w") as f:
            json.dump({"args": vars(args), "world": world, "baseline": baseline, "results": results}, f, indent=1)
        path = plot(results, args, baseline, copy)
        if path:
            print(f"plot: {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
