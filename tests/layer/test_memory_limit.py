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
The layer's store on a memory-backed file system keeps its reserve below the memory limit of its cgroup, not only of
its file system (the core's store sees the file system alone).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
from unittest import mock

import numpy as np
from parameterized import parameterized

from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _memory as memory
from tests.layer.layer_utils import (
    ENV_DEFAULT_ROOT,
    IN_PRIVATE_MOUNTS,
    private_mount_namespace,
    skip_unless_linux,
    skip_unless_store,
)

# in a private mount namespace with a tmpfs on /sys/fs/cgroup: this process's memory cgroup (v1 and v2 alike, at the
# paths /proc/self/cgroup gives) limited to 64 MiB, of which 40 are used, on a /dev/shm of 1 GiB
CGROUP_SCRIPT = """
import os
import numpy as np
from monai_sharedcache import SharedCacheStore

for line in open("/proc/self/cgroup").read().splitlines():
    hierarchy, controllers, path = line.split(":", 2)
    if hierarchy == "0" and not controllers:
        where, names = "/sys/fs/cgroup" + path, ("memory.max", "memory.current")
    elif "memory" in controllers.split(","):
        where, names = "/sys/fs/cgroup/memory" + path, ("memory.limit_in_bytes", "memory.usage_in_bytes")
    else:
        continue
    os.makedirs(where, exist_ok=True)
    for name, value in zip(names, (64 << 20, 40 << 20)):
        with open(os.path.join(where, name), "w") as f:
            f.write(str(value))
store = SharedCacheStore(reserve=16 << 20)
assert store.path.startswith("/dev/shm/"), store.path
assert store.put("fits", np.ones((4 << 20) // 8))  # 24 MiB left by the cgroup, less 4, keeps the 16 MiB reserve
assert not store.put("refused", np.ones((12 << 20) // 8))  # the file system has 1 GiB free: the cgroup refuses it
print("ok", flush=True)
"""


@skip_unless_store
@skip_unless_linux
class TestCgroupLimit(unittest.TestCase):
    @parameterized.expand(
        [
            (
                "v2",
                "0::/pod/ctr",
                {"pod/memory.max": 64 << 20, "pod/memory.current": 40 << 20, "pod/ctr/memory.max": "max"},
            ),
            (
                "v1",
                "7:memory:/pod/ctr",
                {"memory/pod/memory.limit_in_bytes": 64 << 20, "memory/pod/memory.usage_in_bytes": 40 << 20},
            ),
        ]
    )
    def test_memory_limit_of_the_cgroup(self, _, proc, files):
        if memory.fs_type("/dev/shm") not in memory.MEMORY_FS:
            self.skipTest("needs a memory-backed /dev/shm (tmpfs)")
        fake = tempfile.mkdtemp()  # a cgroup tree: the pod limited to 64 MiB, of which 40 are used
        self.addCleanup(shutil.rmtree, fake, True)
        with open(os.path.join(fake, "cgroup"), "w") as f:
            f.write("1:cpu:/pod\n" + proc + "\n")
        for name, value in files.items():
            os.makedirs(os.path.dirname(os.path.join(fake, name)), exist_ok=True)
            with open(os.path.join(fake, name), "w") as f:
                f.write(f"{value}\n")
        shm = tempfile.mkdtemp(dir="/dev/shm")  # far more free than the cgroup leaves
        self.addCleanup(shutil.rmtree, shm, True)
        with mock.patch.multiple(memory, PROC_CGROUP=os.path.join(fake, "cgroup"), CGROUP_FS=fake):
            self.assertEqual(memory.cgroup_room(), (64 << 20, 24 << 20))
            store = SharedCacheStore(root=shm, reserve=16 << 20)
            self.addCleanup(store.close)
            self.assertEqual(store.free_space(), (24 << 20, 64 << 20))
            self.assertTrue(store.put("fits", np.ones((4 << 20) // 8)))  # 24 - 4 MiB >= 16 MiB
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertFalse(store.put("refused", np.ones((12 << 20) // 8)))  # 24 - 12 MiB < 16 MiB
        (message,) = [str(w.message) for w in caught if "budget" in str(w.message)]
        self.assertIn("24 MiB are free of 64 MiB where its items count", message)

    @parameterized.expand(
        [
            ("v2", "0::/pod", {"pod/memory.max": 64 << 20, "pod/memory.current": 60 << 20}, "inactive_file"),
            (
                "v1",
                "7:memory:/pod",
                {"memory/pod/memory.limit_in_bytes": 64 << 20, "memory/pod/memory.usage_in_bytes": 60 << 20},
                "total_inactive_file",
            ),
        ]
    )
    def test_reclaimable_page_cache_is_room(self, _, proc, files, stat_name):
        """Input files read fill the page cache toward the limit: what the kernel reclaims first is room (kubelet)."""
        fake = tempfile.mkdtemp()  # 60 of 64 MiB used, 36 of them inactive page cache: 40 MiB are left
        self.addCleanup(shutil.rmtree, fake, True)
        with open(os.path.join(fake, "cgroup"), "w") as f:
            f.write(proc + "\n")
        where = os.path.dirname(os.path.join(fake, next(iter(files))))
        os.makedirs(where)
        for name, value in files.items():
            with open(os.path.join(fake, name), "w") as f:
                f.write(f"{value}\n")
        with open(os.path.join(where, "memory.stat"), "w") as f:
            f.write(f"anon 1\nshmem 5\n{stat_name}x 7\n{stat_name} {36 << 20}\nactive_file 9\n")
        with mock.patch.multiple(memory, PROC_CGROUP=os.path.join(fake, "cgroup"), CGROUP_FS=fake):
            self.assertEqual(memory.cgroup_room(), (64 << 20, 40 << 20))
            with open(os.path.join(where, "memory.stat"), "w") as f:
                f.write(f"{stat_name} lots\n")  # damaged: nothing counts as reclaimable
            self.assertEqual(memory.cgroup_room(), (64 << 20, 4 << 20))

    def test_faked_cgroup_limit_below_free_space(self):
        """In a private mount namespace, a faked cgroup tree and a 1 GiB /dev/shm: the limit refuses what fits."""
        reason = private_mount_namespace()
        if reason:
            self.skipTest(reason)
        mount = "mount -t tmpfs -o size=1g tmpfs /dev/shm && mount -t tmpfs tmpfs /sys/fs/cgroup"
        cmd = [*IN_PRIVATE_MOUNTS, f'{mount} && exec "$0" -c "$1"']
        cmd += [sys.executable, CGROUP_SCRIPT]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV_DEFAULT_ROOT)
        self.assertEqual((proc.returncode, proc.stdout.strip()), (0, "ok"), proc.stderr[-2000:])


if __name__ == "__main__":
    unittest.main()
