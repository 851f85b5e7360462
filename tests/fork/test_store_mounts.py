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
A store on a real file system that is full or read-only (PR 02 and the fork's layer): a tmpfs with few inodes, mounted in a
private mount namespace (root and ``unshare --mount``), and remounted read-only. Its free bytes stay large, so the
budget sees room and the kernel's own ``ENOSPC``/``EROFS`` is what the store meets, at open and mid-run, in the main
process and in DataLoader workers. In every case the epochs complete and every item is right.

A file system cannot turn read-only under a live store by ``mount -o remount,ro``: the kernel refuses it (``EBUSY``)
while a file is open for writing, and a store holds its lock and counter files so. Only an emergency remount (an
ext4 error) does that; the exported tests fake that ``EROFS`` mid-run.
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

SCRIPT = """
import errno, gc, json, os, subprocess, sys, warnings
import torch
from monai.data import CacheDataset, DataLoader, SharedCacheStore
from monai.transforms import Compose, RandomizableTransform, Transform

MNT = sys.argv[1]
N = 12


class Load(Transform):
    def __call__(self, i):
        with open(os.path.join(os.environ["LOG_DIR"], f"{os.getpid()}-{i}"), "a"):
            pass
        return {"src": i, "img": torch.full((64, 1024), float(i))}


class AddOne(RandomizableTransform):
    def __call__(self, d):
        d["img"] += 1
        return d


def fill_inodes(leave):
    made = []
    try:
        while True:
            path = os.path.join(MNT, f"filler-{len(made)}")
            open(path, "w").close()
            made.append(path)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    for path in made[len(made) - leave :] if leave else []:
        os.unlink(path)
    return made[: len(made) - leave]


def epochs(store):
    ds = CacheDataset(list(range(N)), Compose([Load(), AddOne()]), runtime_cache=store, progress=False)
    for _ in range(2):
        seen = []
        for batch in DataLoader(ds, batch_size=3, num_workers=2, timeout=120):
            for s, img in zip(batch["src"], batch["img"]):
                assert torch.equal(img, torch.full((64, 1024), float(s) + 1)), int(s)
                seen.append(int(s))
        assert sorted(seen) == list(range(N)), seen


def case(name, make, fillers=()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = make()
        epochs(store)
        items = sum(n.endswith(".item") for n in os.listdir(store.path)) if os.path.isdir(store.path) else 0
        store.close()
    for path in fillers:
        os.unlink(path)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    ours = sorted(n for n in os.listdir(MNT) if not n.startswith("filler-"))
    print(json.dumps({"case": name, "warnings": said, "items": items, "left": ours}), flush=True)


if __name__ == "__main__":  # spawned DataLoader workers import this file
    persistent = os.path.join(MNT, "kept")
    fillers = fill_inodes(0)
    case("full_at_open", lambda: SharedCacheStore(root=MNT), fillers)
    fillers = fill_inodes(0)
    case("full_at_open_persistent", lambda: SharedCacheStore(persistent, persistent=True), fillers)
    store = SharedCacheStore(root=MNT, reserve=0)
    # a few items fit, then the workers' writes meet ENOSPC: the store's own files take about 10 inodes when they are
    # made (7 directories, counters, notes), and each item 2 at most (its file, its stripe's lock file)
    fillers = fill_inodes(20)
    case("full_mid_run", lambda: store, fillers)
    case("persistent_made", lambda: SharedCacheStore(persistent, persistent=True, reserve=0))
    del store  # its descriptors: the kernel refuses to remount while a removed directory is open
    gc.collect()
    subprocess.run(["mount", "-o", "remount,ro", MNT], check=True)
    case("read_only_at_open", lambda: SharedCacheStore(root=MNT))
    case("read_only_at_open_persistent", lambda: SharedCacheStore(persistent, persistent=True))
    case("read_only_join_persistent", lambda: SharedCacheStore(persistent))
"""


@skip_unless_store
@skip_unless_linux
class TestFullAndReadOnlyMounts(unittest.TestCase):
    """A full and a read-only file system, at open and mid-run: the job goes on, and every item is right."""

    def test_full_and_read_only(self):
        reason = private_mount_namespace()
        if reason:
            self.skipTest(reason)
        with tempfile.TemporaryDirectory() as tmp:
            mnt, logs, script = os.path.join(tmp, "fs"), os.path.join(tmp, "logs"), os.path.join(tmp, "mounts.py")
            os.mkdir(mnt)
            os.mkdir(logs)
            with open(script, "w") as f:
                f.write(SCRIPT)
            shell = f'mount -t tmpfs -o size=256m,nr_inodes=64 tmpfs "$1" && exec {sys.executable} {script} "$1"'
            cmd = [*IN_PRIVATE_MOUNTS, shell, "sh", mnt]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=900, env={**ENV_DEFAULT_ROOT, "LOG_DIR": logs}
            )
            self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-4000:])
            cases = {row["case"]: row for row in map(json.loads, proc.stdout.splitlines())}
        opened = ("full_at_open", "full_at_open_persistent", "read_only_at_open")
        kept = ("read_only_at_open_persistent", "read_only_join_persistent")
        for name in opened + kept:  # one warning each, and items computed without the cache
            self.assertEqual(len(cases[name]["warnings"]), 1, (name, cases[name]["warnings"]))
            self.assertRegex(cases[name]["warnings"][0], "No space left|Read-only file system", name)
            self.assertEqual(cases[name]["items"], 12 if name in kept else 0, name)  # the kept items stay
        self.assertEqual(cases["full_at_open"]["left"], [])  # nothing made
        self.assertEqual(cases["full_at_open_persistent"]["left"], [])
        self.assertTrue(0 < cases["full_mid_run"]["items"] < 12, cases["full_mid_run"])  # then writes met ENOSPC
        self.assertEqual(cases["persistent_made"]["items"], 12)
        self.assertEqual(cases["persistent_made"]["left"], ["kept"])  # the temporary store was removed


if __name__ == "__main__":
    unittest.main()
