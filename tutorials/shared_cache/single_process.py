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
Recipe: a runtime cache in a single process (no DataLoader workers).

    python single_process.py

``runtime_cache=True`` keeps a plain list owned by the dataset: nothing is computed in the constructor, each item is
computed the first time it is asked for, and every later epoch reads it from the list.
"""

from __future__ import annotations

import os
import tempfile

import torch

from monai.data import CacheDataset, DataLoader
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


def train(log: str) -> None:
    data = [{"id": i} for i in range(16)]
    # the deterministic part (cached), then the first random transform (run on every access)
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])

    ds = CacheDataset(data, transform, runtime_cache=True)  # or "thread": the same private list
    assert executions(log) == 0  # nothing computed in the constructor

    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=0)
    for epoch in range(3):
        before = executions(log)
        for batch in loader:
            # every image is the one of its own input (a constant image equal to its id)
            assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float())
        print(f"epoch {epoch}: computed {executions(log) - before} items")

    assert executions(log) == len(data), "each item is computed once, in the first epoch"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        train(os.path.join(tmp, "executions.log"))
    print("ok")


if __name__ == "__main__":
    main()
