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
Recipe: one runtime cache shared by the DataLoader workers of one process.

    python dataloader_workers.py

``runtime_cache="process"`` gives the dataset its own shared-memory store (a private directory on ``/dev/shm``, no
server process). Every worker reads and fills the same store, in every epoch, whatever the start method of the
workers. The second part creates the store explicitly, which is the same thing plus a path that other processes join.
"""

from __future__ import annotations

import os
import tempfile

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


def run_epochs(ds: CacheDataset, log: str, epochs: int = 3) -> None:
    # new workers every epoch (persistent_workers=False); multiprocessing_context="spawn" or "forkserver" works too
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    for epoch in range(epochs):
        before = executions(log)
        for batch in loader:
            assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())
        print(f"  epoch {epoch}: computed {executions(log) - before} items")


def owned_by_the_dataset(log: str) -> None:
    data = [{"id": i} for i in range(16)]
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    ds = CacheDataset(data, transform, runtime_cache="process")  # the store is removed with the dataset
    run_epochs(ds, log)
    # the workers of epoch 0 computed every item once; the workers of the later epochs read them
    assert executions(log) == len(data)


def explicit_store(log: str) -> None:
    data = [{"id": i} for i in range(16)]
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    store = SharedCacheStore()  # a new private directory /dev/shm/monai-cache-*
    try:
        ds = CacheDataset(data, transform, runtime_cache=store)
        run_epochs(ds, log, epochs=2)
        print(f"  {store.path}: {executions(log)} items computed, each once")
        assert executions(log) == len(data)
    finally:
        store.close()  # this process created it, so closing removes the directory
    assert not os.path.exists(store.path)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print('runtime_cache="process":')
        owned_by_the_dataset(os.path.join(tmp, "process.log"))
        print("runtime_cache=SharedCacheStore():")
        explicit_store(os.path.join(tmp, "store.log"))
    print("ok")


if __name__ == "__main__":
    main()
