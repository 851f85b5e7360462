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

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

from monai_sharedcache import SharedCacheStore, keys
from monai_sharedcache.keys import file_digest

TIMEOUT = 120

# One run of a training script: a CacheDataset of file inputs on a persistent store; it prints the files that the
# keys read (their content hashed), the items computed and the items' values.
RUN = """
import builtins, json, sys
import numpy as np
import monai_sharedcache.keys as keys
from monai.data import CacheDataset
from monai.transforms import Compose, Lambda
from monai_sharedcache import SharedCacheStore, cache_stats

reads, real_open = [], builtins.open
keys.open = lambda path, *args, **kwargs: (reads.append(path), real_open(path, *args, **kwargs))[1]
store = SharedCacheStore(sys.argv[1], persistent=True)
files = json.loads(sys.argv[2])
load = Compose([Lambda(lambda f: np.load(f) + 1)])
ds = CacheDataset(
    files, load, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform, progress=False
)
values = [float(ds[i][0]) for i in range(len(ds))]
print(json.dumps({"reads": len(reads), "computed": cache_stats(ds)["process"]["computed"], "values": values}))
store.close()
"""


def _save(path: str, value: float, age: float) -> None:
    """Write an input file, modified ``age`` seconds ago (a file modified just now is hashed again by any run)."""
    np.save(path, np.full(4, value))
    os.utime(path, (time.time() - age,) * 2)


def _digest_in_child(path: str) -> None:
    os._exit(0 if len(file_digest(path, os.stat(path))[0]) == 32 else 1)


@unittest.skipUnless(hasattr(os, "fork"), "needs fork")
class TestDigestsAfterFork(unittest.TestCase):
    def test_a_fork_while_another_thread_holds_a_lock(self):
        """Forked while another thread holds any lock of the module: the child still takes digests (none is held)."""
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"data")
            f.flush()
            locks = [v for v in vars(keys).values() if isinstance(v, type(threading.Lock()))]
            for lock in locks:
                lock.acquire()
            try:
                ctx = multiprocessing.get_context("fork")
                child = ctx.Process(target=_digest_in_child, args=(f.name,))
                child.start()
                child.join(30)
                if child.is_alive():
                    child.kill()
                    child.join(TIMEOUT)
                    self.fail("the child waits for a lock that its parent held at the fork")
                self.assertEqual(child.exitcode, 0)
            finally:
                for lock in locks:
                    lock.release()


@unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
class TestDigestsAcrossRuns(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.store = os.path.join(self.tmp, "cache")
        self.files = [os.path.join(self.tmp, f"img{i}.npy") for i in range(3)]
        for i, f in enumerate(self.files):
            _save(f, i, 3600)

    def run_script(self) -> dict:
        cmd = [sys.executable, "-c", RUN, self.store, json.dumps(self.files)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, check=False)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        return json.loads(out.stdout.splitlines()[-1])

    def test_a_new_run_reads_only_the_files_that_changed(self):
        first = self.run_script()
        self.assertEqual((first["reads"], first["computed"], first["values"]), (3, 3, [1.0, 2.0, 3.0]))
        again = self.run_script()  # nothing changed: no file is read, no item computed
        self.assertEqual((again["reads"], again["computed"], again["values"]), (0, 0, [1.0, 2.0, 3.0]))

        _save(self.files[1], 10, 1800)  # rewritten: read again, and its item computed again
        copy = self.files[2] + ".copy"  # copied again, the same content: read again, nothing computed
        shutil.copy2(self.files[2], copy)
        os.replace(copy, self.files[2])
        edited = self.run_script()
        self.assertEqual((edited["reads"], edited["computed"], edited["values"]), (2, 1, [1.0, 11.0, 3.0]))

        name = hashlib.sha256(self.files[0].encode()).hexdigest()[:40]
        record = os.path.join(self.store, ".kept", f"digest-{name}")  # one record per file
        with open(record, "w") as f:  # torn: that file is read again, the items are reused
            f.write("[1, 2")
        damaged = self.run_script()
        self.assertEqual((damaged["reads"], damaged["computed"], damaged["values"]), (1, 0, [1.0, 11.0, 3.0]))

    def test_only_a_private_record_of_the_store_is_read(self):
        store = SharedCacheStore(self.store, persistent=True)
        self.addCleanup(store.close)
        store.keep("digests", {"a": 1})
        self.assertEqual(store.kept("digests"), {"a": 1})
        record = os.path.join(self.store, ".kept", "digests")
        os.chmod(record, 0o666)  # writable by others: not read
        self.assertIsNone(store.kept("digests"))
        planted = os.path.join(self.tmp, "planted.json")
        with open(planted, "w") as f:
            json.dump({"a": 2}, f)
        os.remove(record)
        os.symlink(planted, record)  # a link: not followed
        self.assertIsNone(store.kept("digests"))
        store.keep("digests", {"a": 3})  # replaces the link, never writes through it
        self.assertEqual(store.kept("digests"), {"a": 3})
        with open(planted) as f:
            self.assertEqual(json.load(f), {"a": 2})
        with self.assertRaises(ValueError):
            store.keep("../x", 1)
        temporary = SharedCacheStore()  # not persistent: nothing kept
        self.addCleanup(temporary.close)
        temporary.keep("digests", {"a": 1})
        self.assertIsNone(temporary.kept("digests"))

    def test_a_record_counts_only_well_formed_and_for_the_same_stat_data(self):
        path = os.path.join(self.tmp, "other.npy")
        _save(path, 5, 3600)
        st = os.stat(path)
        digest, record = file_digest(path, st)  # read: a record to keep
        self.assertEqual(record, [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest.hex()])
        self.assertEqual(file_digest(path, st), (digest, None))  # this process knows it: nothing to keep
        for i, bad in enumerate([None, "x", {"a": 1}, record[:-1] + ["zz"], [True, *record[1:]], record[2:]]):
            copy = os.path.join(self.tmp, f"copy{i}.npy")
            shutil.copy2(path, copy)  # the same content under other stat data
            found, to_keep = file_digest(copy, os.stat(copy), lambda bad=bad: bad)
            self.assertEqual((found, to_keep is not None), (digest, True), bad)  # read, and a record to keep
        copy = os.path.join(self.tmp, "trusted.npy")
        shutil.copy2(path, copy)
        cst, planted = os.stat(copy), bytes(32)
        kept = [cst.st_dev, cst.st_ino, cst.st_size, cst.st_mtime_ns, cst.st_ctime_ns, planted.hex()]
        self.assertEqual(file_digest(copy, cst, lambda: kept), (planted, None))  # the same stat data: not read
        self.assertEqual(file_digest(copy, cst), (planted, None))  # and known to this process from now on
        self.assertEqual(file_digest(path, st, lambda: kept), (digest, None))  # another file's stat data: not used


if __name__ == "__main__":
    unittest.main()
