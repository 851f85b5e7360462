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
"""CacheDataset runtime caches shared by processes: workers, ranks, faults, several datasets on one cache, the store."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest
import warnings
from collections import Counter
from multiprocessing import get_context
from multiprocessing.managers import SyncManager

import torch
import torch.distributed as dist
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader
from monai.data.cache_store import SharedCacheStore
from monai.data.dataset import _ListCache
from monai.data.utils import pickle_hashing, transforms_hashing
from monai.transforms import Compose, RandomizableTransform, Transform

TIMEOUT = 120  # seconds for any wait on another process


class Load(Transform):
    """A deterministic transform that records each execution as a line in ``log`` (if given)."""

    def __init__(self, log: str | None = None) -> None:
        self.log = log

    def __call__(self, x):
        src = x["id"] if isinstance(x, dict) else x
        if self.log:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{src}\n".encode())
            finally:
                os.close(fd)
        return {"src": src, "img": torch.full((3, 4), float(src))}


class RandAdd(RandomizableTransform):
    """A random transform that adds 1 in place: an item shared with the cache would come back with 2, then 3."""

    def __call__(self, d):
        d["img"] += 1.0  # in place on purpose
        d["seen"] = True
        return d


class Scale(Transform):
    """A second deterministic transform, to make cached content that differs for the same input."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, d):
        return {**d, "img": d["img"] * self.factor}


def make_transform(log: str | None = None) -> Compose:
    return Compose([Load(log), RandAdd()])


def first_item(batch):
    return batch[0]


def check_item(test: unittest.TestCase, item: dict, src, added: float = 1.0) -> None:
    """``item`` is ``Load()(src)`` and then, unless it is a cached item (``added=0``), ``RandAdd`` once."""
    test.assertEqual(item["src"], src)
    expected = torch.full((3, 4), float(src) + added)
    test.assertTrue(torch.equal(torch.as_tensor(item["img"]), expected), f"wrong image for {src}: {item['img']}")


def run_ranks(test: unittest.TestCase, fn, args: tuple, nprocs: int = 2) -> None:
    """
    Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; fail, killing them, past the timeout. Their DataLoader
    workers exit by themselves within seconds (PyTorch's workers watch for the death of their parent).
    """
    ctx = torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + 2 * TIMEOUT
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            test.fail("distributed workers timed out")


def executions(log: str) -> Counter:
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line) for line in f.read().split())


class ManagerTestCase(unittest.TestCase):
    """Starts a Manager per test and always shuts it down."""

    def setUp(self) -> None:
        self.manager = SyncManager(ctx=get_context("fork"))
        self.manager.start()
        self.tmp = tempfile.mkdtemp()
        self.log = os.path.join(self.tmp, "log")

    def tearDown(self) -> None:
        self.manager.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def container(self, kind: str, length: int = 0):
        if kind == "listproxy":
            return self.manager.list([None] * length)
        if kind == "list":
            return [None] * length
        if kind == "store":
            store = SharedCacheStore()
            self.addCleanup(store.close)
            return store
        return kind  # a mode string


DATA = list(range(10))
SIZING = [
    (kind, length, rate) for kind in ("list", "listproxy") for length in (0, 3, 5, 10, 20) for rate in (0.5, 1.0)
] + [(mode, 0, rate) for mode in ("process", "thread") for rate in (0.5, 1.0)]


class TestSizing(ManagerTestCase):
    @parameterized.expand(SIZING)
    def test_main_process(self, kind, length, rate):
        cache = self.container(kind, length)
        ds = CacheDataset(DATA, make_transform(), cache_rate=rate, runtime_cache=cache, progress=False)
        self.assertEqual(ds.cache_num, int(len(DATA) * rate))
        for _ in range(2):
            for i in range(len(DATA)):
                check_item(self, ds[i], DATA[i])
        check_item(self, ds[-1], DATA[-1])
        self.assertEqual(len(ds._cache), ds.cache_num)
        if not isinstance(cache, str):
            self.assertEqual(len(cache), ds.cache_num)
        # the compatibility view holds the cached items themselves
        self.assertEqual(len(ds._cache), ds.cache_num)
        self.assertEqual([d["src"] for d in ds._cache], DATA[: ds.cache_num])

    @parameterized.expand(
        [("listproxy", n, "fork") for n in (0, 3, 20)]
        + [("listproxy", n, "spawn") for n in (0, 20)]
        + [("process", 0, ctx) for ctx in ("fork", "spawn")]
    )
    def test_dataloader_workers(self, kind, length, ctx):
        cache = self.container(kind, length) if kind == "listproxy" else "process"
        ds = CacheDataset(DATA, make_transform(self.log), cache_rate=0.5, runtime_cache=cache, progress=False)
        loader = DataLoader(
            ds, batch_size=1, num_workers=2, multiprocessing_context=ctx, timeout=TIMEOUT, collate_fn=first_item
        )
        for _ in range(2):
            got = sorted((item["src"], item["img"]) for item in loader)
            self.assertEqual([s for s, _ in got], DATA)
            for src, img in got:
                self.assertTrue(torch.equal(img, torch.full((3, 4), float(src) + 1)))
        if kind == "listproxy":
            self.assertEqual(len(cache), 5)
        self.assertEqual(len(ds._cache), 5)
        # shared with the workers: the parent sees what they cached; cached items ran once, the others every epoch
        self.assertEqual([d["src"] if d is not None else None for d in ds._cache], DATA[:5])
        counts = executions(self.log)
        self.assertEqual({k: counts[k] for k in DATA[:5]}, dict.fromkeys(DATA[:5], 1))
        self.assertEqual({k: counts[k] for k in DATA[5:]}, dict.fromkeys(DATA[5:], 2))

    @parameterized.expand([("grow", 2), ("trim", 9)])
    def test_resize_interleaved_at_the_worst_point(self, _, initial):
        """Two resizers to one cache_num, both reading the length before either writes: still exactly cache_num."""
        cache = self.manager.list([None] * initial)
        gate = threading.Barrier(2, timeout=TIMEOUT)
        errors: list[BaseException] = []

        def resize() -> None:
            try:
                _ListCache(_PausedContainer(cache, gate)).resize(5)
            except BaseException as e:  # noqa: B902  (reported by the test below)
                errors.append(e)

        threads = [threading.Thread(target=resize) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        self.assertFalse(any(t.is_alive() for t in threads))
        self.assertEqual(errors, [])
        self.assertEqual(len(cache), 5)

    def test_not_resizable(self):
        class Fixed:  # item assignment but no slice assignment
            def __init__(self):
                self.items = [None] * 3

            def __len__(self):
                return len(self.items)

            def __getitem__(self, i):
                return self.items[i]

            def __setitem__(self, i, v):
                if isinstance(i, slice):
                    raise TypeError("no slices")
                self.items[i] = v

            def __delitem__(self, i):
                raise TypeError("no deletion")

        with self.assertRaisesRegex(ValueError, r"length 3.*cache_num=10"):
            CacheDataset(DATA, make_transform(), runtime_cache=Fixed(), progress=False)

    @parameterized.expand([("same_length", (0.5,) * 6), ("different_lengths", (0.3, 0.5, 1.0, 0.5, 0.3, 1.0))])
    def test_concurrent_resize(self, _, rates):
        """
        Processes build datasets on one ListProxy at once (a barrier lines them up) and read every item.

        With one cache_num (DDP ranks over the same data) the container ends exactly that long, however the resizes
        interleave. With different ones (datasets over other data sharing a container) its length may end anywhere:
        then every item read is still right, and the next dataset built on it resizes it exactly.
        """
        for trial in range(3):
            cache = self.manager.list([None] * (trial * 7))
            ctx = get_context("fork")
            start = ctx.Barrier(len(rates))
            procs = [ctx.Process(target=_build_and_read, args=(cache, rate, start)) for rate in rates]
            for p in procs:
                p.start()
            for p in procs:
                p.join(TIMEOUT)
            for p in procs:
                if p.is_alive():  # never leave a process behind, even when the test fails
                    p.kill()
                    p.join(TIMEOUT)
            self.assertEqual([p.exitcode for p in procs], [0] * len(procs))  # every child read right items
            entries = list(cache)
            self.assertTrue(any(e is not None for e in entries))
            for i, entry in enumerate(entries):
                if entry is not None:  # slot i caches DATA[i] in every dataset
                    check_item(self, entry[1], DATA[i], added=0.0)
            if len(set(rates)) == 1:
                self.assertEqual(len(cache), int(len(DATA) * rates[0]))
            CacheDataset(DATA, make_transform(), cache_rate=0.3, runtime_cache=cache, progress=False)
            self.assertEqual(len(cache), 3)


class _PausedContainer:
    """A ListProxy whose every ``len`` waits for the other resizer's: both read the length before either writes."""

    def __init__(self, container, gate: threading.Barrier) -> None:
        self.container, self.gate = container, gate

    def __len__(self) -> int:
        n = len(self.container)
        self.gate.wait()
        return n

    def __setitem__(self, k, v) -> None:
        self.container[k] = v

    def __delitem__(self, k) -> None:
        del self.container[k]


def _build_and_read(cache, rate, start):
    start.wait(TIMEOUT)
    ds = CacheDataset(DATA, make_transform(), cache_rate=rate, runtime_cache=cache, progress=False)
    for _ in range(3):
        for i in range(len(DATA)):
            item = ds[i]
            assert item["src"] == DATA[i] and torch.equal(item["img"], torch.full((3, 4), DATA[i] + 1.0)), (i, item)


class TestNeverWrongOrStale(ManagerTestCase):
    @parameterized.expand([("list",), ("listproxy",), ("process",), ("thread",)])
    def test_set_data_same_container(self, kind):
        cache = self.container(kind)
        ds = CacheDataset(DATA, make_transform(self.log), runtime_cache=cache, progress=False)
        slots = ds._runtime
        [ds[i] for i in range(10)]
        new = [100 + i for i in range(6)] + DATA[6:]  # the last four stay the same
        ds.set_data(new)
        for i in range(10):
            check_item(self, ds[i], new[i])
        if kind != "thread":  # as upstream, "thread" starts a new private list at every set_data
            self.assertIs(ds._runtime, slots)  # the same container, resynced
            counts = executions(self.log)
            self.assertEqual([counts[k] for k in DATA[6:]], [1] * 4)  # unchanged inputs stay cached
        ds.set_data(DATA[:4])
        self.assertEqual(len(ds._cache), 4)
        if not isinstance(cache, str):
            self.assertEqual(len(cache), 4)
        for i in range(4):
            check_item(self, ds[i], DATA[i])

    @parameterized.expand([("spawn",), ("fork",)])
    def test_set_data_between_epochs_workers(self, ctx):
        cache = self.manager.list()
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        for data in (
            (DATA, [50 + i for i in range(12)]) if ctx == "spawn" else (DATA, [50 + i for i in range(12)], DATA[:3])
        ):
            ds.set_data(data)
            loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx, timeout=TIMEOUT)
            got = sorted(int(s) for batch in loader for s in batch["src"])
            self.assertEqual(got, sorted(data))
            self.assertEqual(len(cache), len(data))
            self.assertEqual([e[1]["src"] for e in cache], list(data))

    @parameterized.expand([("list",), ("listproxy",), ("store",)])
    def test_two_datasets_share_a_container(self, kind):
        cache = self.container(kind)
        a = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        b = CacheDataset([20 + i for i in range(10)], make_transform(), runtime_cache=cache, progress=False)
        for _ in range(3):
            for i in range(10):
                check_item(self, a[i], DATA[i])
                check_item(self, b[i], 20 + i)

    @parameterized.expand([("list",), ("listproxy",), ("store",)])
    def test_same_data_other_transforms_share_a_container(self, kind):
        """A training and a validation dataset over the same inputs, one cache: each gets its own transforms' items."""
        cache = self.container(kind)
        train = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        val = CacheDataset(DATA, Compose([Load(), Scale(10.0), RandAdd()]), runtime_cache=cache, progress=False)
        for _ in range(2):
            for i in range(10):
                check_item(self, train[i], DATA[i])
                self.assertTrue(torch.equal(val[i]["img"], torch.full((3, 4), 10.0 * DATA[i] + 1)), i)

    def test_fingerprint_of_lambdas(self):
        """Lambdas in the cached transforms: same code and closure values share, anything else does not."""
        from monai.transforms import Lambda

        def fp(transforms):
            first_random = Compose(transforms).get_index_of_first(lambda t: isinstance(t, RandomizableTransform))
            digest = transforms_hashing(transforms[:first_random])
            self.assertIsNotNone(digest)  # lambdas do not make it fall back to a random tag
            return digest

        def scaled(factor):
            return Lambda(lambda x: x * factor)

        self.assertEqual(fp([Lambda(lambda x: x + 1)]), fp([Lambda(lambda x: x + 1)]))
        self.assertNotEqual(fp([Lambda(lambda x: x + 1)]), fp([Lambda(lambda x: x + 2)]))
        self.assertEqual(fp([scaled(2)]), fp([scaled(2)]))
        self.assertNotEqual(fp([scaled(2)]), fp([scaled(3)]))
        self.assertNotEqual(fp([Load()]), fp([Load(), Scale(2.0)]))
        self.assertEqual(fp([Load(), RandAdd(), Scale(2.0)]), fp([Load(), RandAdd(), Scale(3.0)]))  # not cached

    def test_fingerprint_same_in_another_process(self):
        """A fresh interpreter (another rank) computes the same fingerprint for the same pipeline with a lambda."""
        code = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from test_cachedataset_shared import fingerprint_with_lambda
            print(fingerprint_with_lambda())
            """)
        outs = [
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
            for _ in range(2)
        ]
        for out in outs:
            self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(outs[0].stdout, outs[1].stdout)
        self.assertEqual(outs[0].stdout.strip(), fingerprint_with_lambda())
        self.assertNotEqual(fingerprint_with_lambda(), "None")

    def test_other_process_set_data(self):
        """A child process calls set_data with other data on the shared container; the parent stays right."""
        cache = self.manager.list()
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        [ds[i] for i in range(10)]
        p = get_context("spawn").Process(target=_set_data_child, args=(cache,))
        p.start()
        p.join(TIMEOUT)
        if p.is_alive():
            p.kill()
            p.join(TIMEOUT)
        self.assertEqual(p.exitcode, 0)
        self.assertEqual([e[1]["src"] for e in cache if e is not None][:4], [200, 201, 202, 203])
        for i in range(10):
            check_item(self, ds[i], DATA[i])

    @parameterized.expand([("list",), ("listproxy",)])
    def test_prefilled(self, kind):
        junk = [("junk", i) for i in range(4)] + [("not-the-key", {"src": -1})] + [{"src": -2}] * 5
        cache = self.manager.list(junk) if kind == "listproxy" else list(junk)
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        for i in range(10):
            check_item(self, ds[i], DATA[i])

    @parameterized.expand([(False,), (True,), ("thread",), ("process",), ("list",), ("listproxy",)])
    def test_hash_as_key_duplicates(self, mode):
        data = [{"id": 1}, {"id": 1}, {"id": 5}, {"id": 7}, {"id": 5}]
        cache = self.container(mode) if mode in ("list", "listproxy") else mode
        ds = CacheDataset(data, make_transform(self.log), hash_as_key=True, runtime_cache=cache, progress=False)
        self.assertEqual(ds.cache_num, 3)
        for _ in range(2):
            for i, d in enumerate(data):
                check_item(self, ds[i], d["id"])
        self.assertEqual(executions(self.log), Counter({1: 1, 5: 1, 7: 1}))


def fingerprint_with_lambda() -> str:
    from monai.transforms import Lambdad

    offset = {"a": 1.5}
    pipeline = [Load(), Lambdad("img", lambda x: x + offset["a"]), Scale(2.0)]
    return str(transforms_hashing(pipeline))


def _set_data_child(cache):
    ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
    ds.set_data([200 + i for i in range(10)])
    for i in range(10):
        assert ds[i]["src"] == 200 + i


class TestValues(unittest.TestCase):
    @parameterized.expand([("proc3ss",), ("Process",), ("",), ("THREAD",)])
    def test_bad_strings(self, value):
        with self.assertRaisesRegex(ValueError, r"runtime_cache=.*accepted strings contain 'thread' or 'process'"):
            CacheDataset(DATA, make_transform(), runtime_cache=value, progress=False)

    @parameterized.expand([(7,), (1.5,), ((1, 2),), ({},), (object(),), (b"process",)])
    def test_bad_types(self, value):
        with self.assertRaisesRegex(TypeError, r"runtime_cache of type .* is not supported; accepted values"):
            CacheDataset(DATA, make_transform(), runtime_cache=value, progress=False)

    @parameterized.expand([(None,), (False,), (0,)])
    def test_eager(self, value):
        """As upstream, 0 (== False) fills the cache in the constructor."""
        ds = CacheDataset(DATA, make_transform(), runtime_cache=value, progress=False)
        self.assertIsNone(ds._runtime)
        self.assertEqual([d["src"] for d in ds._cache], DATA)

    @parameterized.expand([(True,), ("thread",), ("threads",), ("process",), ("processes",)])
    def test_modes(self, value):
        ds = CacheDataset(DATA, make_transform(), runtime_cache=value, progress=False)
        for i in range(10):
            check_item(self, ds[i], DATA[i])

    def test_smartcache_refuses(self):
        from monai.data import SmartCacheDataset

        with self.assertRaisesRegex(NotImplementedError, r"runtime_cache=False"):
            SmartCacheDataset(DATA, make_transform(), runtime_cache=True)


class TestStoreModes(unittest.TestCase):
    @parameterized.expand([(m, r) for m in ("process", "store") for r in (0.5, 1.0)])
    def test_sequence_indexing(self, mode, rate):
        cache = SharedCacheStore() if mode == "store" else mode
        if isinstance(cache, SharedCacheStore):
            self.addCleanup(cache.close)
        ds = CacheDataset(DATA, make_transform(), cache_rate=rate, runtime_cache=cache, progress=False)
        self.assertIsInstance(ds._runtime, SharedCacheStore)
        for _ in range(2):  # the second time from the store
            for i in range(-len(DATA), len(DATA)):
                check_item(self, ds[i], DATA[i])
        for i in (len(DATA), -len(DATA) - 1):
            with self.assertRaises(IndexError):
                ds[i]
        self.assertEqual([d["src"] for d in ds], DATA)
        self.assertEqual([d["src"] for d in ds[1:8:3]], [1, 4, 7])
        self.assertEqual([d["src"] for d in ds[[9, -10]]], [9, 0])
        self.assertEqual(len(ds), len(DATA))
        self.assertEqual([d["src"] for d in ds._cache], DATA[: ds.cache_num])


SMALL_SHM_SCRIPT = textwrap.dedent("""
    import json
    import torch
    from monai.data import CacheDataset, DataLoader
    from monai.transforms import Compose, RandomizableTransform, Transform

    class Load(Transform):
        def __call__(self, i):
            return {"src": i, "img": torch.full((512 * 1024,), float(i))}  # 2 MiB

    class AddOne(RandomizableTransform):
        def __call__(self, d):
            d["img"] += 1
            return d

    if __name__ == "__main__":
        # 48 items of 2 MiB: 1.5 times the 64 MB /dev/shm, which the DataLoader's batches also go through
        ds = CacheDataset(list(range(48)), Compose([Load(), AddOne()]), runtime_cache="process", progress=False)
        loader = DataLoader(ds, batch_size=2, num_workers=2, timeout=120)
        for epoch in range(3):
            seen = []
            for batch in loader:
                for s, img in zip(batch["src"], batch["img"]):
                    assert torch.equal(img, torch.full((512 * 1024,), float(s) + 1)), int(s)
                    seen.append(int(s))
            assert sorted(seen) == list(range(48)), seen
            print("epoch", epoch, "ok", flush=True)
        print(json.dumps(ds._cache.cache.stats()))
    """)


def _private_mount_namespace() -> str | None:
    """Why a private mount namespace with its own /dev/shm cannot be made here, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a 64 MB tmpfs on /dev/shm in a private mount namespace"
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    probe = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a private namespace: {probe.stderr.strip()}"


class TestSmallDevShm(unittest.TestCase):
    """Docker's default 64 MB /dev/shm: the store leaves room for the DataLoader's own shared memory."""

    def run_in_64mb_shm(self, **env: str) -> subprocess.CompletedProcess:
        reason = _private_mount_namespace()
        if reason:
            self.skipTest(reason)
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "small_shm.py")
            with open(script, "w") as f:
                f.write(SMALL_SHM_SCRIPT)
            shell = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **env})

    def test_every_epoch_completes_with_correct_items(self):
        proc = self.run_in_64mb_shm()
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(
            [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch")], [f"epoch {e} ok" for e in range(3)]
        )
        stats = json.loads(proc.stdout.splitlines()[-1])
        self.assertGreater(stats["filled"], 0)  # it still caches what fits
        self.assertGreater(stats["refused"], 0)
        self.assertIn("--shm-size", proc.stderr)  # the warning names the options

    def test_without_reserve_the_dataloader_fails(self):
        """The scenario is real: a store that may fill /dev/shm makes the DataLoader's batch transfer fail."""
        proc = self.run_in_64mb_shm(MONAI_CACHE_RESERVE_BYTES="0")
        self.assertNotEqual(proc.returncode, 0, proc.stdout)
        # how it dies depends on the timing: no room for a batch's shared memory, or a worker's bus error on it
        self.assertRegex(proc.stderr, "unable to allocate shared memory|Bus error|No space left on device")


class TestFaults(ManagerTestCase):
    def test_manager_killed_mid_epoch_main(self):
        cache = self.manager.list()
        ds = CacheDataset(DATA, make_transform(), runtime_cache=cache, progress=False)
        for i in range(5):
            check_item(self, ds[i], DATA[i])
        self.manager._process.kill()
        self.manager._process.join(TIMEOUT)
        with self.assertWarnsRegex(RuntimeWarning, "unreachable"):
            check_item(self, ds[5], DATA[5])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per process only
            for _ in range(2):
                for i in range(10):
                    check_item(self, ds[i], DATA[i])
            ds.set_data(DATA[:5])  # resync with a dead server neither raises nor hangs
            check_item(self, ds[4], 4)
        self.manager = SyncManager(ctx=get_context("fork"))  # for tearDown
        self.manager.start()

    @parameterized.expand([("fork",), ("spawn",)])
    def test_manager_killed_mid_epoch_workers(self, ctx):
        cache = self.manager.list()
        ds = CacheDataset(DATA * 4, make_transform(), runtime_cache=cache, progress=False)
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx, timeout=TIMEOUT)
        got = []
        t0 = time.monotonic()
        for n, batch in enumerate(loader):
            if n == 3:
                self.manager._process.kill()
                self.manager._process.join(TIMEOUT)
            got.extend(int(s) for s in batch["src"])
            for s, img in zip(batch["src"], batch["img"]):
                self.assertTrue(torch.equal(img, torch.full((3, 4), float(s) + 1)))
        self.assertLess(time.monotonic() - t0, TIMEOUT)
        self.assertEqual(sorted(got), sorted(DATA * 4))
        self.manager = SyncManager(ctx=get_context("fork"))
        self.manager.start()

    def test_dead_container(self):
        class Dead:
            def __len__(self):
                raise BrokenPipeError("gone")

            __getitem__ = __setitem__ = __delitem__ = __len__

        cache = _ListCache(Dead())
        with self.assertWarnsRegex(RuntimeWarning, "unreachable"):
            cache.resize(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            self.assertIsNone(cache.get(0, "k"))
            self.assertEqual(cache.get_or_compute(0, "k", lambda: 42), 42)


def _ddp_worker(rank: int, world: int, init: str, caches: list, rate: float, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for n, cache in enumerate(caches):
            log = os.path.join(out_dir, f"log{n}")
            ds = CacheDataset(DATA, make_transform(log), cache_rate=rate, runtime_cache=cache, progress=False)
            sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=1)
            # fork workers: spawn workers are covered by TestSizing, and each costs a full interpreter start here
            loader = DataLoader(
                ds, batch_size=2, sampler=sampler, num_workers=2, timeout=TIMEOUT, multiprocessing_context="fork"
            )
            seen = []
            for epoch in range(3):
                sampler.set_epoch(epoch)
                for batch in loader:
                    for s, img in zip(batch["src"], batch["img"]):
                        assert torch.equal(img, torch.full((3, 4), float(s) + 1)), (rank, int(s))
                        seen.append(int(s))
            with open(os.path.join(out_dir, f"seen{n}-rank{rank}"), "w") as f:
                f.write(" ".join(map(str, seen)))
            dist.barrier()
    finally:
        dist.destroy_process_group()


class TestDistributed(ManagerTestCase):
    @parameterized.expand([(0.5,), (1.0,)])
    def test_two_gloo_ranks_share_listproxy(self, rate):
        """Cases 1-3 (empty, shorter, longer ListProxy made in the parent) across 2 spawned gloo ranks."""
        lengths = (0, 3, 20)
        caches = [self.manager.list([None] * n) for n in lengths]
        init = f"file://{os.path.join(self.tmp, 'rdzv')}"
        run_ranks(self, _ddp_worker, (2, init, caches, rate, self.tmp))
        cache_num = int(len(DATA) * rate)
        for n, cache in enumerate(caches):
            self.assertEqual(len(cache), cache_num, f"initial length {lengths[n]}")
            self.assertEqual([e[1]["src"] for e in cache], DATA[:cache_num])
            seen = []
            for r in range(2):
                with open(os.path.join(self.tmp, f"seen{n}-rank{r}")) as f:
                    seen += [int(x) for x in f.read().split()]
            self.assertEqual(sorted(seen), sorted(DATA * 3))  # 3 epochs, each item once per epoch across ranks
            counts = executions(os.path.join(self.tmp, f"log{n}"))
            # a cached item is computed at most once per rank (a ListProxy has no claims, so both ranks may miss it
            # at once), never once per epoch as without a cache; the others every epoch
            for k in DATA[:cache_num]:
                self.assertGreaterEqual(counts[k], 1)
                self.assertLessEqual(counts[k], 2)
            for k in DATA[cache_num:]:
                self.assertEqual(counts[k], 3)


class CountedLoad(Load):
    """``Load`` holding members that pickle cannot store: a lock and a ``multiprocessing.Value``."""

    def __init__(self, log: str) -> None:
        super().__init__(log)
        self.lock = threading.Lock()
        self.calls = multiprocessing.Value("i", 0)


def _unpicklable_rank(rank: int, world: int, init: str, path: str, log: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        store = SharedCacheStore(path)  # the parent's store, shared by both ranks (one node)
        data = list(range(24))
        ds = CacheDataset(data, Compose([CountedLoad(log), RandAdd()]), runtime_cache=store, progress=False)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=3)
        # fork workers: a multiprocessing.Value is passed to a process by inheritance only
        loader = DataLoader(
            ds, batch_size=2, sampler=sampler, num_workers=2, timeout=TIMEOUT, multiprocessing_context="fork"
        )
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for batch in loader:
                for s, img in zip(batch["src"], batch["img"]):
                    assert torch.equal(img, torch.full((3, 4), float(s) + 1)), (rank, int(s))
            dist.barrier()
        store.close()
    finally:
        dist.destroy_process_group()


def _key_train(item) -> bytes:
    return pickle_hashing(("train", item))


def _key_val(item) -> bytes:
    return pickle_hashing(("val", item))


class Tag(Transform):
    """Tells whether it was given a whole list or one element of it."""

    def __call__(self, x):
        return {"tag": ("whole", x) if isinstance(x, list) else ("item", x), "img": torch.zeros(1)}


class TestKeys(unittest.TestCase):
    def test_unpicklable_members_count_by_type(self):
        a, b = CountedLoad("x"), CountedLoad("x")
        self.assertIsNotNone(transforms_hashing([a]))
        self.assertEqual(transforms_hashing([a]), transforms_hashing([b]))  # other lock and Value, same type
        self.assertNotEqual(transforms_hashing([a]), transforms_hashing([CountedLoad("y")]))  # picklable state counts
        self.assertNotEqual(transforms_hashing([a]), transforms_hashing([Load("x")]))  # and the type

    def test_two_gloo_ranks_unpicklable_transform_compute_each_item_once(self):
        """2 ranks x 2 workers x 3 epochs, 24 items, a transform holding a multiprocessing.Value: 24 computations."""
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        store = SharedCacheStore()
        self.addCleanup(store.close)
        log = os.path.join(tmp, "log")
        init = f"file://{os.path.join(tmp, 'rdzv')}"
        run_ranks(self, _unpicklable_rank, (2, init, store.path, log))
        self.assertEqual(executions(log), Counter({i: 1 for i in range(24)}))

    def test_namespace_by_hash_func(self):
        """Pipelines that the hash cannot tell apart get separate items with a namespaced hash_func (the guide's)."""
        store = SharedCacheStore()
        self.addCleanup(store.close)
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "log")
            for hash_func in (_key_train, _key_val, _key_val):
                ds = CacheDataset(DATA, make_transform(log), hash_func=hash_func, runtime_cache=store, progress=False)
                for i in range(len(DATA)):
                    check_item(self, ds[i], DATA[i])
            self.assertEqual(executions(log), Counter({k: 2 for k in DATA}))  # once per namespace

    def test_compose_options_are_part_of_the_key(self):
        """Two datasets that differ only in Compose(map_items=...) share a store and never read each other's items."""
        store = SharedCacheStore()
        self.addCleanup(store.close)
        data = [[1, 2], [3, 4]]
        whole = CacheDataset(data, Compose([Tag(), RandAdd()], map_items=False), runtime_cache=store, progress=False)
        each = CacheDataset(data, Compose([Tag(), RandAdd()], map_items=True), runtime_cache=store, progress=False)
        for _ in range(2):
            for i, d in enumerate(data):
                self.assertEqual(whole[i]["tag"], ("whole", d))
                self.assertEqual([x["tag"] for x in each[i]], [("item", v) for v in d])


if __name__ == "__main__":
    unittest.main()
