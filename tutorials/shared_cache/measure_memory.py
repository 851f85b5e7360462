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
Recipe: measure the memory of a training process and its DataLoader workers honestly (Linux).

    python measure_memory.py

RSS counts a shared page once in *every* process that maps it, so summing the RSS of a process and its workers counts
the shared pages (the torch libraries, a cache inherited through ``fork``) several times. PSS (proportional set size,
``/proc/<pid>/smaps_rollup``) divides each shared page among the processes that map it, so PSS adds up. A shared
store's items live in ``/dev/shm`` and are mapped only while being read, so they show up in no process's PSS: count
them with ``du`` on the store's directory (``store.path``).
"""

from __future__ import annotations

import os

import torch

from monai.data import CacheDataset, DataLoader, SharedCacheStore
from monai.transforms import Compose, RandFlipd, Transform

MIB = 1024 * 1024


class Load(Transform):
    """Deterministic, so its output is cached: a 1 MiB image per item."""

    def __call__(self, d: dict) -> dict:
        return {"id": d["id"], "image": torch.full((1, 64, 64, 64), float(d["id"]))}


def descendants(pid: int) -> list[int]:
    """``pid`` and all the processes below it (e.g. its DataLoader workers)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # the process is gone
                continue
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # the command name may contain spaces
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def rss_and_pss(pids: list[int]) -> tuple[int, int]:
    """The summed RSS and PSS of ``pids``, in bytes, from ``/proc/<pid>/smaps_rollup``."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def measure(name: str, runtime_cache, store: SharedCacheStore | None = None) -> None:
    data = [{"id": i} for i in range(32)]  # 32 MiB of cached images
    transform = Compose([Load(), RandFlipd(keys="image", prob=0.5)])
    ds = CacheDataset(data, transform, runtime_cache=runtime_cache, progress=False)
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    for epoch in range(2):
        for step, _ in enumerate(loader):
            if epoch == 1 and step == len(loader) - 1:  # measure while the workers are alive
                pids = descendants(os.getpid())
                rss, pss = rss_and_pss(pids)
    line = f"{name:<22} {len(pids)} processes   sum of RSS {rss / MIB:7.1f} MiB   sum of PSS {pss / MIB:7.1f} MiB"
    if store is not None:
        stored = sum(e.stat().st_size for e in os.scandir(store.path) if e.is_file())  # as du counts it
        line += f"   + store in /dev/shm {stored / MIB:5.1f} MiB"
    print(line)
    assert pss <= rss


def main() -> None:
    if not os.path.exists("/proc/self/smaps_rollup"):
        print("skipped: needs Linux >= 4.14 (/proc/<pid>/smaps_rollup)")
        return
    measure("cache filled eagerly", False)  # filled in this process, inherited by the forked workers
    store = SharedCacheStore()
    try:
        measure("SharedCacheStore", store, store)
    finally:
        store.close()
    print("ok")


if __name__ == "__main__":
    main()
