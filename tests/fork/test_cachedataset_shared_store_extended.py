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
The tests of PR 02's wiring that do not fit its exported ``test_cachedataset_shared_store.py``: a subclass's own
directories, ``MetaTensor`` items stored out of band, and a killed run's store removed by the next run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import unittest

import torch

from monai.data import CacheDataset, MetaTensor
from monai.transforms import Compose
from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _format as fmt
from tests.layer import test_cachedataset_shared_store as layer_tests  # not its class: pytest would run it here
from tests.layer.test_cachedataset_shared_store import TIMEOUT, AddOne, Load, needs_store


def _killed_run(root: str, log: str) -> None:
    """A training run that caches its items, then is killed (as by the OOM killer): nothing of it can clean up."""
    ds = CacheDataset(list(range(4)), Compose([Load(log), AddOne()]), runtime_cache=SharedCacheStore(root=root))
    for i in range(4):
        ds[i]
    os.kill(os.getpid(), signal.SIGKILL)


class TestSharedStoreExtended(unittest.TestCase):
    setUp, check_epochs = layer_tests.TestSharedStore.setUp, layer_tests.TestSharedStore.check_epochs

    @needs_store
    def test_a_subclass_keeps_its_own_files_in_a_checked_directory(self):
        store = SharedCacheStore(root=self.root)
        notes = store._subdir(".notes")  # made private, opened and checked; the same one again
        self.assertEqual((os.lstat(notes.path).st_mode & 0o777, store._subdir(".notes").path), (0o700, notes.path))
        os.symlink(self.tmp, os.path.join(store.path, ".link"))
        with self.assertRaisesRegex(PermissionError, "symbolic link"):
            store._subdir(".link")  # never followed
        for bad in ("../x", "notes", ".a/b", ""):
            with self.assertRaisesRegex(ValueError, "a dot, then"):
                store._subdir(bad)
        at = store._directory  # the store's own directory, as opened and checked: not its path
        os.rename(store.path, store.path + "-moved")
        os.mkdir(store.path, 0o700)
        self.assertEqual((os.fstat(at.fd).st_ino, at.stat(".notes").st_ino), (os.stat(store.path + "-moved").st_ino,
                         os.stat(notes.path.replace(store.path, store.path + "-moved")).st_ino))  # fmt: skip
        os.rmdir(store.path)
        os.rename(store.path + "-moved", store.path)
        store.close()  # goes with the store
        self.assertEqual(os.listdir(self.root), [])
        for closed in (lambda: store._subdir(".notes"), lambda: store._directory):
            with self.assertRaises(FileNotFoundError):
                closed()

    @needs_store
    def test_metatensor_items_are_stored_out_of_band(self):
        item = {"img": MetaTensor(torch.arange(6.0).reshape(2, 3), meta={"filename_or_obj": "a.nii"})}
        chunks, _ = fmt.encode("k", item)
        raw = item["img"].numpy().tobytes()
        self.assertTrue(any(bytes(c) == raw for _, c in chunks[2:]))  # its bytes out of band, read back as a view
        store = SharedCacheStore()
        self.addCleanup(store.close)
        store.put("k", item)
        got = store.get("k")["img"]
        self.assertEqual(
            (type(got), got.meta["filename_or_obj"], got.tolist()), (MetaTensor, "a.nii", [[0, 1, 2], [3, 4, 5]])
        )

    @needs_store
    def test_killed_run_is_cleaned_up(self):
        proc = multiprocessing.get_context("spawn").Process(target=_killed_run, args=(self.root, self.log))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, -signal.SIGKILL)
        (left,) = os.listdir(self.root)
        self.assertEqual(len([n for n in os.listdir(os.path.join(self.root, left)) if n.endswith(".item")]), 4)
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        ds = CacheDataset(list(range(4)), Compose([Load(self.log), AddOne()]), runtime_cache=store)
        self.assertEqual(os.listdir(self.root), [os.path.basename(store.path)])  # the dead run's: gone
        self.assertEqual([ds[i]["img"][0].item() for i in range(4)] * 2, [1.0, 2.0, 3.0, 4.0] * 2)


if __name__ == "__main__":
    unittest.main()
