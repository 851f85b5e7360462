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

import gc
import json
import multiprocessing
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import unittest
from unittest import mock

import torch
from parameterized import parameterized

import monai
from monai_sharedcache import SharedCacheStore, _flock
from monai_sharedcache import _pages as cache_pages
from monai_sharedcache import _pool as cache_pool
from monai_sharedcache import budget
from tests.layer.layer_utils import mapped_files

TIMEOUT = 120
FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
MONAI_DIR = os.path.dirname(os.path.dirname(monai.__file__))  # for `python -c`: this monai, wherever tests found it
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([MONAI_DIR, os.environ.get("PYTHONPATH", "")])}
# in a fresh interpreter: whether the layer is on; an item of 16 MiB (pooled, with the layer) read while a reader that
# wrote its copy in place is alive, and again; how many mappings the pool keeps after each release
OFF_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch
    from monai_sharedcache import SharedCacheStore
    from monai_sharedcache._pool import ENABLED, POOL
    store = SharedCacheStore(root=sys.argv[1])
    ok, kept = [store.put("k", {"t": torch.arange(1 << 21), "s": "x"})], []
    t = store.get("k")["t"]
    ok.append(torch.equal(t, torch.arange(1 << 21)))
    t[::1000] = -1  # in place, in every page
    item = store.get("k")
    ok.append(torch.equal(item["t"], torch.arange(1 << 21)) and item["s"] == "x")
    for name in ("t", "item"):
        del globals()[name]
        gc.collect()
        kept.append(len(POOL._order))
    ok.append(torch.equal(store.get("k")["t"], torch.arange(1 << 21)))
    store.close()
    print(json.dumps({"enabled": ENABLED, "ok": ok, "kept": kept}))
    """)
# a collection that frees a mapped item inside the pool's critical section must not wait for the pool's lock
GC_SCRIPT = textwrap.dedent("""
    import gc, sys
    import numpy as np
    from monai_sharedcache import SharedCacheStore
    from monai_sharedcache._pool import POOL
    POOL.MIN_SIZE = 0  # pool these small items too
    st = SharedCacheStore(root=sys.argv[1])
    st.put("k0", {"a": np.ones(2**17)})
    st.put("k1", {"a": np.ones(2**17)})
    gc.collect()
    gc.freeze()  # collections then only scan what the loop makes: fast
    for threshold in range(1, 200):  # sweep, so that some collection starts inside the pool's lock
        gc.disable()
        a = st.get("k0")
        a["self"] = a  # an unreachable cycle that holds a mapping
        del a
        b = st.get("k1")
        gc.set_threshold(threshold)
        gc.enable()
        del b  # releasing b's mapping allocates: a collection there frees a's mapping
        gc.disable()
        gc.collect()
    gc.set_threshold(700)
    gc.enable()
    assert float(st.get("k0")["a"].sum()) == 2**17
    st.close()
    print("ok")
    """)


def _maps_of(path: str) -> list[str]:
    """The files under ``path`` mapped in this process, each once, with " (deleted)" if removed."""
    with open("/proc/self/maps") as f:
        return sorted({" ".join(line.split()[5:]) for line in f if path in line})


def _read_after_fork(store: SharedCacheStore) -> None:
    for _ in range(3):
        t = store.get("big")
        if t is None or int(t[-1]) != 299_999:
            raise AssertionError("wrong item")
        del t
        gc.collect()  # releases the mapping into this process's pool


def _keep_then_release(store: SharedCacheStore, kept, release, released) -> None:
    """In another process: read an item, keep its mapping in the pool (a pin), and release it when told."""
    t = store.get("k")
    assert int(t[-1]) == 299_999
    del t
    gc.collect()
    kept.set()
    release.wait(TIMEOUT)
    cache_pool.POOL.purge(os.path.join(store.path, ""))  # as its next read after a second, or its close, would
    released.set()


def _used(path: str) -> tuple[int, int]:
    with open(os.path.join(path, budget.USED_FILE), "rb") as f:
        return struct.unpack("<qqqd", f.read())[:2]


@unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
@unittest.skipUnless(
    cache_pool.ENABLED, "the Linux fast path is off here: not Linux, no libc, or MONAI_CACHE_FAST_PATH=0"
)
class TestMappingPool(unittest.TestCase):
    def setUp(self) -> None:
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self, **kwargs) -> SharedCacheStore:
        store = SharedCacheStore(**{"root": self.root, **kwargs})
        self.addCleanup(store.close)
        return store

    def pool_everything(self) -> None:
        patcher = mock.patch.object(cache_pool.POOL, "MIN_SIZE", 0)
        patcher.start()
        self.addCleanup(patcher.stop)

    @parameterized.expand([("page_scan", None), ("pagemap_read", False)])
    def test_unwritten_mapping_is_reused_written_one_never(self, _, scan_works):
        if scan_works is False:  # as on kernels < 6.7: no PAGEMAP_SCAN, so no write watch; pages read from the pagemap
            patcher = mock.patch.object(cache_pages, "_scan_works", False)
            patcher.start()
            self.addCleanup(patcher.stop)
        store = self.new_store()
        item = os.path.join(store.path, "k.item")
        store.put("k", torch.arange(100_000))
        t = store.get("k")  # below the pool's minimum size: unmapped with its last view
        address = t.data_ptr()
        self.assertEqual(mapped_files(address), [item])
        del t
        gc.collect()
        self.assertNotIn(item, mapped_files(address))
        self.pool_everything()
        t = store.get("k")
        address = t.data_ptr()
        del t
        gc.collect()
        t = store.get("k")  # the mapping (and its page tables) of the same unchanged file is taken over
        self.assertEqual(t.data_ptr(), address)
        self.assertEqual(int(t[5]), 5)
        t[5] = -7  # written: this mapping must never be handed to another reader
        del t
        gc.collect()
        self.assertNotIn(item, mapped_files(address))
        t = store.get("k")
        self.assertTrue(torch.equal(t, torch.arange(100_000)))
        other = store.get("k")  # a second reader while the first is alive gets its own mapping
        self.assertNotEqual(other.data_ptr(), t.data_ptr())
        self.assertTrue(store.put("k", torch.arange(100_000) * 2))  # replaced: a kept mapping of the old file goes
        address = t.data_ptr()
        del t, other
        gc.collect()
        self.assertNotIn(item, mapped_files(address))
        self.assertEqual(int(store.get("k")[3]), 6)

    def test_watched_mapping_takes_no_fault_and_a_written_one_goes(self):
        """A mapping reused once is populated and write-watched: hits without page faults; a write still unmaps it."""
        import resource

        def faults_of_full_read() -> int:
            # the faults of this thread alone (not of torch's or the test runner's other threads): numpy sums in it
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t = store.get("k")
            total = int(t.numpy().sum())
            after = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            self.assertEqual(total, n * (n - 1) // 2)
            del t
            gc.collect()
            return after - before

        # on the default root (/dev/shm, tmpfs in 4 KiB pages): the temporary directory may be on a file system whose
        # files the kernel maps in huge pages, or that cannot be watched
        store = self.new_store(root=None)
        n = 1 << 22  # 32 MiB of int64: 8,192 pages, above the pool's minimum size
        store.put("k", torch.arange(n))
        item = os.path.join(store.path, "k.item")
        fresh = faults_of_full_read()
        for _ in range(2):  # kept after the first read, watched after the first reuse
            faults_of_full_read()
        states = [entry[3] for entry in cache_pool.POOL._order if entry[0][0] == item]
        if states != [cache_pages.WATCHED]:
            self.skipTest(f"no write watch on {store.path}: kernel < 6.7, userfaultfd refused, or huge pages: {states}")
        self.assertGreater(fresh, 20)  # a fresh mapping faults (fault-around maps up to a folio at a time)
        self.assertLess(faults_of_full_read(), min(10, fresh // 2))  # a watched one: every page is in, no fault
        t = store.get("k")
        address = t.data_ptr()
        t[n - 1] = -7  # written: this mapping must never be handed to another reader
        del t
        gc.collect()
        self.assertNotIn(item, mapped_files(address))
        t = store.get("k")
        self.assertTrue(torch.equal(t, torch.arange(n)))
        t[3] = 0  # the first page written of a fresh mapping is caught by the category check too
        del t
        gc.collect()
        self.assertGreater(faults_of_full_read(), 20)  # unmapped again: a fresh mapping

    def test_release_from_garbage_collection_never_deadlocks(self):
        try:
            cmd = [sys.executable, "-c", GC_SCRIPT, self.root]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
        except subprocess.TimeoutExpired:  # run() has killed it
            self.fail("releasing a mapping from the garbage collector deadlocked")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "ok")

    @unittest.skipIf(FORK is None, "needs the fork start method")
    def test_fork_while_pool_is_updated(self):
        """A worker forked while another thread holds the pool's lock, mid-update, can read items."""
        self.pool_everything()
        store = self.new_store()
        store.put("big", torch.arange(300_000))
        t = store.get("big")
        del t  # a kept mapping
        gc.collect()
        pool, item = cache_pool.POOL, os.path.join(store.path, "big.item")
        self.assertEqual([entry[0][0] for entry in pool._order], [item])
        st = os.stat(item)
        ident = (item, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        locked, done = threading.Event(), threading.Event()

        def update() -> None:
            with pool._lock:
                # a torn state, as in the middle of _process: a mapping in the free list, not in the eviction order
                pool._free.setdefault(ident, []).append((4096, 4096, 1))
                locked.set()
                done.wait(TIMEOUT)
                pool._free[ident].remove((4096, 4096, 1))

        thread = threading.Thread(target=update)
        thread.start()
        proc = None
        try:
            self.assertTrue(locked.wait(TIMEOUT))
            proc = FORK.Process(target=_read_after_fork, args=(pickle.loads(pickle.dumps(store)),))
            proc.start()
            proc.join(TIMEOUT)
            self.assertFalse(proc.is_alive(), "a forked reader waited for the pool's lock")
            self.assertEqual(proc.exitcode, 0)
        finally:
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)
            done.set()
            thread.join(TIMEOUT)
        self.assertEqual(int(store.get("big")[-1]), 299_999)

    def test_kept_mappings_do_not_pin_removed_items(self):
        self.pool_everything()
        store = self.new_store()
        path = store.path
        for n in range(3):
            store.put(f"k{n}", torch.arange(200_000))
            t = store.get(f"k{n}")
            del t  # kept by the pool for the next read
            gc.collect()
        self.assertEqual(_maps_of(path), [os.path.join(path, f"k{n}.item") for n in range(3)])
        store.discard([])  # set_data with the same inputs: nothing to unmap
        self.assertEqual(_maps_of(path), [os.path.join(path, f"k{n}.item") for n in range(3)])
        store.discard(["k0", "k1"])  # set_data dropped two inputs
        gc.collect()
        self.assertEqual([m for m in _maps_of(path) if "k0" in m or "k1" in m], [])
        t = store.get("k2")
        self.assertEqual(int(t[-1]), 199_999)
        del t
        gc.collect()
        self.assertEqual(_maps_of(path), [os.path.join(path, "k2.item")])
        store.close()  # the directory goes: nothing of it may stay mapped in this process
        gc.collect()
        self.assertFalse(os.path.isdir(path))
        self.assertEqual(_maps_of(path), [])

    @unittest.skipIf(FORK is None, "needs fork")
    def test_a_mapping_kept_elsewhere_counts_until_released(self):
        """Another process keeps a mapping of an item that is removed: its bytes stay counted until it is released."""
        self.pool_everything()
        store = self.new_store(max_bytes=2**30, reserve=0)
        self.assertTrue(store.put("k", torch.arange(300_000)))
        size = os.path.getsize(os.path.join(store.path, "k.item"))
        kept, release, released = FORK.Event(), FORK.Event(), FORK.Event()
        proc = FORK.Process(target=_keep_then_release, args=(store, kept, release, released))
        proc.start()
        self.addCleanup(lambda: (proc.is_alive() and proc.kill(), proc.join(TIMEOUT)))
        self.assertTrue(kept.wait(TIMEOUT))
        store.discard(["k"])  # as set_data, refresh or an eviction would
        self.assertIsNone(store.get("k"))
        self.assertEqual(_used(store.path), (size, 0))  # gone from the store, its pages still held
        self.assertEqual(len(os.listdir(os.path.join(store.path, ".aside"))), 1)
        release.set()
        self.assertTrue(released.wait(TIMEOUT))
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 0)
        store.clear()  # any removal, or a recount, frees what no mapping pins any more
        self.assertEqual((_used(store.path), os.listdir(os.path.join(store.path, ".aside"))), ((0, 0), []))

    def test_a_file_removed_is_not_pinned(self):
        path = os.path.join(self.root, "f")
        with open(path, "wb") as f:
            f.write(b"x")
        fd = os.open(path, os.O_RDONLY)
        self.addCleanup(os.close, fd)
        os.unlink(path)  # by a store, between this reader's open and its pin: counted out already
        self.assertFalse(_flock.pin(fd))

    @parameterized.expand([("off", "0", False), ("on", "1", True)])
    def test_environment_turns_it_off(self, _, value, enabled):
        """``MONAI_CACHE_FAST_PATH=0`` turns the layer off: nothing is kept, and items still read right."""
        cmd = [sys.executable, "-c", OFF_SCRIPT, self.root]
        env = {**ENV, "MONAI_CACHE_FAST_PATH": value}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertEqual(got["enabled"], enabled)
        self.assertEqual(got["ok"], [True] * 4)  # stored; read; pristine after a write in place, again after a reuse
        self.assertEqual(got["kept"], [0, 1] if enabled else [0, 0])  # never a written mapping


if __name__ == "__main__":
    unittest.main()
