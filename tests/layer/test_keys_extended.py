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
The fork's keys (``monai_sharedcache.keys``) across separate interpreter runs of one training script on a persistent
store: every edit that can change an item (a module function, a method, a global constant, a default argument and
a closure value in ``__main__``, a ``multiprocessing.Value``, a file rewritten in place) is recomputed, and a run
where nothing changed (another ``PYTHONHASHSEED`` included) computes nothing; 2 gloo ranks with other hash seeds
compute each item once, and 2 ranks whose pipelines differ in one member are each told which.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

from tests.layer.layer_utils import TIMEOUT, needs_forks_wheel, skip_unless_store

N = 4

USERFN = """
K = {k}


def f(x):
    return x * K + {f_add}


class Helper:
    def shift(self, x):
        return x + {shift}
"""

# one run: how many items this process computed, and how many it served that differ from a direct computation
SCRIPT = """
import json, logging, multiprocessing, os, sys, threading, warnings
import numpy as np
import torch
from monai.data import CacheDataset
from monai.transforms import Compose, Transform
from monai_sharedcache import SharedCacheStore, cache_stats, create_shared_cache
import userfn

OFFSET = {offset}


def main_fn(x, k={default}):
    return x * k + OFFSET


def make(c):
    return lambda x: x + c


class Pipeline(Transform):
    def __init__(self, member):
        self.member, self.tags = member, {{"liver", "spleen", "kidney", "lung"}}
        self.closure, self.helper = make({closure}), userfn.Helper()

    def __call__(self, path):
        x = torch.as_tensor(np.load(path))
        value = float(self.member.value) if hasattr(self.member, "value") else 0.0
        return self.helper.shift(self.closure(userfn.f(main_fn(x)))) + value


MEMBERS = {{"lock": threading.Lock, "logger": lambda: logging.getLogger("run")}}
MEMBERS.update(value2=lambda: multiprocessing.Value("d", 2.0), value3=lambda: multiprocessing.Value("d", 3.0))

if __name__ == "__main__":
    store_path, members, data = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    member = members[int(os.environ.get("RANK", 0)) % len(members)]  # "lock,logger": each rank its own
    if os.environ.get("RANK"):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="file://" + os.environ["INIT"], rank=int(os.environ["RANK"]), world_size=2)
        store = create_shared_cache(root=store_path, timeout=120)
    else:
        store = SharedCacheStore(store_path, persistent=True)
    t = Compose([Pipeline(MEMBERS[member]())])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = CacheDataset(data, t, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform)
        if os.environ.get("RANK"):
            dist.barrier()  # as DDP's model setup: both ranks have made their datasets
        bad = sum(not torch.equal(ds[i], t.transforms[0](p)) for i, p in enumerate(data))
    told = [str(w.message) for w in caught if "with other cached transforms" in str(w.message)]
    print(json.dumps({{"computed": cache_stats(ds)["process"]["computed"], "bad": bad, "told": told}}), flush=True)
    if os.environ.get("RANK"):
        dist.barrier()
        store.close()
        dist.destroy_process_group()
"""

BASE = {"k": 2, "f_add": 0, "shift": 0, "offset": 0.0, "default": 1, "closure": 0}


@skip_unless_store
class TestKeysAcrossRuns(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.store = os.path.join(self.tmp, "store")
        self.data = []
        for i in range(N):
            self.data.append(os.path.join(self.tmp, f"in{i}.npy"))
            np.save(self.data[-1], np.full(3, float(i)))
            backdate(self.data[-1])

    def write(self, **changes: object) -> None:
        values = {**BASE, **changes}
        with open(os.path.join(self.tmp, "userfn.py"), "w") as f:
            f.write(USERFN.format(**values))
        with open(os.path.join(self.tmp, "run.py"), "w") as f:
            f.write(SCRIPT.format(**values))

    def env(self, seed: str = "0", **extra: str) -> dict:
        path = os.pathsep.join([self.tmp] + [p for p in sys.path if p])
        return {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1", **extra}

    def run_script(self, member: str = "lock", seed: str = "0", data: list | None = None, cwd: str | None = None):
        cmd = [sys.executable, os.path.join(self.tmp, "run.py"), self.store, member, *(data or self.data)]
        out = subprocess.run(cmd, env=self.env(seed), cwd=cwd or self.tmp, capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        facts = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(facts["told"], [])  # the notes of earlier runs are not of this one
        return facts["computed"], facts["bad"]

    def test_an_edit_recomputes_and_nothing_changed_computes_nothing(self):
        """Each edit that can change an item recomputes every item; going back, or another hash seed, computes none."""
        self.write()
        self.assertEqual(self.run_script(seed="1"), (N, 0))
        self.assertEqual(self.run_script(seed="2"), (0, 0))  # a set member, another PYTHONHASHSEED: all reused
        edits = {"module function": {"f_add": 1}, "method": {"shift": 5}, "module constant": {"k": 3}}
        edits.update(
            {"global in __main__": {"offset": 0.5}, "default argument": {"default": 2}, "closure": {"closure": 7}}
        )
        for what, change in edits.items():
            self.write(**change)
            self.assertEqual(self.run_script(), (N, 0), what)
        self.write()
        self.assertEqual(self.run_script(seed="3"), (0, 0))  # the first version's items are still there

    def test_members_and_files(self):
        """Locks and loggers share across runs; Values of other content never; a rewritten file and relative names."""
        self.write()
        self.assertEqual(self.run_script("logger"), (N, 0))
        self.assertEqual(self.run_script("logger"), (0, 0))
        self.assertEqual(self.run_script("value2"), (N, 0))
        self.assertEqual(self.run_script("value3"), (N, 0))  # never the items of value2
        self.assertEqual(self.run_script("value2"), (0, 0))
        st = os.stat(self.data[0])
        np.save(self.data[0], np.full(3, 9.0))  # in place: the same size, and the same mtime restored
        os.utime(self.data[0], ns=(st.st_atime_ns, st.st_mtime_ns))
        self.assertEqual(self.run_script("value2"), (1, 0))
        for project, value in (("a", 1.0), ("b", 2.0)):  # the same relative name in two directories
            os.makedirs(os.path.join(self.tmp, project))
            np.save(os.path.join(self.tmp, project, "img.npy"), np.full(3, value))
        self.assertEqual(self.run_script("value2", data=["img.npy"], cwd=os.path.join(self.tmp, "a")), (1, 0))
        self.assertEqual(self.run_script("value2", data=["img.npy"], cwd=os.path.join(self.tmp, "b")), (1, 0))

    def run_ranks(self, members: str) -> list[dict]:
        """2 gloo ranks on one node, torchrun-style, each with its own PYTHONHASHSEED, one store."""
        self.write()
        root = os.path.join(self.tmp, f"root-{members}")
        os.makedirs(root, mode=0o700)
        cmd = [sys.executable, os.path.join(self.tmp, "run.py"), root, members, *self.data]
        init = os.path.join(self.tmp, f"init-{members}")
        procs = []
        try:
            for rank in range(2):
                env = self.env(str(rank + 11), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", INIT=init)
                procs.append(
                    subprocess.Popen(cmd, env=env, cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                )
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(TIMEOUT)
        self.assertEqual([p.returncode for p in procs], [0, 0], [e[-3000:] for _, e in outs])
        facts = [json.loads(o.decode().strip().splitlines()[-1]) for o, _ in outs]
        self.assertEqual([f["bad"] for f in facts], [0, 0])
        return facts

    def test_two_ranks_with_other_hash_seeds_compute_each_item_once(self):
        facts = self.run_ranks("lock")
        self.assertEqual(sum(f["computed"] for f in facts), N, facts)
        self.assertEqual([f["told"] for f in facts], [[], []])

    @needs_forks_wheel
    def test_two_ranks_whose_pipelines_differ_in_one_member_are_told(self):
        facts = self.run_ranks("lock,logger")  # a member of another type on each rank
        self.assertEqual(sum(f["computed"] for f in facts), 2 * N, facts)  # each item once per pipeline
        for f in facts:
            self.assertEqual(len(f["told"]), 1, facts)
            self.assertIn("What differs: transform 0 (Pipeline), member member.", f["told"][0])


def backdate(path: str) -> None:
    """Modified a minute ago: older than RACY_SECONDS, so that its digest is memoized as an old file's would be."""
    past = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(past, past))


if __name__ == "__main__":
    unittest.main()
