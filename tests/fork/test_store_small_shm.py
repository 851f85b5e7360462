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
PR 02's reserve where it matters, through PR 05's ``CacheDataset``: Docker's default 64 MB ``/dev/shm``, which the store
and the DataLoader's batches share. A tmpfs of that size is mounted on ``/dev/shm`` in a private mount namespace (root
and ``unshare --mount``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest

from fork_utils import (
    ENV_DEFAULT_ROOT,
    IN_PRIVATE_MOUNTS,
    private_mount_namespace,
    skip_unless_linux,
    skip_unless_store,
)

# 48 items of 2 MiB, 1.5 times the 64 MB /dev/shm that the DataLoader's batches also go through; a file, not `-c`,
# so that spawned DataLoader workers (the spawn mode) can import its classes
SMALL_SHM_SCRIPT = """
import json, os, sys
import torch
from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, RandomizableTransform, Transform

class Load(Transform):
    def __call__(self, i):
        return {"src": i, "img": torch.full((512 * 1024,), float(i))}  # 2 MiB

class AddOne(RandomizableTransform):
    def __call__(self, d):
        d["img"] += 1
        return d

if __name__ == "__main__":
    ds = CacheDataset(list(range(48)), Compose([Load(), AddOne()]), runtime_cache="process", progress=False)
    store = ds._cache.cache
    assert os.path.dirname(store.path) == "/dev/shm", store.path
    loader = DataLoader(ds, batch_size=2, num_workers=2, timeout=120)
    for epoch in range(3):
        seen = []
        for batch in loader:
            for s, img in zip(batch["src"], batch["img"]):
                assert torch.equal(img, torch.full((512 * 1024,), float(s) + 1)), int(s)
                seen.append(int(s))
        assert sorted(seen) == list(range(48)), seen
        print("epoch", epoch, "ok", flush=True)
    print(json.dumps({"filled": sum(n.endswith(".item") for n in os.listdir(store.path))}), flush=True)
"""


@skip_unless_store
@skip_unless_linux
class TestSmallDevShm(unittest.TestCase):
    """Docker's default 64 MB /dev/shm: the store leaves room for the DataLoader's own shared memory."""

    def run_in_64mb_shm(self, **env: str) -> subprocess.CompletedProcess:
        reason = private_mount_namespace()
        if reason:
            self.skipTest(reason)
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "small_shm.py")
            with open(script, "w") as f:
                f.write(SMALL_SHM_SCRIPT)
            shell = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"
            cmd = [*IN_PRIVATE_MOUNTS, shell]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**ENV_DEFAULT_ROOT, **env})

    def test_every_epoch_completes_with_correct_items(self):
        proc = self.run_in_64mb_shm()
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        epochs = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch")]
        self.assertEqual(epochs, [f"epoch {e} ok" for e in range(3)])
        filled = json.loads(proc.stdout.splitlines()[-1])["filled"]
        self.assertGreater(filled, 0)  # it still caches what fits
        self.assertLess(filled, 48)  # and refused the others
        self.assertIn("--shm-size", proc.stderr)  # the warning names the options
        self.assertIn("not storing items past the budget", proc.stderr)

    def test_without_reserve_the_dataloader_fails(self):
        """The scenario is real: a store that may fill /dev/shm makes the DataLoader's batch transfer fail."""
        proc = self.run_in_64mb_shm(MONAI_CACHE_RESERVE_BYTES="0")
        self.assertNotEqual(proc.returncode, 0, proc.stdout)
        # how it dies depends on the timing: no room for a batch's shared memory, or a worker's bus error on it
        self.assertRegex(proc.stderr, "unable to allocate shared memory|Bus error|No space left on device")


if __name__ == "__main__":
    unittest.main()
