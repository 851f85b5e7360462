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
The fork's methods of ``CacheDataset`` (``ds.fill()``, ``ds.refresh()``, ``ds.cache_stats()``), in every mode of its
runtime cache, and a store's exact keys as the default: what the fork's wheel keeps of today's names. The package's
own functions (``monai_sharedcache.fill``, ...) are tested in tests/layer/, on MONAI with the series alone too.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import unittest
from collections import Counter
from pathlib import Path

import torch
from parameterized import parameterized

import monai_sharedcache
from monai.data import CacheDataset, SharedCacheStore, create_shared_cache
from monai.transforms import Compose, Lambda
from tests.layer import test_cachedataset_fill as fill_tests
from tests.layer import test_cachedataset_shared_store as store_tests
from tests.layer import test_keys as keys_tests
from tests.layer.test_cachedataset_fill import AddOne, Load, N, computations, needs_store
from tests.layer.test_keys import Holds, Scale
from tests.layer.test_real_pipelines import SHAPE, inverted, pipeline, write_nifti
from tests.layer.test_stats import ITEM_BYTES, NO_EVENTS, counts
from tests.test_utils import SkipIfNoModule

MODES = [("eager",), ("thread",), ("process",), ("list",), ("listproxy",), ("store",)]


class _Datasets(unittest.TestCase):
    """The datasets of the ``fill`` tests of tests/layer, with the fork's default keys."""

    setUp = fill_tests.TestFill.setUp
    runtime_cache = fill_tests.TestFill.runtime_cache
    check_items = fill_tests.TestFill.check_items

    def dataset(self, mode: str, data=None, **kwargs) -> CacheDataset:
        """A dataset of ``mode``'s runtime cache, with the fork's default keys."""
        kwargs.setdefault("progress", False)
        data = list(range(N)) if data is None else data
        return CacheDataset(data, Compose([Load(self.log), AddOne()]), runtime_cache=self.runtime_cache(mode), **kwargs)


class TestFillMethod(_Datasets):
    @parameterized.expand(MODES)
    def test_fill_computes_each_item_once(self, mode: str) -> None:
        ds = self.dataset(mode, num_workers=4)
        self.assertEqual(sum(computations(self.log).values()), N if mode == "eager" else 0)
        ds.fill()
        self.assertEqual(computations(self.log), Counter(range(N)))
        ds.fill()  # everything is cached: nothing to compute
        self.check_items(ds)
        self.check_items(ds)
        self.assertEqual(computations(self.log), Counter(range(N)))

    def test_threads(self) -> None:
        """``ds.fill(num_threads)`` of a thread cache (``runtime_cache=True``)."""
        ds = self.dataset("thread")
        ds.fill(num_threads=3)
        self.assertEqual(computations(self.log), Counter(range(N)))
        for bad in (0, -1, 1.5, True):
            with self.assertRaisesRegex(ValueError, "num_threads must be a positive integer"):
                ds.fill(num_threads=bad)  # type: ignore[arg-type]


class TestStatsMethod(_Datasets):
    @parameterized.expand(MODES)
    def test_counts_after_fill(self, mode: str) -> None:
        ds = self.dataset(mode, num_workers=4)
        ds.fill()
        self.check_items(ds)
        self.check_items(ds)
        stats = ds.cache_stats()
        self.assertEqual(stats["process"], {"hits": 2 * N, "misses": 0, "computed": N, "refused": 0})
        self.assertEqual(counts(stats["cache"]), stats["process"])  # this process alone used the cache
        store = mode == "store" or (mode == "process" and SharedCacheStore.supported)
        proxy = mode == "listproxy" or (mode == "process" and not store)  # not counted: it would copy every item out
        self.assertEqual(stats["dataset"], {"capacity": N, "filled": None if proxy else N})
        if proxy:
            self.assertEqual((stats["cache"]["filled"], stats["cache"]["nbytes"]), (None, None))
        elif store:  # the item files, with their headers
            self.assertEqual(stats["cache"]["filled"], N)
            self.assertGreater(stats["cache"]["nbytes"], N * ITEM_BYTES)
        else:
            self.assertEqual((stats["cache"]["filled"], stats["cache"]["nbytes"]), (N, N * ITEM_BYTES))

    def test_lazy_misses_then_hits(self) -> None:
        ds = self.dataset("thread")
        self.check_items(ds)
        self.check_items(ds)
        self.assertEqual(ds.cache_stats()["process"], {"hits": N, "misses": N, "computed": N, "refused": 0})

    @parameterized.expand([("thread",), ("store",)])
    def test_hash_as_key_counts(self, mode: str) -> None:
        data = [3, 1, 3, 0, 1, 2]
        ds = self.dataset(mode, data, hash_as_key=True)
        ds.fill()
        self.check_items(ds, data)
        self.assertEqual(ds.cache_stats()["process"], {"hits": 6, "misses": 0, "computed": 4, "refused": 0})

    def test_counts_without_a_runtime_cache(self) -> None:
        ds = self.dataset("eager", cache_rate=0.5)
        ds.fill()
        stats = ds.cache_stats()
        self.assertEqual((stats["cache"]["filled"], stats["dataset"]), (N // 2, {"capacity": N // 2, "filled": N // 2}))
        self.assertEqual(stats["process"], {**NO_EVENTS, "computed": N // 2})


class TestStoreDefaults(_Datasets):
    @needs_store
    def test_a_store_keys_by_its_exact_keys_by_default(self) -> None:
        """A store given as ``runtime_cache`` keys by its own ``hash_func`` and ``hash_transform`` unless others are."""
        store = self.runtime_cache("store")
        ds = CacheDataset(list(range(4)), Compose([Load(self.log), AddOne()]), runtime_cache=store, progress=False)
        self.assertEqual((ds.hash_func, ds.hash_transform), (store.hash_func, store.hash_transform))
        ds.fill()
        self.check_items(ds, range(4))
        self.assertEqual(ds.cache_stats()["process"], {"hits": 4, "misses": 0, "computed": 4, "refused": 0})

    @needs_store
    def test_refresh_method(self) -> None:
        """``ds.refresh()`` drops the dataset's items from its store, and those alone."""
        store = self.runtime_cache("store")
        store.put("other", 1)  # an item of another dataset
        ds = CacheDataset(list(range(4)), Compose([Load(self.log), AddOne()]), runtime_cache=store, progress=False)
        ds.fill()
        ds.refresh()
        self.assertEqual(ds.cache_stats()["dataset"], {"capacity": 4, "filled": 0})
        self.check_items(ds, range(4))
        self.assertEqual(computations(self.log), Counter(list(range(4)) * 2))  # once before the refresh, once after
        self.assertEqual(store.get("other"), 1)


class TestSharedStoreRefresh(unittest.TestCase):
    """The shared store test of tests/layer with the fork's ``ds.refresh()``."""

    setUp = store_tests.TestSharedStore.setUp
    check_epochs = store_tests.TestSharedStore.check_epochs

    @needs_store
    def test_refresh_drops_the_items_of_the_dataset_only(self):
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        store.put("other", 1)
        ds = CacheDataset(list(range(4)), Compose([store_tests.Load(self.log), store_tests.AddOne()]),
                          runtime_cache=store, progress=False)  # fmt: skip
        self.check_epochs(ds)
        ds.refresh()
        self.check_epochs(ds)
        self.assertEqual(store_tests._computed(self.log), sorted(list(range(4)) * 2))
        self.assertEqual(store.get("other"), 1)


@needs_store
class TestForkNames(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def test_names_of_monai_data_are_the_packages(self):
        self.assertIs(SharedCacheStore, monai_sharedcache.SharedCacheStore)
        self.assertIs(create_shared_cache, monai_sharedcache.create_shared_cache)
        store = create_shared_cache(root=self.root)  # no process group: a store of this process
        self.addCleanup(store.close)
        self.assertIs(type(store), SharedCacheStore)

    def test_the_forks_keys_for_a_store(self):
        """
        A store given as ``runtime_cache`` is keyed by its exact keys by default: a file rewritten in place is
        recomputed at ``set_data`` with the same list, and the dataset notes its pipeline in the store.
        """
        path = os.path.join(self.root, "img.txt")
        Path(path).write_text("one")
        load = Lambda(lambda p: Path(p).read_text())  # no state of its own: the same key for the same file
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        ds = CacheDataset([path], Compose([load]), runtime_cache=store)
        self.assertEqual(ds[0], "one")
        self.assertEqual(len([n for n in os.listdir(store.path) if n.endswith(".item")]), 1)
        Path(path).write_text("two!")  # another size: other stat data
        ds.set_data([path])
        self.assertEqual((ds[0], ds[0]), ("two!", "two!"))
        self.assertEqual(len(os.listdir(os.path.join(store.path, ".notes"))), 1)  # its pipeline, noted


class TestFileStampsByDefault(keys_tests.TestFileStamps):
    """The key tests of tests/layer with the fork's default keys of a container: the package's, unless given."""

    keys: dict = {}


class TestTransformsFingerprintByDefault(keys_tests.TestTransformsFingerprint):
    keys: dict = {}

    def test_one_container_of_two_pipelines_is_told(self):
        container: list = []
        ds_a = CacheDataset([1, 2], Compose([Holds("a"), Scale()]), runtime_cache=container, progress=False)
        ds_b = CacheDataset([1, 2], Compose([Holds("b"), Scale()]), runtime_cache=container, progress=False)
        self.assertEqual(ds_a[0], 2)
        with self.assertWarnsRegex(UserWarning, "item of the same input computed by other cached transforms"):
            self.assertEqual(ds_b[0], 2)


@SkipIfNoModule("nibabel")
class TestInvertListProxyItems(unittest.TestCase):
    def test_a_dataset_that_did_not_compute_the_item_inverts_it(self) -> None:
        """Two datasets on one ``ListProxy``, each with its own transforms, as two ranks have them."""
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        data = [{"image": os.path.join(tmp, "img.nii.gz")}]
        write_nifti(data[0]["image"], 0)
        manager = multiprocessing.get_context("spawn").Manager()
        self.addCleanup(manager.shutdown)
        container = manager.list()
        mine, theirs = pipeline(), pipeline()
        CacheDataset(data, mine, runtime_cache=container, progress=False)[0]  # computed with `mine`
        ds = CacheDataset(data, theirs, runtime_cache=container, progress=False)
        self.assertEqual(tuple(inverted(ds[0], theirs).shape), (1, *SHAPE))
        torch.testing.assert_close(inverted(ds[0], theirs), inverted(theirs(dict(data[0])), theirs))


if __name__ == "__main__":
    unittest.main()
