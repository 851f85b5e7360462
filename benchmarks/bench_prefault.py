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
Whether prefaulting pays for the portable store's hit (issue 24, item 9): ``python benchmarks/bench_prefault.py
[--rounds 15] [--dir /dev/shm]``.

One file of 145 MiB (a ``1 x 336^3`` float32 volume, the size of the hits benchmark's item) is mapped privately
and copy-on-write, as the portable store maps an item, and a 96^3 crop is copied out of it, as a training hit does.
Each way of mapping is timed in turn, interleaved, ``--rounds`` times, and the medians are printed as ratios to
``torch.UntypedStorage.from_file`` (what the store uses):

- ``mmap.mmap`` with ``MAP_PRIVATE`` alone, and with ``MAP_POPULATE`` (Linux);
- ``madvise`` with ``MADV_WILLNEED``, and with ``MADV_POPULATE_READ`` (Linux 5.14, value 22).

A prefault maps the whole file, while a crop touches a few MiB of it: the script measures whether that trade pays.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

SHAPE = (1, 336, 336, 336)
NBYTES = int(np.prod(SHAPE)) * 4
MADV_POPULATE_READ = 22  # linux/mman.h; not among the mmap module's constants
_TRACKFD = {"trackfd": False} if sys.version_info >= (3, 13) else {}  # no duplicated descriptor kept


def _crop(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.float32).reshape(SHAPE)[:, 100:196, 100:196, 100:196].clone()


def _from_file(path: str) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=False, nbytes=NBYTES)
    finally:
        os.close(fd)
    return _crop(torch.empty(0, dtype=torch.uint8).set_(storage))


def _mmap(path: str, flags: int = 0, advice: int | None = None) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, NBYTES, flags=mmap.MAP_PRIVATE | flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, **_TRACKFD)
    finally:
        os.close(fd)
    if advice is not None:
        mm.madvise(advice)
    return _crop(torch.from_numpy(np.frombuffer(mm, dtype=np.uint8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    path = os.path.join(args.dir, f"monai-bench-prefault-{os.getpid()}")
    np.arange(np.prod(SHAPE), dtype=np.float32).tofile(path)
    try:
        ways: dict[str, Callable[[], torch.Tensor]] = {
            "torch.UntypedStorage.from_file": lambda: _from_file(path),
            "mmap MAP_PRIVATE": lambda: _mmap(path),
            "mmap MAP_POPULATE": lambda: _mmap(path, getattr(mmap, "MAP_POPULATE", 0)),
            "madvise MADV_WILLNEED": lambda: _mmap(path, 0, mmap.MADV_WILLNEED),
            "madvise MADV_POPULATE_READ": lambda: _mmap(path, 0, MADV_POPULATE_READ),
        }
        expected, times = _from_file(path), {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                start = time.perf_counter()
                got = way()
                times[name].append(time.perf_counter() - start)
                assert torch.equal(got, expected), name
    finally:
        os.unlink(path)
    base = statistics.median(times["torch.UntypedStorage.from_file"])
    print(f"{'mapping':32s} {'median ms':>10s} {'x from_file':>12s}  (python {sys.version.split()[0]}, {args.dir})")
    for name, values in times.items():
        print(f"{name:32s} {statistics.median(values) * 1e3:10.2f} {statistics.median(values) / base:12.2f}")


if __name__ == "__main__":
    main()
