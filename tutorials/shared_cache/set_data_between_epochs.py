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
Recipe: ``set_data()`` between epochs, with a runtime cache shared by DataLoader workers.

    python set_data_between_epochs.py

``set_data`` keeps the same cache. A store keeps its items by key (the input and the cached transforms), so the items
of inputs present in both the old and the new data are read again wherever the inputs moved. A list-like container is
grown in place to the new ``cache_num``, and a slot is served only for its key. No item of the old data is ever served
for the new data.
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


def computed_ids(log: str) -> list[int]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(x) for x in f.read().split()]


def one_epoch(ds: CacheDataset) -> list[int]:
    # new workers each epoch (persistent_workers=False), so that they get the dataset with its new data
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, persistent_workers=False)
    ids = []
    for batch in loader:
        assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"].float()), "a stale item was served"
        ids += batch["id"].tolist()
    return sorted(ids)


def train(log: str) -> None:
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    old = [{"id": i} for i in range(16)]  # ids 0..15
    new = [{"id": i} for i in range(8, 28)]  # ids 8..27: 8 inputs in common, and 20 items instead of 16

    store = SharedCacheStore()
    try:
        ds = CacheDataset(old, transform, runtime_cache=store)
        assert one_epoch(ds) == list(range(16))
        print(f"old data: computed {len(computed_ids(log))}")

        ds.set_data(new)  # the same store, 20 inputs now; the items of ids 0..7 stay in it, never served for others
        assert ds.cache_num == 20

        done = len(computed_ids(log))
        assert one_epoch(ds) == list(range(8, 28))
        fresh = sorted(computed_ids(log)[done:])
        print(f"new data: computed ids {fresh}")
        assert fresh == list(range(16, 28)), "ids 8..15 came from the cache, 16..27 were computed"

        assert one_epoch(ds) == list(range(8, 28))
        assert len(computed_ids(log)) == done + 12, "the next epoch reads everything from the cache"
    finally:
        store.close()


def with_a_list(log: str) -> None:
    """The same with a list-like container (a list here, a ListProxy alike): its slots are positions, with keys."""
    transform = Compose([Load(log), RandFlipd(keys="image", prob=0.5, spatial_axis=0)])
    cache: list = []
    ds = CacheDataset([{"id": i} for i in range(16)], transform, runtime_cache=cache)
    for i in range(len(ds)):
        ds[i]
    # every filled slot holds a (key, item) tuple
    assert len(cache) == 16 and all(item["id"] == i for i, (key, item) in enumerate(cache))

    ds.set_data([{"id": i} for i in range(8, 28)])
    assert len(cache) == 20  # the same list object, grown in place
    # slot i now caches the new input i (id i + 8): every input moved, so no old slot's key matches
    assert all(ds[i]["id"] == i + 8 for i in range(len(ds)))
    assert all(item["id"] == i + 8 for i, (key, item) in enumerate(cache))
    print("list container: grown to 20 slots, moved inputs recomputed")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        train(os.path.join(tmp, "executions.log"))
        with_a_list(os.path.join(tmp, "list.log"))
    print("ok")


if __name__ == "__main__":
    main()
