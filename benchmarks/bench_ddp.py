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
DDP end to end, as MONAI's DDP tutorial trains: 2 gloo ranks x 2 DataLoader workers on CPU, NIfTI inputs, a small 3D
UNet in ``DistributedDataParallel``; upstream 1.6.1's eager cache per rank against the fork's store shared by the
ranks (``create_shared_cache()``), lazily and with ``fill()``::

    python benchmarks/bench_ddp.py [--small]     # also: python benchmarks/bench_cache.py --sections ddp

Each variant runs in fresh processes: a launcher (``--launch``) starts the ranks (``--rank``) with a torchrun-like
environment and ``PYTHONPATH`` set to its tree, in a session of its own. Measured: the time to first batch of the
slowest rank (from a barrier before the dataset's setup), the computations of the cached transforms in all
processes (a pass-through at the end of the cached chain appends a line to a file), and the peak footprint of the
variant's whole process tree with the store's files (``procmem.PeakSampler``). The data (24 items of 156 MiB) must
dominate the 2 GiB that interpreters, torch and workers take in every variant for the footprint ratio to be about
the caches: with ``--small`` the footprint target fails by design.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = {"upstream_eager": "upstream", "shared_lazy": "fork", "shared_fill": "fork"}  # variant: tree
TARGETS = {  # shared_fill against upstream_eager, in the format of bench_cache.TARGETS
    "ddp_computed": ("ddp shared store + fill(): computations per item (all ranks and workers)", 1, "<="),
    "ddp_footprint": ("ddp shared store + fill(): peak footprint vs upstream eager per rank", 0.55, "<="),
}


def make_data(folder: Path, n: int, shape: list[int]) -> list[dict[str, str]]:
    """Synthetic CT-like volumes (int16 image, uint8 label of a few spheres) as ``.nii.gz``, written once."""
    folder = folder / f"{n}x{'x'.join(map(str, shape))}"
    files = [
        {"image": str(folder / f"img{i:03d}.nii.gz"), "label": str(folder / f"seg{i:03d}.nii.gz")} for i in range(n)
    ]
    if (folder / "done").exists():
        return files
    import nibabel as nib
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    for i, item in enumerate(files):
        rng = np.random.default_rng(i)
        label = np.zeros(shape, np.uint8)
        for _ in range(6):
            radius = rng.uniform(min(shape) / 12, min(shape) / 6)
            center = [rng.uniform(radius, s - radius) for s in shape]
            label[sum((g - c) ** 2 for g, c in zip(grid, center)) <= radius**2] = 1
        image = (label * 300.0 + 100.0 + rng.normal(0.0, 20.0, shape)).astype(np.int16)
        nib.Nifti1Image(image, np.eye(4)).to_filename(item["image"])
        nib.Nifti1Image(label, np.eye(4)).to_filename(item["label"])
    (folder / "done").touch()
    return files


_Transform: type = object
if "--rank" in sys.argv:  # CacheDataset caches up to the first step that is not a monai Transform; the driver has
    from monai.transforms import Transform as _Transform  # no monai on its path


class CountComputations(_Transform):  # type: ignore[misc,valid-type]
    """The last cached step: appends a line to ``log`` (``O_APPEND``: atomic for a short write) per computation."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, data: dict) -> dict:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return data


def count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def rank_main(cfg: dict) -> None:
    """One rank: the tutorial's training loop; writes ``rank<r>.json`` into the variant's work directory."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    from monai.data import CacheDataset, DataLoader
    from monai.losses import DiceLoss
    from monai.networks.nets import UNet
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld, ScaleIntensityd
    from monai.utils import set_determinism

    variant, work = cfg["variant"], cfg["work"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # the ranks and their workers share the cores
    set_determinism(seed=0)
    keys, log = ["image", "label"], os.path.join(work, "computations.log")
    transform = Compose(
        [
            LoadImaged(keys, image_only=True),
            EnsureChannelFirstd(keys),
            ScaleIntensityd("image"),
            CountComputations(log),
            RandCropByPosNegLabeld(keys, "label", spatial_size=(cfg["crop"],) * 3, pos=1, neg=1, num_samples=2),
        ]
    )
    out: dict[str, Any] = {}
    dist.barrier()
    start = time.perf_counter()
    store = None
    if variant.startswith("shared"):
        from monai.data import create_shared_cache

        store = create_shared_cache()  # collective: every rank calls it once
        if rank == 0:
            Path(work, "store_dir.txt").write_text(store.path)
    ds = CacheDataset(cfg["files"], transform, num_workers=1, progress=False, runtime_cache=store or False)
    if variant == "shared_fill":
        ds.fill()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
    net = UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
    model = DistributedDataParallel(net)
    opt, loss_fn = torch.optim.Adam(model.parameters(), 1e-3), DiceLoss(sigmoid=True)
    out["epoch_s"] = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        dist.barrier()
        epoch_start = time.perf_counter()
        for batch in loader:
            out.setdefault("first_batch_s", time.perf_counter() - start)
            opt.zero_grad()
            loss_fn(model(batch["image"]), batch["label"]).backward()
            opt.step()
        dist.barrier()
        out["epoch_s"].append(time.perf_counter() - epoch_start)
    del loader, ds
    if store is not None:
        store.close()  # the directory goes with the last rank that closes it
    dist.barrier()
    dist.destroy_process_group()
    Path(work, f"rank{rank}.json").write_text(json.dumps(out))


def launch(cfg_path: str) -> int:
    """The launcher (torchrun-like): start the ranks, stop them all if one fails or the time is up."""
    cfg = json.loads(Path(cfg_path).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = []
    for rank in range(2):
        with open(Path(cfg["work"], f"rank{rank}.log"), "w") as log:
            renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, __file__, "--rank", cfg_path]
            procs.append(subprocess.Popen(cmd, env=renv, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + cfg["timeout"]
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return 0 if all(p.returncode == 0 for p in procs) else 1


def run_variant(name: str, tree: Path, base: dict[str, Any], out: Path) -> dict[str, Any]:
    import procmem

    work = out / "ddp" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(dict(base, variant=name, work=str(work))))
    store_file = work / "store_dir.txt"

    def store_dirs() -> list[str]:
        return [store_file.read_text().strip()] if store_file.exists() else []

    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(out / "pycache"), MONAI_CACHE_FAST_PATH="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--launch", str(work / "config.json")]
    launcher = subprocess.Popen(cmd, env=env, cwd=str(work), start_new_session=True)
    try:
        with procmem.PeakSampler(root_pid=launcher.pid, store_dirs=store_dirs, interval=0.4) as sampler:
            code = launcher.wait(timeout=base["timeout"] + 60)
    except subprocess.TimeoutExpired:
        code = None
    finally:  # whatever is left of the variant's session: nothing, unless something failed
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        launcher.wait()
    result: dict[str, Any] = {"tree": tree.name, "wall_s": time.perf_counter() - start}
    result["store_left"] = [d for d in store_dirs() if os.path.exists(d)]
    for d in result["store_left"]:
        shutil.rmtree(d, ignore_errors=True)
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    if code != 0 or len(ranks) != 2:
        logs = "".join(p.read_text()[-1500:] for p in sorted(work.glob("rank*.log")))
        return dict(result, error=f"exit {code}: {logs}")
    result["computed"] = count_lines(str(work / "computations.log"))
    result["first_batch_s"] = max(r["first_batch_s"] for r in ranks)
    result["epoch_s"] = ranks[0]["epoch_s"]
    result["footprint_mib"] = sampler.result["footprint_bytes"] / 2**20
    result["shm_mib"] = sampler.result["shm_bytes"] / 2**20
    return result


def run_section(small: bool, out: Path, trees: dict[str, Path], timeout: float) -> tuple[dict, list[str]]:
    """The variants, their table, and ``checks`` (the values of :data:`TARGETS`)."""
    cfg: dict[str, Any] = {"items": 8 if small else 24, "shape": [96, 96, 64] if small else [320, 320, 200]}
    cfg.update(crop=32 if small else 64, epochs=2, timeout=timeout)
    cfg["files"] = make_data(out / "ddp-data", cfg["items"], cfg["shape"])
    variants = {k: v for k, v in VARIANTS.items() if not (small and k == "shared_lazy")}  # --small: under 2 minutes
    res: dict[str, Any] = {name: run_variant(name, trees[tree], cfg, out) for name, tree in variants.items()}
    item_mib = 8 * cfg["shape"][0] * cfg["shape"][1] * cfg["shape"][2] / 2**20  # image and label, float32
    lines = [
        f"2 ranks x 2 workers (gloo, CPU); {cfg['items']} NIfTI volumes of {'x'.join(map(str, cfg['shape']))}, "
        f"cached item {item_mib:.0f} MiB, one copy {cfg['items'] * item_mib:.0f} MiB; crops {cfg['crop']}^3 x 2, "
        f"batch 2, {cfg['epochs']} epochs",
        f"{'variant':16s} {'tree':>14s} {'computed':>9s} {'1st batch s':>12s} {'epochs s':>12s} "
        f"{'peak MiB':>9s} {'shm MiB':>8s} {'x upstream':>10s}",
    ]
    eager = res["upstream_eager"].get("footprint_mib")
    for name, r in res.items():
        if "error" in r:
            lines.append(f"{name:16s} error: {r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}")
            continue
        epochs = " / ".join(f"{t:.1f}" for t in r["epoch_s"])
        ratio = f"{r['footprint_mib'] / eager:.2f}" if eager else "n/a"
        lines.append(
            f"{name:16s} {r['tree']:>14s} {r['computed']:9d} {r['first_batch_s']:12.1f} {epochs:>12s} "
            f"{r['footprint_mib']:9.0f} {r['shm_mib']:8.0f} {ratio:>10s}"
        )
        if r["store_left"]:
            lines.append(f"  {name}: the store's directory was left behind (removed)")
    fill = res["shared_fill"]
    res["checks"] = {
        "ddp_computed": fill["computed"] / cfg["items"] if "computed" in fill else None,
        "ddp_footprint": fill["footprint_mib"] / eager if eager and "footprint_mib" in fill else None,
    }
    del cfg["files"]
    res["config"] = cfg
    return res, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--small", action="store_true", help="8 small volumes: a quick run")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "output"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(json.loads(Path(args.rank).read_text()))
        return 0
    if args.launch:
        return launch(args.launch)
    import bench_cache

    out = Path(args.out_dir).resolve()
    res, lines = run_section(args.small, out, bench_cache.prepare_trees(out), args.timeout)
    print("\n".join(lines))
    for key, (text, limit, _) in TARGETS.items():
        value = res["checks"][key]
        ok = value is not None and value <= limit
        print(f"{'PASS' if ok else 'FAIL'}  {text}: {'n/a' if value is None else f'{value:.3g}'} (<= {limit:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
