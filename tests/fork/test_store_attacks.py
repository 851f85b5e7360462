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
The store as another local user attacks it (the checked directory and the cleaners of PR 02, the persistent
store of the fork's layer). Needs root: a second, ordinary user (``monai-attacker``) is made for the tests and removed after them;
its actions are shell commands run with ``setpriv``. The victim is this process (root's privileges do not matter
here: the store checks who owns what, not who may access it).

The attacker can write the parent of the victim's store (a shared project directory, mode 0777), renames the store
away and puts a directory of its own in its place, holding everything a store holds: the mark, the files of a
persistent store, and, under the victim's keys, items whose unpickling runs the attacker's code (it creates a file).
"""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import subprocess
import tempfile
import unittest

import torch
from fork_utils import TIMEOUT, Evil, skip_unless_store

from monai.data import CacheDataset, DataLoader, SharedCacheStore
from monai_sharedcache import _format as fmt

ATTACKER = "monai-attacker"
N = 12


def _attacker() -> tuple[int, int] | str:
    """The uid and gid of the attacker, made if missing; or why it cannot be made here."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv(1) to make a second user and act as it"
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:
        made = subprocess.run(["useradd", "-M", "-s", "/bin/sh", ATTACKER], capture_output=True, timeout=TIMEOUT)
        if made.returncode != 0:
            return f"cannot make a user: {made.stderr.decode(errors='replace').strip()}"
    entry = pwd.getpwnam(ATTACKER)
    return entry.pw_uid, entry.pw_gid


def _as_attacker(ids: tuple[int, int], script: str) -> None:
    cmd = ["setpriv", f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", "sh", "-ec", script]
    subprocess.run(cmd, check=True, timeout=TIMEOUT, capture_output=True)


def double(x: dict) -> dict:
    return {"v": x["v"] * 2}


@skip_unless_store
class TestAnotherUser(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        ids = _attacker()
        if isinstance(ids, str):
            raise unittest.SkipTest(ids)
        cls.ids = ids

    @classmethod
    def tearDownClass(cls) -> None:
        subprocess.run(["userdel", ATTACKER], capture_output=True, timeout=TIMEOUT)

    def setUp(self) -> None:
        self.base = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.base, True)
        os.chmod(self.base, 0o755)
        self.proj = os.path.join(self.base, "proj")
        os.mkdir(self.proj)
        os.chmod(self.proj, 0o777)  # a shared project directory: the attacker can write it
        self.canary = os.path.join(self.base, "pwned")
        os.chmod(self.base, 0o777)  # where the canary can be made

    def swap(self, store: SharedCacheStore, extra: str = "") -> None:
        """Rename the store away and put the attacker's copy in its place, with a planted item for every key."""
        planted = os.path.join(self.base, "planted")
        os.mkdir(planted)
        for name in os.listdir(store.path):
            if name.endswith(".item"):
                with open(os.path.join(store.path, name), "rb") as f:
                    head = f.read(1 << 16)
                key_len = fmt._PREFIX.unpack_from(head, 0)[5]  # the key the file holds, which it must match
                key = head[fmt._PREFIX.size : fmt._PREFIX.size + key_len].decode("utf-8", "surrogatepass")
                chunks, _ = fmt.encode(key, Evil(self.canary), weights_only=False)  # past the allow-list
                fd = os.open(os.path.join(planted, name), os.O_WRONLY | os.O_CREAT, 0o644)
                fmt.write_item(fd, chunks)
                os.close(fd)
        os.chmod(planted, 0o755)
        name = os.path.basename(store.path)
        _as_attacker(
            self.ids,
            f"cd {self.proj}; mv {name} {name}.old; mkdir -m 700 {name}; cd {name}; mkdir -m 700 .tmp; "
            f"touch .monai-cache .lock .persistent .session; cp {planted}/*.item .; chmod 600 ./*.item; {extra}",
        )

    def test_parent_swap_with_planted_items(self):
        store = SharedCacheStore(os.path.join(self.proj, "cache"), persistent=True)
        self.addCleanup(store.close)
        ds = CacheDataset([{"v": i} for i in range(N)], double, runtime_cache=store)
        ds.fill()
        self.swap(store)
        self.assertEqual([ds[i]["v"] for i in range(N)], [2 * i for i in range(N)])  # the main process
        loader = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="fork", timeout=TIMEOUT)
        self.assertEqual(sorted(int(b["v"]) for b in loader), [2 * i for i in range(N)])  # they keep the directory
        loader = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="spawn", timeout=TIMEOUT)
        with self.assertRaisesRegex(RuntimeError, "exited unexpectedly"):
            list(loader)  # a spawned worker opens the path anew: the replacement is refused (PermissionError)
        with self.assertRaisesRegex(PermissionError, "owned by uid"):
            pickle.loads(pickle.dumps(store))
        with self.assertRaisesRegex(PermissionError, "owned by uid"):
            SharedCacheStore(os.path.join(self.proj, "cache"), persistent=True)  # the next run: refused, not read
        self.assertFalse(os.path.exists(self.canary))  # none of the attacker's code ran

    def test_tmp_symlink_to_the_victims_files(self):
        victim = os.path.join(self.base, "home", ".ssh")
        os.makedirs(victim, 0o700)
        for name in ("id_ed25519", "authorized_keys"):
            with open(os.path.join(victim, name), "w") as f:
                f.write(name)
            os.utime(os.path.join(victim, name), (1, 1))  # as old as a dead temporary file
        os.environ["MONAI_CACHE_ROOT"] = self.proj
        self.addCleanup(os.environ.pop, "MONAI_CACHE_ROOT")
        store = SharedCacheStore()
        self.addCleanup(store.close)
        store.put("k", torch.arange(4))
        self.swap(store, f"rmdir .tmp; ln -s {victim} .tmp")
        for i in range(3):
            self.assertTrue(store.put(f"k{i}", i))  # each write cleans the store's own .tmp
        other = SharedCacheStore()  # cleans the leftovers of the root, the attacker's directory among them
        other.close()
        store.close()
        self.assertEqual(sorted(os.listdir(victim)), ["authorized_keys", "id_ed25519"])
        self.assertFalse(os.path.exists(self.canary))


if __name__ == "__main__":
    unittest.main()
