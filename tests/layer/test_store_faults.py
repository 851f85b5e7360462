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
The store under load and faults, with real processes: a replaced item that a reader maps stays counted (a tmpfs of
its own), a removed item is never served again on a full disk (a loop-mounted ext4 filled to its last block), a store
opened by 8 processes at once, what killed processes leave, and puts at the cap that never scan the store.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
import warnings

from monai_sharedcache import SharedCacheStore, persist
from tests.layer.layer_utils import (
    ENV,
    FORK,
    IN_PRIVATE_MOUNTS,
    TIMEOUT,
    private_mount_namespace,
    skip_unless_linux,
    skip_unless_store,
)

MIB = 2**20

# a writer re-puts 4 items of 9 MiB, 3 times, into a store of max_bytes 46 MiB whose items another process maps
REPLACE_SCRIPT = r"""
import json, multiprocessing, os, sys
import torch
from monai_sharedcache import SharedCacheStore

mnt, MIB = sys.argv[1], 2**20
keys = [f"k{i}" for i in range(4)]


def item(value):
    return torch.full((9 * MIB // 4,), float(value))


def used():
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def reader(path, ready, done):
    store = SharedCacheStore(path)
    held = [store.get(k) for k in keys]  # its mappings, as after any hit
    assert all(h is not None and float(h[0]) == 0.0 for h in held)
    ready.set()
    done.wait(120)


store = SharedCacheStore(root=mnt, max_bytes=46 * MIB, reserve=0)
base = used()
for k in keys:
    assert store.put(k, item(0))
ctx = multiprocessing.get_context("fork")
ready, done = ctx.Event(), ctx.Event()
proc = ctx.Process(target=reader, args=(store.path, ready, done))
proc.start()
assert ready.wait(120)
peak = 0
for value in (1, 2, 3):
    for k in keys:
        store.put(k, item(value))
        peak = max(peak, used() - base)
done.set()
proc.join(120)
assert proc.exitcode == 0, proc.exitcode
store.put("k1", item(4))  # the copies that nothing maps any more are freed for it
after, count = used() - base, store.stats()["nbytes"]
newest = [float(store.get(k)[0]) for k in keys]
print(json.dumps({"peak": peak, "after": after, "count": count, "newest": newest}))
"""

# a store on a disk with no free block discards an item that another process maps
FULL_DISK_SCRIPT = r"""
import json, multiprocessing, os, sys, warnings
import torch
from monai_sharedcache import SharedCacheStore

mnt = sys.argv[1]
path = os.path.join(mnt, "store")


def reader(ready, done):
    held = SharedCacheStore(path, persistent=True).get("K")
    assert held is not None
    ready.set()
    done.wait(120)


store = SharedCacheStore(path, persistent=True, reserve=0)
assert store.put("K", torch.full((9 * 2**20 // 4,), 1.0))
ctx = multiprocessing.get_context("fork")
ready, done = ctx.Event(), ctx.Event()
proc = ctx.Process(target=reader, args=(ready, done))
proc.start()
assert ready.wait(120)
fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT)  # the disk filled to its last block
for chunk in (2**20, 4096, 1):
    try:
        while True:
            os.write(fd, b"x" * chunk)
    except OSError:
        pass
os.fsync(fd)
os.close(fd)
free = os.statvfs(mnt).f_bfree
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    store.discard(["K"])
    after = [store.get("K"), store.get_or_compute("K", lambda: "new")]
told = [str(w.message) for w in caught]
done.set()
proc.join(120)
store.close()
next_run = SharedCacheStore(path, persistent=True).get("K")
print(json.dumps({"free": free, "after": after, "next_run": next_run, "told": told}))
"""


def _sudden_writer(path: str, conn) -> None:
    """Writes a big item, and tells the parent while it is written (to be killed then)."""
    from monai_sharedcache import _format

    write = _format.write_item

    def slow(fd, chunks):
        write(fd, chunks)
        conn.send("writing")
        signal.pause()

    _format.write_item = slow
    SharedCacheStore(path).put("big", b"x" * (4 * MIB))


def _sudden_claimant(path: str, conn) -> None:
    """Claims an item and computes it, and tells the parent while it computes (to be killed then)."""
    store = SharedCacheStore(path)
    store.get_or_compute("claimed", lambda: (conn.send("computing"), signal.pause()))


def _open_at_once(path: str, max_bytes: int, barrier, results) -> None:
    try:
        barrier.wait(TIMEOUT)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the budget of another run: the documented warning
            store = SharedCacheStore(path, persistent=True, max_bytes=max_bytes)
        ok = store.put(f"k{max_bytes}", max_bytes)
        # one run while any of them uses the store: one that opened after all others closed would start a new run
        barrier.wait(TIMEOUT)
        results.put((store.max_bytes, ok))
        store.close()
    except BaseException as err:
        barrier.abort()  # the others stop waiting for this one
        results.put(f"{type(err).__name__}: {err}")


def _puts_at_the_cap(path: str, start, results) -> None:
    """100 puts of new keys into a store at its cap; the number of scans of its directory."""
    scans = []
    items = persist.items
    persist.items = lambda at: (scans.append(1), items(at))[1]
    store = SharedCacheStore(path)
    start.wait(TIMEOUT)
    stored = sum(store.put(f"{os.getpid()}-{i}", b"y" * 512) for i in range(100))
    results.put((len(scans), stored))


@skip_unless_store
@skip_unless_linux
class TestStoreFaults(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def run_mounted(self, script: str, mount: str) -> dict:
        """``script`` in a private mount namespace where ``mount`` (a shell command, ``$1`` the mount point) ran."""
        reason = private_mount_namespace()
        if reason:
            self.skipTest(reason)
        path, mnt = os.path.join(self.tmp, "script.py"), os.path.join(self.tmp, "mnt")
        os.mkdir(mnt)
        with open(path, "w") as f:
            f.write(script)
        shell = f'{mount} && exec "$0" "$2" "$1"'
        cmd = [*IN_PRIVATE_MOUNTS, shell, sys.executable, mnt, path]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-4000:])
        return json.loads(proc.stdout.splitlines()[-1])

    def test_replaced_items_that_a_reader_maps_stay_counted(self):
        """``max_bytes`` bounds the memory that the store holds, the copies that readers map of replaced items too."""
        found = self.run_mounted(REPLACE_SCRIPT, 'mount -t tmpfs -o size=200m tmpfs "$1"')
        self.assertLessEqual(found["peak"], (46 + 9 + 1) * MIB)  # one item over, while it is written
        self.assertLessEqual(found["after"], (4 * 9 + 1) * MIB)  # freed once the reader is gone
        self.assertLess(abs(found["count"] - found["after"]), MIB)  # the count matches the memory
        self.assertEqual(found["newest"], [1.0, 4.0, 0.0, 0.0])  # k0 replaced once, the others refused past the cap

    def test_a_discarded_item_is_never_served_on_a_full_disk(self):
        image = os.path.join(self.tmp, "disk.img")
        with open(image, "wb") as f:
            f.truncate(64 * MIB)
        done = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], capture_output=True, text=True)
        if done.returncode != 0:
            self.skipTest(f"mkfs.ext4: {done.stderr.strip()}")
        # no clusters kept back for ext4's own metadata either: the file system's last block is filled
        mount = f'mount -o loop "{image}" "$1" && dev=$(findmnt -no SOURCE "$1") && '
        mount += 'echo 0 > "/sys/fs/ext4/${dev##*/}/reserved_clusters"'
        found = self.run_mounted(FULL_DISK_SCRIPT, mount)
        self.assertEqual(found["free"], 0)
        self.assertEqual(found["after"], [None, "new"])
        self.assertIsNone(found["next_run"])
        self.assertTrue(any("never served again" in m for m in found["told"]), found["told"])

    def test_processes_open_one_fresh_path_at_once(self):
        """8 processes open one new persistent path at once, with their own max_bytes: one store, one budget."""
        assert FORK is not None
        for r in range(5):
            path = os.path.join(self.tmp, f"sweep{r}")
            barrier, results = FORK.Barrier(8), FORK.Queue()
            procs = [FORK.Process(target=_open_at_once, args=(path, (i + 1) * MIB, barrier, results)) for i in range(8)]
            for p in procs:
                p.start()
            got = [results.get(timeout=TIMEOUT) for _ in procs]
            for p in procs:
                p.join(TIMEOUT)
            self.assertTrue(all(isinstance(g, tuple) and g[1] for g in got), got)
            budgets = {g[0] for g in got}  # the budget of whichever opened it first, for all
            self.assertEqual(len(budgets), 1, got)
            self.assertIn(budgets.pop(), [(i + 1) * MIB for i in range(8)])
            store = SharedCacheStore(path, persistent=True)
            self.assertEqual(
                sorted(store.get(f"k{(i + 1) * MIB}") for i in range(8)), [(i + 1) * MIB for i in range(8)]
            )
            store.close()

    def test_what_killed_processes_leave_is_cleaned_at_the_next_open(self):
        store = SharedCacheStore(root=self.tmp)
        self.addCleanup(store.close)
        procs = []
        for target, said in ((_sudden_writer, "writing"), (_sudden_claimant, "computing")):
            here, there = multiprocessing.Pipe()
            assert FORK is not None
            procs.append(FORK.Process(target=target, args=(store.path, there)))
            procs[-1].start()
            self.assertTrue(here.poll(TIMEOUT), f"{target.__name__} did not start")
            self.assertEqual(here.recv(), said)
        for proc in procs:  # SIGKILL, at the moments named: both had opened the store
            proc.kill()
            proc.join(TIMEOUT)
        self.assertEqual(len(os.listdir(os.path.join(store.path, ".tmp"))), 1)
        self.assertEqual(len(os.listdir(os.path.join(store.path, ".claims"))), 1)
        next_run = SharedCacheStore(store.path)  # opens, and would only read
        next_run.close()
        self.assertEqual(os.listdir(os.path.join(store.path, ".tmp")), [])
        self.assertEqual(os.listdir(os.path.join(store.path, ".claims")), [])
        self.assertEqual(store.stats()["nbytes"], 0)
        self.assertEqual(store.get_or_compute("claimed", lambda: 7), 7)  # no claim left to wait for

    def test_puts_at_the_cap_never_scan_the_store(self):
        """4 processes put at the cap of a store of 2,000 items: the count refuses them, with no scan of the store."""
        store = SharedCacheStore(root=self.tmp, max_bytes=2000 * 600, reserve=0)
        self.addCleanup(store.close)
        for i in range(2000):
            store.put(f"fill-{i}", b"x" * 512)
        assert FORK is not None
        start, results = FORK.Event(), FORK.Queue()
        procs = [FORK.Process(target=_puts_at_the_cap, args=(store.path, start, results)) for _ in range(4)]
        for p in procs:
            p.start()
        start.set()
        got = [results.get(timeout=TIMEOUT) for _ in procs]
        for p in procs:
            p.join(TIMEOUT)
        self.assertLessEqual(sum(scans for scans, _ in got), 4, got)  # at most one each, past RECOUNT_SECONDS
        self.assertLessEqual(store.stats()["nbytes"], store.max_bytes)


if __name__ == "__main__":
    unittest.main()
