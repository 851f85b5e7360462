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
Recipe: what a broken cache does: one warning, then training goes on without the cache.

    python faults.py

Two faults are provoked here: the store's directory is removed in the middle of training, and the Manager server of
a ``ListProxy`` is shut down. In both cases the next access warns once (a ``RuntimeWarning`` per process), and every
item is computed again, correctly, without the cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from multiprocessing import Manager

import torch

from monai.data import CacheDataset, DataLoader, SharedCacheStore
from monai.transforms import Compose, RandFlipd, Transform


class Load(Transform):
    """Deterministic, so its output is cached. Appends one line per execution to ``log``, to count them."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, d: dict) -> dict:
        with open(self.log, "a") as f:
            f.write(f"{d['id']}\n")
        return {"id": d["id"], "image": torch.full((1, 8, 8), float(d["id"]))}


def executions(log: str) -> int:
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return len(f.read().split())


def epochs_after_a_fault(ds: CacheDataset, log: str, break_it) -> None:
    loader = DataLoader(ds, batch_size=4, num_workers=0)  # one process, so exactly one warning
    for _ in loader:
        pass
    assert executions(log) == 16
    break_it()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for batch in loader:
                assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())
    cache_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    for w in cache_warnings:
        print(f"  {w.category.__name__}: {w.message}")
    assert len(cache_warnings) == 1
    assert executions(log) == 16 + 2 * 16, "after the fault every item is computed in every epoch"


def removed_directory(log: str) -> None:
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    store = SharedCacheStore()
    ds = CacheDataset([{"id": i} for i in range(16)], transform, runtime_cache=store)
    epochs_after_a_fault(ds, log, lambda: shutil.rmtree(store.path))
    store.close()


def dead_manager(log: str) -> None:
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    manager = Manager()
    ds = CacheDataset([{"id": i} for i in range(16)], transform, runtime_cache=manager.list())
    epochs_after_a_fault(ds, log, manager.shutdown)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print("the store's directory is removed:")
        removed_directory(os.path.join(tmp, "store.log"))
        print("the Manager server of a ListProxy is shut down:")
        dead_manager(os.path.join(tmp, "manager.log"))
    print("ok")


if __name__ == "__main__":
    main()
