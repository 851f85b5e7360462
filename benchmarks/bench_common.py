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
What every job of the benchmark shares: the compared paths, the targets, the synthetic input files, the transform
chain, one cache hit (read + crop + collate-like copy) and small helpers, among them the reports' tables. The jobs
import torch and monai lazily: the driver needs neither.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import resource
import secrets
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FORK_TREE = REPO / "build" / "tree"
BUILD_SCRIPT = REPO / "build_backend" / "monai_sharedcache_build.py"
DEFAULT_OUT = REPO / "benchmarks" / "output"
MIB = 1024 * 1024

# the compared paths: label, tree, runtime_cache, copy_cache, whether the cached items are numpy arrays
PATHS: dict[str, dict[str, Any]] = {
    "private_nocopy": {
        "label": "1. private list, eager, copy_cache=False (floor)",
        "short": "private no-copy",
        "tree": "fork",
        "runtime_cache": False,
        "copy_cache": False,
        "numpy": False,
    },
    "private_copy": {
        "label": "2. private list, eager, copy_cache=True",
        "short": "private copy",
        "tree": "fork",
        "runtime_cache": False,
        "copy_cache": True,
        "numpy": False,
    },
    "upstream_tensor": {
        "label": "3. upstream 1.6.1 'process' ListProxy, tensors",
        "short": "upstream ListProxy tensor",
        "tree": "upstream",
        "runtime_cache": "process",
        "copy_cache": True,
        "numpy": False,
    },
    "upstream_numpy": {
        "label": "4. upstream 1.6.1 'process' ListProxy, numpy",
        "short": "upstream ListProxy numpy",
        "tree": "upstream",
        "runtime_cache": "process",
        "copy_cache": False,
        "numpy": True,
    },
    "store": {
        "label": "5. fork 'process' SharedCacheStore",
        "short": "fork store",
        "tree": "fork",
        "runtime_cache": "process",
        "copy_cache": True,
        "numpy": False,
    },
}
# measured by the hits section only, in every run: the store without its Linux fast path (the mapping pool, the page
# checks and userfaultfd), in a job of its own with MONAI_CACHE_FAST_PATH=0 (read at the import of monai); its ratios
# are to the floor and to copy_cache=True timed in that job
PORTABLE = "store_portable"
HIT_PATHS: dict[str, dict[str, Any]] = {
    PORTABLE: {
        "label": "5b. fork SharedCacheStore, portable (MONAI_CACHE_FAST_PATH=0)",
        "short": "fork store, portable",
        "tree": "fork",
        "runtime_cache": "process",
        "copy_cache": True,
        "numpy": False,
    },
}
# measured only with --store-root DIR (e.g. a tmpfs mounted with huge=within_size): per-hit and fill
OPTIONAL_PATHS: dict[str, dict[str, Any]] = {
    "store_root": {
        "label": "6. fork SharedCacheStore(root=--store-root)",
        "short": "fork store, --store-root",
        "tree": "fork",
        "runtime_cache": "store",
        "copy_cache": True,
        "numpy": False,
    },
}
UPSTREAM_PATHS = ("upstream_tensor", "upstream_numpy")
ALL_PATHS = {**PATHS, **HIT_PATHS, **OPTIONAL_PATHS}
FAST_PATH_ENV = "MONAI_CACHE_FAST_PATH"  # "0" turns the store's Linux fast path off (read at the import of monai)
# the modules of the store in the fork's tree (their digest tells which version was measured)
STORE_MODULES = (
    "cache_store.py",
    "_cache_format.py",
    "_cache_locks.py",
    "shared_cache.py",
    "dataset.py",
)

TARGETS = {
    "hit_vs_floor": 1.5,  # store hit + crop <= 1.5x the private no-copy floor (median over the --runs)
    "first_read_vs_floor": 1.5,  # store first read of an item + crop <= 1.5x the floor (median over the --runs)
    "speedup_vs_copy": 5.0,  # store >= 5x faster than private copy_cache=True
    "portable_speedup_vs_copy": 10.0,  # portable store (no fast path) >= 10x faster than private copy_cache=True
    "speedup_vs_upstream_numpy": 20.0,  # store >= 20x faster than upstream ListProxy with numpy items
    "fill_ratio": 1.5,  # store write <= 1.5x a plain os.write of the same bytes to /dev/shm
    "pss_ratio": 1.15,  # footprint of main + 2 workers with the store <= 1.15x one copy of the data
    "small_flat": 1.5,  # 20,000 small items: median hit of the last 1,000 <= 1.5x that of the first 1,000
}


def standalone(description: str, reps: int) -> tuple[argparse.Namespace, list[int], list[int]]:
    """
    The options of a standalone benchmark of the item of ``bench_cache.py`` (``--small``, ``--reps``), and the item's
    shape and crop; torch on one thread, as in DataLoader workers.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--reps", type=int, default=reps)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    shape, roi = ([96, 96, 64], [48, 48, 48]) if args.small else ([240, 240, 155], [96, 96, 96])
    return args, shape, roi


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def plain_table(head: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, rows)])


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def data_files(data_dir: str, shape: Sequence[int]) -> tuple[str, str]:
    """
    Write (once) a synthetic 4-channel float32 image and its 1-channel uint8 label of spatial ``shape`` as ``.npy``
    files in ``data_dir``; return their paths. Every input item loads these files (the items differ by their key).
    """
    import numpy as np

    tag = "x".join(str(int(s)) for s in shape)
    image, label = os.path.join(data_dir, f"image-4x{tag}.npy"), os.path.join(data_dir, f"label-1x{tag}.npy")
    if not (os.path.exists(image) and os.path.exists(label)):
        os.makedirs(data_dir, exist_ok=True)
        img = np.random.default_rng(0).standard_normal((4, *[int(s) for s in shape]), dtype=np.float32)
        for path, arr in ((image, img), (label, (img[:1] > 1.0).astype(np.uint8))):
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, arr)
            os.replace(tmp, path)
    return image, label


def inputs(cfg: dict, n: int, start: int = 0, shape: Sequence[int] | None = None) -> list[dict]:
    """``n`` input items (file names and a case number, which makes each item's content key distinct)."""
    image, label = data_files(cfg["data_dir"], shape or cfg["shape"])
    return [{"image": image, "label": label, "case": start + i} for i in range(n)]


def transforms(roi: Sequence[int], numpy_items: bool) -> tuple[Any, int]:
    """
    The transform chain: deterministic (cached) steps as in a segmentation pipeline, then a random crop.

    Args:
        roi: size of the random crop.
        numpy_items: append ``EnsureTyped(data_type="numpy")`` as the last cached step (numpy items in the cache).

    Returns:
        the ``Compose`` and the index of its first random transform.
    """
    import numpy as np

    from monai.transforms import Compose, EnsureTyped, LoadImaged, NormalizeIntensityd, RandSpatialCropd

    keys = ["image", "label"]
    cached: list[Any] = [
        LoadImaged(keys="image", reader="NumpyReader", channel_dim=0, image_only=True, dtype=np.float32),
        LoadImaged(keys="label", reader="NumpyReader", channel_dim=0, image_only=True, dtype=np.uint8),
        NormalizeIntensityd(keys="image", channel_wise=True),
    ]
    if numpy_items:
        cached.append(EnsureTyped(keys=keys, data_type="numpy"))
    crop = RandSpatialCropd(keys=keys, roi_size=tuple(roi), random_size=False)
    return Compose([*cached, crop]), len(cached)


BATCH_BUFFERS: dict[tuple, Any] = {}


def collate_copy(item: dict) -> dict:
    """
    A collate-like copy of the crop: ``torch.stack`` of each array into a batch buffer (a copy of the cropped region).

    The buffers are allocated once per shape and reused, so that what the allocator does (a new mapping to fault in,
    or reused heap memory, which varies from run to run) does not blur the cost of reading the cache.
    """
    import numpy as np
    import torch

    out = {}
    for key in ("image", "label"):
        value = item[key]
        value = torch.from_numpy(value) if isinstance(value, np.ndarray) else value.as_subclass(torch.Tensor)
        spec = (key, tuple(value.shape), value.dtype)
        buffer = BATCH_BUFFERS.get(spec)
        if buffer is None:
            buffer = BATCH_BUFFERS[spec] = torch.empty((1, *value.shape), dtype=value.dtype)
        out[key] = torch.stack([value], out=buffer)
    return out


def item_arrays(item: dict) -> list[Any]:
    """The numpy views of the arrays of a cached item (what a plain file write writes)."""
    import numpy as np
    import torch

    arrays = []
    for key in ("image", "label"):
        value = item[key]
        if isinstance(value, torch.Tensor):
            value = value.as_subclass(torch.Tensor).contiguous().numpy()
        arrays.append(np.ascontiguousarray(value))
    return arrays


def item_nbytes(item: dict) -> int:
    return int(sum(a.nbytes for a in item_arrays(item)))


def expected_nbytes(shape: Sequence[int]) -> int:
    """The nbytes of one item: a 4-channel float32 image and a 1-channel uint8 label of spatial ``shape``."""
    voxels = 1
    for s in shape:
        voxels *= int(s)
    return voxels * (4 * 4 + 1)


def plain_write(directory: str, arrays: Sequence[Any]) -> float:
    """Seconds to write ``arrays`` to a new file in ``directory`` with ``os.write`` (the file is then removed)."""
    path = os.path.join(directory, f"bench-plain-{os.getpid()}-{secrets.token_hex(4)}")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for arr in arrays:
            view = memoryview(arr).cast("B")
            while view.nbytes:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return elapsed


def malloc_trim() -> None:
    """Give the free memory of the malloc heaps back to the system (glibc), so that it is not counted as used."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class DeepcopyCounter:
    """Counts the ``deepcopy`` calls made by ``monai.data.dataset`` (to check that a read path skips it)."""

    def __init__(self) -> None:
        import monai.data.dataset as dataset_module

        self.module = dataset_module
        self.original = dataset_module.deepcopy
        self.count = 0

        def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.original(obj, *args, **kwargs)

        dataset_module.deepcopy = counting  # type: ignore[assignment]

    def restore(self) -> None:
        self.module.deepcopy = self.original


def hit(ds: Any, index: int = 0) -> None:
    """One cache hit as a training step sees it: read + random crop (``ds[index]``) + a collate-like copy."""
    collate_copy(ds[index])


def job_setup() -> dict[str, Any]:
    import torch

    import monai

    torch.set_num_threads(1)  # as in DataLoader workers; also keeps timings stable on a shared 2-core machine
    info: dict[str, Any] = {"monai_version": monai.__version__, "monai_file": monai.__file__}
    info["torch_version"] = torch.__version__
    data = Path(monai.__file__).parent / "data"
    if (data / "cache_store.py").exists():  # which version of the store was measured (it may be edited between runs)
        digest = hashlib.sha256()
        for name in STORE_MODULES:
            if (data / name).exists():
                digest.update(name.encode() + b"\0" + (data / name).read_bytes())
        for path in sorted((data.parent.parent / "monai_sharedcache").glob("*.py")):  # the fork's layer
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        info["store_sha256"] = digest.hexdigest()[:16]
        try:
            from monai_sharedcache import _pool  # the fork's Linux fast path: on unless MONAI_CACHE_FAST_PATH=0

            info["fast_path"] = bool(_pool.ENABLED)
        except ImportError:
            info["fast_path"] = None
    return info


def compute_times(cfg: dict, numpy_items: bool, n: int) -> tuple[list[float], int]:
    """Seconds to run the cached (deterministic) transforms on one input, ``n`` times; and the item's nbytes."""
    tr, first_random = transforms(cfg["roi"], numpy_items)
    times, nbytes = [], 0
    for i in range(n):
        start = time.perf_counter()
        item = tr(inputs(cfg, 1, start=1000 + i)[0], end=first_random)
        times.append(time.perf_counter() - start)
        nbytes = item_nbytes(item)
        del item
    return times, nbytes
