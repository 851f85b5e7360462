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
Recipe: keep the cache across runs (a restart, a sweep) with a persistent store.

    python keep_across_runs.py                       # three runs in a row, each a new process, in a temporary dir
    python keep_across_runs.py --run DIR SCALE       # one run with its cache in DIR (run it twice: the second
                                                     # computes nothing)

``SharedCacheStore(path, persistent=True)`` keeps its items in ``path`` when the run ends. A later run that opens the
same path reuses every item whose input, cached transforms, store format and MONAI version match, and computes the
rest; a run with other transform parameters computes its own items, and the first ones stay for later.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch

from monai.data import CacheDataset, DataLoader, SharedCacheStore
from monai.transforms import Compose, RandFlipd, Transform


class Load(Transform):
    """Deterministic, so its output is cached; ``scale`` is a parameter, part of the transforms' fingerprint."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, d: dict) -> dict:
        return {"id": d["id"], "image": torch.full((1, 8, 8), d["id"] * self.scale)}


def run(cache_dir: str, scale: float) -> None:
    store = SharedCacheStore(cache_dir, persistent=True)  # made (0700) if missing; kept when the run ends
    data = [{"id": i} for i in range(16)]
    ds = CacheDataset(
        data, Compose([Load(scale), RandFlipd(keys="image", prob=0.5, spatial_axis=0)]), runtime_cache=store
    )
    ds.fill()  # computes what the earlier runs did not leave
    for batch in DataLoader(ds, batch_size=4, shuffle=True, num_workers=2):
        assert torch.equal(batch["image"].amax(dim=(1, 2, 3)), batch["id"] * scale)  # never an item of another run
    stats = store.stats()
    print(f"scale={scale}: computed {stats['computed']}, reused {stats['reused']} items of earlier runs", flush=True)
    store.close()  # the directory stays


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        run(sys.argv[2], float(sys.argv[3]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        for scale in ("1", "1", "2", "1"):  # each a new process, as a restarted job or the runs of a sweep
            out = subprocess.run([sys.executable, __file__, "--run", cache, scale], check=True, capture_output=True)
            print(out.stdout.decode().strip())
    print("ok")


if __name__ == "__main__":
    main()
