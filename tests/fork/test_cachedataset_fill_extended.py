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
The tests of PR 03's ``fill()`` that do not fit its exported ``test_cachedataset_fill.py``: the progress bar,
``hash_as_key``, and a dataset without a runtime cache.
"""

from __future__ import annotations

import io
import os
import unittest
from collections import Counter
from contextlib import redirect_stderr

from parameterized import parameterized

from monai.data import CacheDataset
from monai.transforms import Compose
from monai_sharedcache import SharedCacheStore
from tests.layer import test_cachedataset_fill as layer_tests  # not its test class, which pytest would run here again
from tests.layer.test_cachedataset_fill import AddOne, Load, N, computations, needs_store
from tests.test_utils import SkipIfNoModule


class _TwoItems(SharedCacheStore):
    """A store with room for two items."""

    def _room_for(self, nbytes: int) -> str | None:
        full = len([n for n in os.listdir(self.path) if n.endswith(".item")]) >= 2
        return "room for two items" if full else super()._room_for(nbytes)


class TestFillExtended(unittest.TestCase):
    setUp, runtime_cache, dataset, check_items = (
        layer_tests.TestFill.setUp,
        layer_tests.TestFill.runtime_cache,
        layer_tests.TestFill.dataset,
        layer_tests.TestFill.check_items,
    )

    @SkipIfNoModule("tqdm")
    def test_progress_bar(self) -> None:
        for progress in (True, False):
            ds = self.dataset("thread", progress=progress)
            err = io.StringIO()
            with redirect_stderr(err):
                ds.fill()
            self.assertEqual("Loading dataset" in err.getvalue() and f"{N}/{N}" in err.getvalue(), progress)

    @parameterized.expand([("thread",), ("store",)])
    def test_hash_as_key_fills_the_unique_inputs(self, mode: str) -> None:
        data = [3, 1, 3, 0, 1, 2]
        ds = self.dataset(mode, data, hash_as_key=True)
        ds.fill()
        self.assertEqual(computations(self.log), Counter({0: 1, 1: 1, 2: 1, 3: 1}))
        self.check_items(ds, data)
        self.assertEqual(computations(self.log), Counter({0: 1, 1: 1, 2: 1, 3: 1}))

    def test_past_the_reserve_nothing_to_fill(self) -> None:
        """A store with no room left computes nothing in ``fill``: its items would not be stored."""
        store = self.runtime_cache("store", reserve=2**62)
        ds = CacheDataset(list(range(N)), Compose([Load(self.log), AddOne()]), runtime_cache=store, progress=False)
        with self.assertWarnsRegex(RuntimeWarning, "past the budget"):
            ds.fill()
        self.assertEqual(computations(self.log), Counter())
        self.check_items(ds)  # computed now, as a cache without room does

    @needs_store
    def test_nothing_to_fill_once_the_store_is_full(self) -> None:
        """Once the store has no room left, ``fill`` computes no more items, which would not be stored."""
        store = _TwoItems(root=self.tmp)
        self.addCleanup(store.close)
        ds = CacheDataset(list(range(N)), Compose([Load(self.log), AddOne()]), runtime_cache=store, progress=False)
        with self.assertWarnsRegex(RuntimeWarning, "past the budget"):
            ds.fill(num_threads=1)  # with more, the items under way when the store fills up are computed too
        self.assertEqual(sum(computations(self.log).values()), 2)
        self.check_items(ds)

    def test_no_runtime_cache_nothing_to_fill(self) -> None:
        ds = self.dataset("eager", cache_rate=0.5)
        ds.fill()
        self.assertEqual(computations(self.log), Counter(range(N // 2)))


if __name__ == "__main__":
    unittest.main()
