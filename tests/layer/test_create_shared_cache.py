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

import functools
import os
import shutil
import stat
import tempfile
import threading
import time
import unittest
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader
from monai.transforms import Compose, Lambda, RandomizableTransform, Transform
from monai_sharedcache import SharedCacheStore, create_shared_cache, fill
from monai_sharedcache.distributed import process_cpus, share_of_cpus
from tests.layer.layer_utils import keyed_dataset
from tests.test_utils import DistCall, DistTestCase, skip_if_quick

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
N = 12
TIMEOUT = 120  # seconds for any wait on another process
SHORT = 3.0  # the `timeout` of create_shared_cache while the other rank never calls it


class Load(Transform):
    """Deterministic: logs ``<i> <pid>`` at each computation (one O_APPEND write: atomic across processes)."""

    def __init__(self, log: str, delay: float = 0.05) -> None:
        self.log, self.delay = log, delay  # long enough for the other readers of the item to miss it meanwhile

    def __call__(self, i: int) -> dict:
        time.sleep(self.delay)
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{i} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return {"i": i, "img": torch.full((2, 3), float(i))}


class AddOne(RandomizableTransform):
    def __call__(self, d: dict) -> dict:
        d["img"] += 1  # in place: an item shared with the cache would come back with 2, then 3
        return d


def computed(log: str) -> Counter:
    """How many times each input was computed, by any process."""
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line.split()[0]) for line in f if line.strip())


def _meet(where: str, n: int, worker_id: int) -> None:
    """A DataLoader worker's init: wait until ``n`` workers (of all ranks) have started, so that they read at once."""
    open(os.path.join(where, f"worker-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + TIMEOUT
    while len([f for f in os.listdir(where) if f.startswith("worker-")]) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def gather(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class TestCreateSharedCache(DistTestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.root, self.log = os.path.join(self.tmp, "root"), os.path.join(self.tmp, "log")
        os.mkdir(self.root, 0o700)

    def dataset(self, store: SharedCacheStore, delay: float = 0.05) -> CacheDataset:
        transform = Compose([Load(self.log, delay), AddOne()])
        return keyed_dataset(list(range(N)), transform, store, progress=False)

    def read_all(self, ds: CacheDataset, ranks: int = 1) -> None:
        """Read every item twice with 2 DataLoader workers, which start together with those of the other ranks."""
        init = functools.partial(_meet, self.tmp, 2 * ranks)
        loader = DataLoader(
            ds, batch_size=2, num_workers=2, timeout=TIMEOUT, persistent_workers=True, worker_init_fn=init
        )
        for _ in range(2):  # the same order in every rank: the ranks' workers miss the same items at the same time
            got = []
            for batch in loader:
                for i, img in zip(batch["i"].tolist(), batch["img"]):
                    self.assertTrue(torch.equal(img, torch.full((2, 3), i + 1.0)), (i, img))
                    got.append(i)
            self.assertEqual(got, list(range(N)))

    @parameterized.expand(
        [("zero_timeout", {"timeout": 0}), ("negative_timeout", {"timeout": -1.5}), ("reserve", {"reserve": -1})]
    )
    def test_bad_arguments(self, _, kwargs) -> None:
        with self.assertRaisesRegex(ValueError, next(iter(kwargs))):
            create_shared_cache(root=self.root, **kwargs)
        self.assertEqual(os.listdir(self.root), [])

    def test_unsupported_platform_raises_before_any_collective(self) -> None:
        names = ("all_gather_object", "barrier", "monitored_barrier", "new_group", "broadcast_object_list")
        fakes = {name: mock.Mock(side_effect=AssertionError(f"a collective call: {name}")) for name in names}
        with mock.patch.object(SharedCacheStore, "supported", False), mock.patch.multiple(dist, **fakes):
            with mock.patch.object(dist, "is_initialized", return_value=True):  # as in every rank of a job
                with self.assertRaisesRegex(NotImplementedError, "fcntl.*runtime_cache='process'"):
                    create_shared_cache(root=self.root, timeout=SHORT)
        self.assertEqual({name: fake.call_count for name, fake in fakes.items()}, dict.fromkeys(names, 0))
        self.assertEqual(os.listdir(self.root), [])

    @needs_store
    def test_without_a_process_group_a_local_store(self) -> None:
        """Not initialized: a new store of this process in `root`, which its DataLoader workers share."""
        self.assertFalse(dist.is_initialized())
        store = create_shared_cache(root=self.root, timeout=SHORT)
        self.addCleanup(store.close)
        self.assertIsInstance(store, SharedCacheStore)
        self.assertEqual(os.listdir(self.root), [os.path.basename(store.path)])
        self.assertEqual(stat.S_IMODE(os.stat(store.path).st_mode), 0o700)
        self.read_all(self.dataset(store))
        self.assertEqual(computed(self.log), Counter(range(N)))  # each item once, by the workers
        store.close()
        self.assertEqual(os.listdir(self.root), [])

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_two_ranks_share_one_store(self) -> None:
        """2 ranks x 2 DataLoader workers read every item: one store for the node, each item computed once in it."""
        rank = dist.get_rank()
        store = create_shared_cache(root=self.root, timeout=TIMEOUT)
        paths = gather(store.path)
        self.assertEqual((paths[0], os.listdir(self.root)), (paths[1], [os.path.basename(store.path)]))
        self.read_all(self.dataset(store), ranks=2)
        dist.barrier()
        self.assertEqual(computed(self.log), Counter(range(N)))
        for closing in (0, 1):  # the store stays while a rank of the node uses it
            dist.barrier()
            if rank == closing:
                store.close()
            dist.barrier()
            self.assertEqual(os.path.isdir(store.path), closing == 0, closing)
        self.assertEqual(os.listdir(self.root), [])

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_a_rank_that_never_calls_makes_the_other_time_out(self) -> None:
        done = os.path.join(self.tmp, "rank0-done")
        if dist.get_rank() == 1:  # never calls create_shared_cache: waits, without a collective, for rank 0 to fail
            deadline = time.monotonic() + TIMEOUT
            while not os.path.exists(done):
                self.assertLess(time.monotonic(), deadline, "rank 0 did not time out")
                time.sleep(0.05)
            return
        try:
            start = time.monotonic()
            with self.assertRaisesRegex(RuntimeError, r"(?i)time[ds]? ?out"):  # as torch.distributed raises it
                create_shared_cache(root=self.root, timeout=SHORT)
            self.assertGreater(time.monotonic() - start, 0.9 * SHORT)
            self.assertLess(time.monotonic() - start, 10 * SHORT)
        finally:
            open(done, "w").close()
        self.assertEqual(os.listdir(self.root), [])  # no store without the node's identities

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_node_ids(self) -> None:
        """Ranks of different node identities get different stores: `node_id`, else `MONAI_CACHE_NODE_ID`."""
        rank = dist.get_rank()
        own = create_shared_cache(root=self.root, node_id=f"node{rank}")
        os.environ["MONAI_CACHE_NODE_ID"] = f"env{rank}"
        by_env = create_shared_cache(root=self.root)
        shared = create_shared_cache(root=self.root, node_id="one-node")  # node_id comes first
        own_paths, env_paths, shared_paths = gather(own.path), gather(by_env.path), gather(shared.path)
        self.assertEqual(len({*own_paths, *env_paths}), 4)
        self.assertEqual(shared_paths[0], shared_paths[1])
        self.assertEqual(len(os.listdir(self.root)), 5)
        own.put("k", rank)
        dist.barrier()
        self.assertEqual(own.get("k"), rank)  # not the other rank's item
        for store in (own, by_env, shared):
            store.close()
        dist.barrier()
        self.assertEqual(os.listdir(self.root), [])

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_two_ranks_fill_each_item_once_per_node(self) -> None:
        """2 ranks x 2 threads fill one store at once: the claims split the items, each computed once."""
        store = create_shared_cache(root=self.root, timeout=TIMEOUT)
        pids, ds = gather(os.getpid()), self.dataset(store, delay=0.2)
        fill(ds, num_threads=2)
        dist.barrier()  # both ranks have filled: the node's cache is full
        for i in range(N):
            self.assertTrue(torch.equal(ds[i]["img"], torch.full((2, 3), i + 1.0)), i)
        dist.barrier()
        self.assertEqual(computed(self.log), Counter(range(N)))
        with open(self.log) as f:
            by = dict(map(int, line.split()) for line in f)  # which process computed each item
        self.assertEqual(sorted(set(by.values())), sorted(pids))  # both ranks computed
        dist.barrier()
        store.close()

    @skip_if_quick
    @needs_store
    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_ranks_fill_with_their_share_of_the_node(self) -> None:
        """By default each rank fills with its share of the node's CPUs (``node_cpus``), not with all of them."""
        store = create_shared_cache(root=self.root, timeout=TIMEOUT)
        expected = share_of_cpus(process_cpus(), [set(c) for c in gather(sorted(process_cpus()))])
        self.assertEqual(store.node_cpus, expected)
        threads: set = set()
        slow = Lambda(lambda i: (threads.add(threading.get_ident()), time.sleep(0.05), {"i": i})[-1])
        ds = CacheDataset(
            list(range(N)), Compose([slow]), runtime_cache=store, hash_transform=store.hash_transform, progress=False
        )
        dist.barrier()  # the ranks fill at once
        fill(ds)
        self.assertLessEqual(len(threads), expected, threads)  # with all of the rank's CPUs: 2 threads on 2 cores
        dist.barrier()  # both ranks have filled
        store.close()


if __name__ == "__main__":
    unittest.main()
