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
The store as a keyed runtime cache, and the package's functions over a dataset (``fill``, ``refresh``,
``cache_stats``), against a stand-in of the upstream ``CacheDataset`` with ``cache_key``, until the series has it.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import unittest
import warnings
from pathlib import Path
from typing import Any

import monai_sharedcache
from monai.transforms import Compose, Lambda
from monai_sharedcache import SharedCacheStore
from tests.layer.layer_utils import DictCache
from tests.layer.test_cache_store import needs_store

CALLS: list = []  # the inputs that the cached transform read, in this process


def _load(path: str) -> str:
    CALLS.append(path)
    return Path(path).read_text()


class _Keyed:
    """What the upstream ``CacheDataset`` with a keyed runtime cache offers the package: public attributes only."""

    def __init__(self, data: list, transform: Compose, cache: Any, hash_func: Any, hash_transform: Any) -> None:
        self.data, self.transform, self.runtime_cache = data, transform, cache
        self.cache_num, self.hash_as_key, self.as_contiguous, self.progress = len(data), False, False, False
        self.hash_func, self.hash_transform = hash_func, hash_transform
        self.tag = hash_transform(transform.transforms).decode()

    def cache_key(self, index: int) -> str | None:
        return self.hash_func(self.data[index]).decode() + self.tag if index < self.cache_num else None

    def __getitem__(self, index: int) -> Any:  # as the series' CacheDataset serves a cached index
        key = self.cache_key(index)
        item = self.runtime_cache.get(key)
        if item is None:
            item = self.transform(self.data[index])
            self.runtime_cache[key] = item
        return item


@needs_store
class TestKeyedProtocol(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)
        CALLS.clear()
        self.calls = CALLS

    def new_store(self) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        return store

    def dataset(self, store: SharedCacheStore, data: list) -> _Keyed:
        return _Keyed(data, Compose([Lambda(_load)]), store, store.hash_func, store.hash_transform)

    def files(self, n: int) -> list[str]:
        paths = [os.path.join(self.root, f"img{i}.txt") for i in range(n)]
        for i, p in enumerate(paths):
            Path(p).write_text(str(i))
        return paths

    def test_mapping_protocol(self):
        store = self.new_store()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a key of the user's own: no warning
            store["k"] = {"a": 1}
        with self.assertWarnsRegex(RuntimeWarning, "hash_func=store.hash_func"):  # a key of pickle_hashing alone
            store.put("0123456789abcdef0123456789abcdef", 1)
        self.assertEqual((store["k"], "k" in store, "x" in store, store.get("x")), ({"a": 1}, True, False, None))
        with self.assertRaises(KeyError):
            store["x"]
        with self.assertRaisesRegex(TypeError, "CacheDataset keyed runtime caches"):
            store[0]  # upstream 1.6.1 indexes a runtime cache by position: never an item of another key

    def test_exact_keys_fill_refresh_stats(self):
        store = self.new_store()
        paths = self.files(3)
        ds = self.dataset(store, paths)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # keyed by the store's functions: no warning
            monai_sharedcache.fill(ds, num_threads=2)
        self.assertEqual(sorted(self.calls), sorted(paths))
        self.assertEqual([ds[i] for i in range(3)], ["0", "1", "2"])
        self.assertEqual(len(self.calls), 3)  # every item read from the store
        stats = monai_sharedcache.cache_stats(ds)
        self.assertEqual(stats["dataset"], {"capacity": 3, "filled": 3})
        self.assertEqual(stats["process"]["hits"], 3)
        Path(paths[1]).write_text("one, rewritten")  # other stat data: another key
        self.assertEqual(ds[1], "one, rewritten")
        monai_sharedcache.refresh(ds)
        self.assertEqual(monai_sharedcache.cache_stats(ds)["dataset"]["filled"], 0)

    def test_key_functions_pickle_with_the_store(self):
        store = self.new_store()
        paths = self.files(1)
        ds = self.dataset(store, paths)
        ds[0]
        other = pickle.loads(pickle.dumps((store.hash_func, store.hash_transform)))
        self.assertEqual(other[0](paths[0]), store.hash_func(paths[0]))
        self.assertTrue(other[0].__self__._keyed)

    def test_fill_needs_cache_key(self):
        store = self.new_store()
        ds = self.dataset(store, self.files(1))
        ds.cache_key = None  # a CacheDataset of MONAI without the series
        with self.assertRaisesRegex(TypeError, "needs MONAI with CacheDataset keyed runtime caches"):
            monai_sharedcache.fill(ds)

    def test_another_keyed_cache(self):
        """Any ``KeyedCache`` (``get`` and ``put``) is filled and refreshed; a ``dict`` (no ``put``) is not keyed."""
        store = self.new_store()
        ds = self.dataset(store, self.files(2))
        ds.runtime_cache = DictCache({})
        monai_sharedcache.fill(ds)
        self.assertEqual(sorted(ds.runtime_cache.items.values()), ["0", "1"])
        self.assertEqual(monai_sharedcache.cache_stats(ds)["dataset"], {"capacity": 2, "filled": None})
        monai_sharedcache.refresh(ds)
        self.assertEqual(ds.runtime_cache.items, {})
        ds.runtime_cache = {}
        with self.assertRaisesRegex(TypeError, "KeyedCache: an object with get and put.*type dict"):
            monai_sharedcache.fill(ds)


if __name__ == "__main__":
    unittest.main()
