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
The layer's persistent store across real runs: the same script run again as a new process (DataLoader workers, a
killed fill, a writer killed mid-write), two runs at once in separate PID namespaces, and a file of another user (root
here).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
from collections import Counter

from monai_sharedcache import SharedCacheStore
from tests.layer.layer_utils import (
    ENV,
    IN_PRIVATE_MOUNTS,
    TIMEOUT,
    backdate,
    item_files,
    run_forked,
    skip_unless_store,
    unshare_works,
    wait_for,
)

N = 12

# one run of a training script: its cache stats and how many items it served wrong, as one line of JSON
SCRIPT = """
import json, os, sys, time
import torch
from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, RandomizableTransform, Transform
from monai_sharedcache import SharedCacheStore, cache_stats, fill


class Load(Transform):
    def __init__(self, scale, size):
        self.scale, self.size = scale, size

    def __call__(self, i):
        time.sleep(float(os.environ.get("DELAY", "0")))
        fd = os.open(os.environ["LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, f"{i}\\n".encode())
        os.close(fd)
        return {"i": i, "img": torch.full((self.size,), i * self.scale)}


class AddOne(RandomizableTransform):
    def __call__(self, d):
        d["img"] += 1
        return d



if __name__ == "__main__":
    path, scale, size, mode = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = SharedCacheStore(path, persistent=True)
    t = Compose([Load(scale, size), AddOne()])
    keys = {"hash_func": store.hash_func, "hash_transform": store.hash_transform}
    ds = CacheDataset(list(range(int(os.environ["N"]))), t, runtime_cache=store, **keys, num_workers=1, progress=False)
    if mode == "fill":
        fill(ds)
    bad = 0
    for b in DataLoader(ds, batch_size=1, num_workers=2):
        bad += not torch.equal(b["img"], torch.full((1, size), int(b["i"]) * scale + 1))
    print(json.dumps({**cache_stats(ds)["cache"], "bad": bad}), flush=True)
"""


# on a file system mounted noatime, the kernel never sets access times: the store's reads must (least recently used)
_NOATIME_LRU = """
import os, sys, time
from monai_sharedcache import SharedCacheStore
path = os.path.join(sys.argv[1], "cache")
store = SharedCacheStore(path, persistent=True)
for k in ("old", "used"):
    store.put(k, bytes(100_000))
nbytes = store.stats()["nbytes"] // 2
store.close()
now = time.time_ns()
for k, age in (("old", 10), ("used", 20)):  # "used" was used longer ago: evicted first, unless this run reads it
    name = os.path.join(path, store._stem(k) + ".item")
    os.utime(name, ns=(now - age * 10**9, now - 30 * 10**9))
store = SharedCacheStore(path, persistent=True, max_bytes=2 * nbytes + 1000, reserve=0)
assert store.get("used") is not None
assert store.put("new", bytes(100_000))
print(sorted(k for k in ("old", "used", "new") if store.get(k) is not None))
"""


# back-to-back runs on a file system that keeps whole seconds (ext4 with 128-byte inodes): the second run reuses all
_COARSE_REUSE = """
import os, sys
from monai_sharedcache import SharedCacheStore
for run in range(5):
    path = os.path.join(sys.argv[1], f"cache{run}")
    store = SharedCacheStore(path, persistent=True)
    store.put("a", 1)
    store.close()
    store = SharedCacheStore(path, persistent=True)
    assert store.get("a") == 1
    assert store.stats()["reused"] == 1, store.stats()
    store.close()
print("ok")
"""


def _open_read_only_directory(path: str, out: str) -> None:
    """As an ordinary user (uid 65534, here root's child): open ``path`` (0500, theirs) as a persistent store."""
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)  # no capability left: the directory's mode holds
    try:
        SharedCacheStore(path, persistent=True)
        message = "opened"
    except PermissionError as err:
        message = str(err)
    fd = os.open(out, os.O_WRONLY)  # made by the parent, writable by the child
    os.write(fd, message.encode())
    os.close(fd)


@skip_unless_store
class TestPersistentRuns(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()  # on the disk here: fsync, page cache
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.path = os.path.join(self.tmp, "cache")
        self.log = os.path.join(self.tmp, "log")
        self.script = os.path.join(self.tmp, "train.py")
        with open(self.script, "w") as f:
            f.write(SCRIPT)

    def start(self, scale: float = 1.0, size: int = 1000, mode: str = "lazy", delay: float = 0.0, prefix=()):
        env = {**ENV, "LOG": self.log, "N": str(N), "DELAY": str(delay)}
        cmd = [*prefix, sys.executable, self.script, self.path, str(scale), str(size), mode]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(TIMEOUT)))
        return proc

    def finish(self, proc: subprocess.Popen) -> dict:
        out, err = proc.communicate(timeout=4 * TIMEOUT)
        self.assertEqual(proc.returncode, 0, err)
        return json.loads(out.strip().splitlines()[-1])

    def run_script(self, **kwargs) -> dict:
        return self.finish(self.start(**kwargs))

    def computed(self) -> Counter:
        with open(self.log) as f:
            return Counter(int(line) for line in f)

    def test_second_run_computes_nothing_and_serves_every_item_right(self):
        first = self.run_script()
        self.assertEqual((first["computed"], first["bad"], first["filled"]), (N, 0, N))
        second = self.run_script()
        self.assertEqual((second["computed"], second["reused"], second["hits"], second["bad"]), (0, N, N, 0))
        self.assertEqual(self.computed(), Counter(range(N)))
        changed = self.run_script(scale=3.0)  # another parameter: every item again, never an old one
        self.assertEqual((changed["computed"], changed["reused"], changed["bad"]), (N, 0, 0))
        back = self.run_script()
        self.assertEqual((back["computed"], back["reused"], back["bad"]), (0, N, 0))
        self.assertEqual(self.computed(), Counter(dict.fromkeys(range(N), 2)))

    def test_run_killed_mid_fill(self):
        proc = self.start(mode="fill", delay=0.3)
        wait_for(lambda: os.path.isdir(self.path) and len(item_files(self.path)) >= 4)
        proc.send_signal(signal.SIGKILL)
        proc.wait(TIMEOUT)
        done = len(item_files(self.path))
        self.assertLess(done, N)
        again = self.run_script(mode="fill")
        self.assertEqual((again["computed"], again["reused"], again["bad"], again["filled"]), (N - done, done, 0, N))

    def test_writer_killed_mid_write(self):
        tmp = os.path.join(self.path, ".tmp")
        proc = self.start(mode="fill", size=16_000_000)  # 64 MB items, written and fsynced to the disk
        wait_for(lambda: os.path.isdir(tmp) and any(os.path.getsize(e.path) for e in os.scandir(tmp)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(TIMEOUT)
        for entry in os.scandir(tmp):  # the killed writer's temporary file: old enough to be removed
            backdate(entry.path)
        again = self.run_script(mode="fill", size=16_000_000)
        self.assertEqual((again["bad"], again["filled"]), (0, N))
        self.assertEqual(os.listdir(tmp), [])

    @unittest.skipUnless(unshare_works(), "cannot start a process in a new PID namespace here (unshare --pid)")
    def test_two_runs_at_once_in_separate_pid_namespaces(self):
        ns = ("unshare", "--pid", "--fork", "--kill-child")
        procs = [self.start(mode="fill", delay=0.1, prefix=ns) for _ in range(2)]
        results = [self.finish(p) for p in procs]
        self.assertEqual([r["bad"] for r in results], [0, 0])
        self.assertEqual(self.computed(), Counter(range(N)))  # each item once, by one of the two

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0, "needs root to mount a tmpfs (unshare --mount)")
    def test_reads_set_access_times_on_noatime_mounts(self):
        mnt = os.path.join(self.tmp, "mnt")
        os.mkdir(mnt, 0o700)
        mount = f'mount -t tmpfs -o noatime,size=64m,mode=0700 tmpfs {mnt} && exec "$0" -c "$1" {mnt}'
        cmd = [*IN_PRIVATE_MOUNTS, mount, sys.executable, _NOATIME_LRU]
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
        if done.returncode and "mount" in done.stderr and "Traceback" not in done.stderr:
            self.skipTest(f"cannot mount a tmpfs in a private mount namespace here: {done.stderr.strip()}")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.split("\n")[-2], "['new', 'used']")  # "old" went; "used", read by this run, stayed

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0, "needs root to loop-mount a file system")
    def test_sessions_on_a_file_system_of_whole_seconds(self):
        image, mnt = os.path.join(self.tmp, "fs.img"), os.path.join(self.tmp, "coarse")
        os.mkdir(mnt, 0o700)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", image, "16M"], capture_output=True, text=True)
        if made.returncode:
            self.skipTest(f"cannot make an ext4 image here: {made.stderr.strip()}")
        mount = f'mount -o loop {image} {mnt} && chmod 700 {mnt} && exec "$0" -c "$1" {mnt}'
        cmd = [*IN_PRIVATE_MOUNTS, mount, sys.executable, _COARSE_REUSE]
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
        if done.returncode and "mount" in done.stderr and "Traceback" not in done.stderr:
            self.skipTest(f"cannot loop-mount a file system in a private mount namespace here: {done.stderr.strip()}")
        self.assertEqual((done.returncode, done.stdout.strip()), (0, "ok"), done.stderr)

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0, "needs root to chown a file to another user")
    def test_file_of_another_user_is_refused(self):
        store = SharedCacheStore(self.path, persistent=True)
        store.put("a", 1)
        store.close()
        (item,) = item_files(self.path)
        os.chown(os.path.join(self.path, item), 65534, 65534)
        self.assertIsNone(SharedCacheStore(self.path, persistent=True).get("a"))  # an item of another user: a miss
        os.chown(os.path.join(self.path, item), os.getuid(), os.getgid())
        self.assertEqual(SharedCacheStore(self.path, persistent=True).get("a"), 1)
        os.chown(os.path.join(self.path, ".budget"), 65534, 65534)  # a file of the store's own: the store is refused
        with self.assertRaisesRegex(PermissionError, "'.budget' in it is owned by uid 65534"):
            SharedCacheStore(self.path, persistent=True)

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0, "needs root, to act as another user")
    def test_directory_that_its_user_cannot_write(self):
        os.chmod(self.tmp, 0o755)
        os.mkdir(self.path, 0o500)  # empty, the user's own, read-only
        os.chown(self.path, 65534, 65534)
        out = os.path.join(self.tmp, "out")
        os.close(os.open(out, os.O_WRONLY | os.O_CREAT, 0o666))
        os.chmod(out, 0o666)
        self.assertEqual(run_forked(_open_read_only_directory, self.path, out), 0)
        with open(out) as f:
            message = f.read()
        for part in (f"cannot make a persistent store in {self.path!r}", "this user cannot write", "mode 0700"):
            self.assertIn(part, message)
        self.assertEqual(os.listdir(self.path), [])  # nothing made


if __name__ == "__main__":
    unittest.main()
