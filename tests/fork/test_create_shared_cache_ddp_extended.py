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
The tests of PR 04 that do not fit its exported ``test_create_shared_cache.py``: root and reserve reach the store, a
rank's share of its node's CPUs, and one rank refreshing the node's store between barriers.
"""

from __future__ import annotations

import os
import unittest
import warnings
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
from parameterized import parameterized

from monai.data import create_shared_cache
from monai_sharedcache import SharedCacheStore
from monai_sharedcache import distributed as shared_cache
from monai_sharedcache.distributed import share_of_cpus
from tests.layer import test_create_shared_cache as layer_tests  # not its test class, which pytest would run here again
from tests.layer.test_create_shared_cache import TIMEOUT, N, computed, needs_store
from tests.test_utils import DistCall, DistTestCase, skip_if_quick


class TestCreateSharedCacheExtended(DistTestCase):
    setUp, dataset = layer_tests.TestCreateSharedCache.setUp, layer_tests.TestCreateSharedCache.dataset

    @needs_store
    def test_root_and_reserve_reach_the_store(self) -> None:
        cases = [({"reserve": 0}, None), ({"reserve": 1 << 62}, "reserve")]
        for kwargs, refused_by in cases:
            store = create_shared_cache(root=self.root, **kwargs)
            self.addCleanup(store.close)
            self.assertEqual(os.listdir(self.root), [os.path.basename(store.path)])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertEqual(store.put("k", torch.ones(8)), refused_by is None, kwargs)
                self.assertEqual(store.get_or_compute("c", lambda: 5), 5)  # computed, stored or not
            self.assertEqual((store.get("k"), store.get("c")) == (None, None), refused_by is not None, kwargs)
            messages = [str(w.message) for w in caught]
            self.assertEqual(len(messages), 0 if refused_by is None else 1, messages)
            self.assertTrue(all(refused_by in m and "--shm-size" in m for m in messages), messages)
            store.close()

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_no_store_to_join_a_store_of_its_own(self) -> None:
        """Where the node's creator has no store to share (made without room), the other rank warns and makes one."""

        def without_room_on_the_creator(path=None, **kwargs) -> SharedCacheStore:
            store = SharedCacheStore(path, **kwargs)
            if dist.get_rank() == 0:
                store.close()  # no directory to join, as when none could be made
            return store

        without_room_on_the_creator.supported = SharedCacheStore.supported  # type: ignore[attr-defined]
        with (
            warnings.catch_warnings(record=True) as caught,
            mock.patch.object(shared_cache, "SharedCacheStore", without_room_on_the_creator),
        ):
            warnings.simplefilter("always")
            store = shared_cache.create_shared_cache(root=self.root)
        self.addCleanup(store.close)
        joined = [str(w.message) for w in caught if "cannot join" in str(w.message)]
        self.assertEqual(len(joined), dist.get_rank(), joined)
        self.assertTrue(dist.get_rank() == 0 or store.put("k", 1), "rank 1's own store stores")

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_one_rank_refreshes_for_the_node(self) -> None:
        """Rank 0 refreshes between barriers, as the guide says: both ranks then read items computed once more."""
        rank, store = dist.get_rank(), create_shared_cache(root=self.root, timeout=TIMEOUT)
        ds = self.dataset(store)
        for epoch in range(3):
            dist.barrier()  # every rank has finished the epoch
            if epoch == 2 and rank == 0:
                ds.refresh()
            dist.barrier()  # no rank reads before the items are dropped
            for i in range(N):
                self.assertTrue(torch.equal(ds[i]["img"], torch.full((2, 3), i + 1.0)), (epoch, i))
        dist.barrier()
        self.assertEqual(computed(self.log), Counter(dict.fromkeys(range(N), 2)))
        store.close()

    @parameterized.expand(
        [
            ("alone", {0, 1, 2, 3}, [{0, 1, 2, 3}], 4),
            ("unbound ranks share the node", {0, 1, 2, 3}, [{0, 1, 2, 3}, {0, 1, 2, 3}], 2),
            ("ranks bound to their own cores", {0, 1}, [{0, 1}, {2, 3}], 2),
            ("at most this rank's cores", {0}, [{0}, {1, 2, 3, 4, 5}], 1),
            ("more ranks than cores", {0, 1}, [{0, 1}] * 4, 1),
        ]
    )
    def test_share_of_cpus(self, _, mine: set, node: list, expected: int) -> None:
        """A rank's share of its node's CPUs: the CPUs of the node's ranks, divided evenly among them."""
        self.assertEqual(share_of_cpus(mine, node), expected)


if __name__ == "__main__":
    unittest.main()
