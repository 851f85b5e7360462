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
"""The package's store with the Linux fast path, as users reach it: ``SharedCacheStore`` and ``create_shared_cache``."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import monai_sharedcache
from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, Lambda
from monai_sharedcache import SharedCacheStore
from monai_sharedcache import _pool as pool
from monai_sharedcache import create_shared_cache
from monai_sharedcache import store as core
from tests.layer.layer_utils import forks_wheel, keyed_dataset
from tests.test_utils import DistCall, DistTestCase

needs_store = unittest.skipUnless(core.SharedCacheStore.supported, "SharedCacheStore needs fcntl")
BIG = (512, 1024)  # 2 MiB of float32: a large item, mapped rather than read


def _big(i: int) -> dict:
    return {"i": i, "img": torch.full(BIG, float(i))}


class _Full:
    """A file whose writes fail as on a full file system."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> _Full:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


@needs_store
class TestLayerStore(DistTestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def test_names_of_the_package_are_the_stores(self):
        self.assertIs(SharedCacheStore, core.SharedCacheStore)
        store = create_shared_cache(root=self.root)  # no process group: a store of this process
        self.addCleanup(store.close)
        self.assertIs(type(store), SharedCacheStore)

    def test_a_removal_that_fails_warns_once(self):
        store = SharedCacheStore(root=self.root, reserve=0)
        self.addCleanup(store.close)
        for i in range(5):
            self.assertTrue(store.put(f"k{i}", i))

        def read_only(*args: Any) -> None:
            raise OSError(errno.EROFS, "Read-only file system")

        with mock.patch.object(monai_sharedcache._flock, "retire", read_only):
            with self.assertWarns(RuntimeWarning) as caught:
                store.discard([f"k{i}" for i in range(5)])
        self.assertEqual(len(caught.warnings), 1)
        self.assertIn("cannot remove items", str(caught.warning))
        self.assertEqual([store.get(f"k{i}") for i in range(5)], list(range(5)))  # nothing lost

    def test_workers_read_through_the_pool(self):
        """DataLoader workers receive the layer's store, read big items right, and the pool takes their mappings."""
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        ds = CacheDataset(
            list(range(4)), Compose([Lambda(_big)]), runtime_cache=store, hash_transform=store.hash_transform
        )
        for _ in range(2):  # the second epoch reads what the first stored
            loader = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="spawn")
            got = sorted((int(b["i"]), float(b["img"].mean()), tuple(b["img"].shape[1:])) for b in loader)
            self.assertEqual(got, [(i, float(i), BIG) for i in range(4)])
        self.assertEqual(store.stats()["filled"], 4)

    @unittest.skipUnless(pool.ENABLED, "the Linux fast path is off here")
    def test_a_mapping_is_reused(self):
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        store.put("big", torch.full((2048, 2048), 3.0))  # 16 MiB: past the pool's smallest mapping
        before, found = pool.POOL.take, []
        pool.POOL.take = lambda ident: found.append(before(ident)) or found[-1]  # type: ignore[method-assign]
        try:
            for _ in range(3):
                item = store.get("big")
                self.assertEqual(float(item.sum()), 3.0 * 2048 * 2048)
                del item
        finally:
            pool.POOL.take = before  # type: ignore[method-assign]
        self.assertEqual(len(found), 3)
        self.assertTrue(any(found), "no mapping of an earlier read was reused")

    def test_the_exact_keys_of_a_store(self):
        """
        A store given as ``runtime_cache`` with its ``hash_func`` and ``hash_transform`` keys by files' stat data: a
        file rewritten in place is recomputed at ``set_data`` with the same list, and the dataset notes its pipeline
        in the store.
        """
        path = os.path.join(self.root, "img.txt")
        Path(path).write_text("one")
        load = Lambda(lambda p: Path(p).read_text())  # no state of its own: the same key for the same file
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        ds = keyed_dataset([path], Compose([load]), store)
        self.assertEqual(ds[0], "one")
        self.assertEqual(len([n for n in os.listdir(store.path) if n.endswith(".item")]), 1)
        Path(path).write_text("two!")  # another size: other stat data
        ds.set_data([path])
        self.assertEqual((ds[0], ds[0]), ("two!", "two!"))
        if forks_wheel():  # its pipeline, noted (on the fork's wheel, which gives the store the dataset's inputs)
            self.assertEqual(len(os.listdir(os.path.join(store.path, ".notes"))), 1)

    def test_notes_and_records_are_whole_or_none(self):
        """A note that a full file system cut short leaves nothing to block its name; a record is replaced whole."""
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        real = os.fdopen
        with mock.patch.object(os, "fdopen", lambda fd, *a, **k: _Full(real(fd, *a, **k))):
            self.assertFalse(store.add_note("n", {"a": 1}))
        self.assertTrue(store.add_note("n", {"a": 2}))
        self.assertEqual((store.notes(), store.kept("n")), ({"n": {"a": 2}}, None))  # a store for this run only
        kept = SharedCacheStore(os.path.join(self.root, "kept"), persistent=True)
        self.addCleanup(kept.close)
        self.assertEqual((kept.add_note("n", 1), kept.notes()), (False, {}))  # notes would outlive the run
        for value in ([1, 2], 12345):
            kept.keep("r", value)
            self.assertEqual(kept.kept("r"), value)
        with mock.patch.object(os, "fdopen", lambda fd, *a, **k: _Full(real(fd, *a, **k))):
            kept.keep("r", 99)
        self.assertEqual((kept.kept("r"), os.listdir(os.path.join(kept.path, ".kept"))), (12345, ["r"]))

    def test_damaged_notes_and_records_are_none(self):
        """Nested past the recursion limit, of the wrong type or cut short: no note or record, never an exception."""
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        kept = SharedCacheStore(os.path.join(self.root, "kept"), persistent=True)
        self.addCleanup(kept.close)
        self.assertTrue(store.add_note("fine", 1))
        kept.keep("r", [1])
        for damage in ("[" * 100_000 + "]" * 100_000, '{"a": ', "\xff"):
            for where in (os.path.join(store.path, ".notes", "n"), os.path.join(kept.path, ".kept", "r")):
                with open(where, "w", encoding="latin-1") as f:
                    f.write(damage)
            self.assertEqual((store.notes(), kept.kept("r")), ({"fine": 1}, None))

    @DistCall(nproc_per_node=2, timeout=120)
    def test_create_shared_cache_across_ranks(self):
        """2 gloo ranks: one layer store per node, which both ranks use."""
        store = create_shared_cache(root=self.root)
        self.assertIs(type(store), monai_sharedcache.SharedCacheStore)
        if dist.get_rank() == 0:
            store.put("big", _big(7))
        dist.barrier()
        self.assertEqual(float(store.get("big")["img"].mean()), 7.0)
        paths = [None, None]
        dist.all_gather_object(paths, store.path)
        self.assertEqual(paths[0], paths[1])
        dist.barrier()
        store.close()


if __name__ == "__main__":
    unittest.main()
