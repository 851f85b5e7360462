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

import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
import unittest
import warnings

import numpy as np
import torch

from monai_sharedcache import SharedCacheStore
from tests.test_utils import skip_if_quick

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
TIMEOUT = 120
_METHOD = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
slow_unless_fork = skip_if_quick if _METHOD != "fork" else (lambda obj: obj)  # new interpreters take seconds


def _compute_forever(store: SharedCacheStore, conn) -> None:
    store.get_or_compute("k", lambda: conn.send("computing") or time.sleep(TIMEOUT))  # to be killed while computing


def _fill(store: SharedCacheStore, keys: list, counts, shift: int) -> None:
    order = keys[shift:] + keys[:shift]
    for key in order + order:
        k = keys.index(key)

        def compute(k=k):
            with counts.get_lock():
                counts[k] += 1
            time.sleep(0.02)
            return {"k": k, "t": torch.full((20_000,), float(k)), "a": np.full(100, k)}

        item = store.get_or_compute(key, compute)
        assert item["k"] == k and bool((item["t"] == k).all()) and bool((item["a"] == k).all()), key


@needs_store
class TestClaims(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self, **kwargs) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root, **kwargs)
        self.addCleanup(store.close)
        return store

    def claims(self, store: SharedCacheStore) -> list:
        claims = os.path.join(store.path, ".claims")
        return sorted(os.listdir(claims)) if os.path.isdir(claims) else []

    def test_threads_compute_once(self):
        store = self.new_store()
        calls, results, barrier = [], [], threading.Barrier(4)

        def run():
            barrier.wait(TIMEOUT)  # all miss at once; one computes (slowly), the others wait for its item
            results.append(store.get_or_compute("k", lambda: calls.append(1) or time.sleep(0.1) or torch.arange(5)))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        self.assertEqual((len(calls), len(results)), (1, 4))
        self.assertTrue(all(torch.equal(r, torch.arange(5)) for r in results))
        self.assertEqual(self.claims(store), [])

    def test_claim_timeout_computes_without_storing(self):
        import fcntl

        store = self.new_store(claim_timeout=0.2)
        copy = pickle.loads(pickle.dumps(store))  # keeps the claim_timeout
        os.makedirs(os.path.join(store.path, ".claims"), mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(store.path, ".claims", "k.claim"), os.O_CREAT | os.O_RDWR, 0o600)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held by someone else (another descriptor) that never releases it
        start = time.monotonic()
        for who, value in ((store, 5), (store, 6), (copy, 7)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertEqual(who.get_or_compute("k", lambda v=value: v), value)
            mine = [str(w.message) for w in caught if str(w.message).startswith(f"SharedCacheStore {store.path}")]
            self.assertEqual(len(mine), int(value != 6), mine)  # once per process and store object
            self.assertTrue(value == 6 or "claim_timeout=0.2" in mine[0], mine)
        self.assertLess(time.monotonic() - start, TIMEOUT / 2)
        self.assertIsNone(store.get("k"))  # not stored
        for bad in (-1, float("nan"), "60", True):
            with self.assertRaisesRegex(ValueError, "claim_timeout must be a non-negative number of seconds"):
                SharedCacheStore(store.path, claim_timeout=bad)

    def test_killed_claimant_releases_claim_at_once(self):
        """A process killed while it computes an item delays the others by a poll, not by claim_timeout."""
        store = self.new_store(claim_timeout=TIMEOUT)
        ctx = multiprocessing.get_context()
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_compute_forever, args=(store, sender))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        self.assertTrue(receiver.poll(TIMEOUT) and receiver.recv() == "computing")
        results: list = []
        waiter = threading.Thread(target=lambda: results.append(store.get_or_compute("k", lambda: "again")))
        waiter.start()
        time.sleep(0.5)
        self.assertEqual(results, [], "the waiter did not wait for the claimant")
        proc.kill()
        waiter.join(TIMEOUT / 2)  # well before claim_timeout: the claim went with its holder
        self.assertEqual((results, store.get("k"), self.claims(store)), (["again"], "again", []))  # computed once

    @slow_unless_fork
    def test_processes_compute_each_key_once(self):
        store = self.new_store()
        keys = [f"key{i}" for i in range(8)]
        ctx = multiprocessing.get_context()
        counts = ctx.Array("i", len(keys))
        procs = [ctx.Process(target=_fill, args=(store, keys, counts, 2 * i)) for i in range(4)]
        for p in procs:
            p.start()
            self.addCleanup(lambda p=p: (p.is_alive() and p.kill(), p.join(TIMEOUT)))
        for p in procs:
            p.join(TIMEOUT)
        self.assertEqual([p.exitcode for p in procs], [0] * 4)
        self.assertEqual(counts[:], [1] * len(keys))
        self.assertEqual(sorted(n for n in os.listdir(store.path) if n.endswith(".item")), [k + ".item" for k in keys])
        self.assertEqual(self.claims(store), [])


if __name__ == "__main__":
    unittest.main()
