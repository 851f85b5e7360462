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

import errno
import gc
import hashlib
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest
import warnings
from typing import Any, Callable
from unittest import mock

import numpy as np
import torch
from parameterized import parameterized

import monai
import monai.data.cache_coord as cache_coord
import monai.data.cache_counters as cache_counters
import monai.data.cache_mapping as cache_mapping
import monai.data.cache_pages as cache_pages
from monai.data.cache_store import MISS, SharedCacheStore
from monai.data.meta_tensor import MetaTensor


def _slow_marker() -> Callable[[Any], Any]:
    """pytest's ``slow`` marker (deselected by ``./runtests.sh --quick``), or nothing without pytest."""
    try:
        import pytest
    except ImportError:  # pragma: no cover
        return lambda obj: obj
    return pytest.mark.slow  # type: ignore[no-any-return]


slow = _slow_marker()


IS_LINUX = sys.platform.startswith("linux")
QUICKTEST = os.environ.get("QUICKTEST", "").strip().lower() in ("1", "true", "yes", "on")
TIMEOUT = 60.0  # for every wait on another process
FORK = multiprocessing.get_context("fork") if IS_LINUX else None
skip_unless_linux = unittest.skipUnless(IS_LINUX, "needs Linux (fork, /proc, flock)")
# cache_store maps item files through libc, and so keeps a pool of mappings that their finalizers release into, only
# where ``_map_private`` does: ``_libc()`` available (POSIX). Elsewhere mmap.mmap maps them, unpooled.
HAS_MAPPING_POOL = cache_mapping._libc() is not None
skip_unless_mapping_pool = unittest.skipUnless(
    HAS_MAPPING_POOL, "no mapping pool here: item files are mapped by mmap.mmap (no libc mmap)"
)
# leftover directories younger than this are kept (patched in for the checks of that rule, so that they cannot depend
# on how fast a loaded machine runs the test); backdated ones are older than it
LONG_MIN_AGE = 3600.0


# -- helpers ----------------------------------------------------------------------------------------------------------


def _assert_same(tc: unittest.TestCase, a: Any, b: Any, where: str = "item") -> None:
    """
    Recursive equality of ``a``, what was stored, and ``b``, what came back, that also checks the types, dtypes, shapes
    and MetaTensor metadata, and that no tensor of ``b`` requires grad (the store keeps tensors detached).
    """
    tc.assertIs(type(a), type(b), where)
    if isinstance(a, torch.Tensor):
        tc.assertFalse(b.requires_grad, f"{where}: a tensor out of the store must be detached")
        tc.assertIsNone(b.grad_fn, where)
        tc.assertEqual(a.dtype, b.dtype, where)
        tc.assertEqual(a.shape, b.shape, where)
        tc.assertEqual(a.device, b.device, where)
        x, y = torch.Tensor.as_subclass(a, torch.Tensor), torch.Tensor.as_subclass(b, torch.Tensor)
        if "float8" in str(a.dtype):  # no comparison kernels: compare the bytes
            x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        tc.assertTrue(torch.equal(x.resolve_conj(), y.resolve_conj()), where)
        if isinstance(a, MetaTensor):
            _assert_same(tc, a.meta, b.meta, where + ".meta")
            _assert_same(tc, a.applied_operations, b.applied_operations, where + ".applied_operations")
            tc.assertEqual(a.is_batch, b.is_batch, where + ".is_batch")
    elif isinstance(a, np.ndarray):
        tc.assertEqual(a.dtype, b.dtype, where)
        tc.assertEqual(a.shape, b.shape, where)
        if a.dtype.hasobject:
            tc.assertEqual(a.tolist(), b.tolist(), where)
        else:
            tc.assertEqual(a.tobytes(), b.tobytes(), where)
    elif isinstance(a, dict):
        tc.assertEqual(list(a.keys()), list(b.keys()), where)
        for k in a:
            _assert_same(tc, a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        tc.assertEqual(len(a), len(b), where)
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(tc, x, y, f"{where}[{i}]")
    else:
        tc.assertEqual(a, b, where)


def _item_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".item"))


def _claims(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".claim"))


def _participated(path: str) -> bool:
    """Whether some store object, in any process, participates in the store ``path`` (holds its lock file)."""
    import fcntl

    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if taken
    return False


def _unshare_works() -> bool:
    """Whether this process may start a process in a new PID namespace (root, or user namespaces allowed)."""
    if not IS_LINUX or shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


# a participant in another PID namespace: attaches, says so, and stays until its stdin closes (or it is killed)
_NAMESPACE_PARTICIPANT = textwrap.dedent("""
    import os, sys
    from monai.data.cache_store import SharedCacheStore

    store = SharedCacheStore(sys.argv[1])
    print("attached", os.getpid(), flush=True)
    sys.stdin.read()
    store.close()
    """)


def _start_in_pid_namespace(path: str) -> subprocess.Popen:
    """Start :py:data:`_NAMESPACE_PARTICIPANT` for the store ``path`` in a new PID namespace; wait until attached."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(monai.__file__)), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", _NAMESPACE_PARTICIPANT, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)  # type: ignore
    reader.start()
    reader.join(TIMEOUT)
    if not lines or lines[0].split()[:2] != [b"attached", b"1"]:  # pid 1: the first process of its own namespace
        proc.kill()
        proc.wait(TIMEOUT)
        raise AssertionError(f"the participant in a new PID namespace did not attach: {lines}")
    return proc


def _stop(proc: subprocess.Popen, kill: bool = False) -> int:
    """End a participant started by :py:func:`_start_in_pid_namespace`: close its stdin, or SIGKILL it."""
    if kill:  # SIGKILL the participant itself (unshare's child); unshare reaps it, then exits
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            children = []
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        if not children:
            proc.kill()
    else:
        proc.stdin.close()  # type: ignore[union-attr]
    try:
        return proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()  # type: ignore[union-attr]
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()


skip_unless_unshare = unittest.skipUnless(
    _unshare_works(), "cannot start a process in a new PID namespace here (`unshare --pid --fork` not permitted)"
)


def _runtime_warnings(caught: list) -> list:
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def _recv(conn: Any, timeout: float = TIMEOUT) -> Any:
    if not conn.poll(timeout):
        raise AssertionError("no message from the child process")
    return conn.recv()


def _run(target: Callable, *args: Any, timeout: float = TIMEOUT) -> int:
    """Run ``target(*args)`` in a forked process and return its exit code."""
    assert FORK is not None
    proc = FORK.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(TIMEOUT)
        raise AssertionError(f"{target.__name__} did not finish in {timeout} s")
    return proc.exitcode  # type: ignore[return-value]


def _wait_for(cond: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def _backdate(path: str, seconds: float = 60.0) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def _meta_tensor(is_batch: bool = False) -> MetaTensor:
    affine = torch.diag(torch.tensor([1.5, 2.0, 2.5, 1.0], dtype=torch.float64))
    mt = MetaTensor(torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4), affine=affine)
    mt.meta["filename_or_obj"] = "case_001.nii.gz"
    mt.meta["spatial_shape"] = np.array([3, 4])
    mt.push_applied_operation({"class": "Flip", "id": 1234, "orig_size": (3, 4), "extra_info": {"axes": [0]}})
    mt.push_applied_operation({"class": "Zoom", "id": 99, "extra_info": {"affine": torch.eye(3), "scale": 2.0}})
    mt.is_batch = is_batch
    return mt


def _dtypes() -> list[torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
    names += ["complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _tensor_of(dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4) / 2
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return base.to(dtype) * (1 + 1j)
    if not dtype.is_floating_point:
        return base.abs().to(torch.int64).to(dtype)
    return base.to(dtype)


TORCH_CASES = [(f"tensor_{str(dt).split('.')[-1]}", lambda dt=dt: _tensor_of(dt)) for dt in _dtypes()]

NUMPY_CASES = [
    (f"ndarray_{dt.replace('>', 'be_')}", lambda dt=dt: (np.arange(24).reshape(2, 3, 4) % 7).astype(dt))
    for dt in ["uint8", "int16", "int64", "float16", "float32", "float64", "complex64", "bool", ">f4"]
]

ROUND_TRIP_CASES = [
    ("dict_of_metatensor", lambda: {"image": _meta_tensor(), "label": _meta_tensor() > 5, "name": "case_001"}),
    ("metatensor_batch", lambda: _meta_tensor(is_batch=True)),
    ("list_of_tensors", lambda: [torch.ones(2, 2), torch.zeros(3, dtype=torch.int64), torch.tensor(7.5)]),
    ("tuple_of_tensors", lambda: (torch.linspace(0, 1, 4), torch.arange(3).to(torch.int16))),
    ("tensor_transposed", lambda: torch.arange(12.0).reshape(3, 4).T),
    ("tensor_strided", lambda: torch.arange(40).reshape(4, 10)[:, ::3]),
    ("tensor_offset_view", lambda: torch.arange(100.0)[37:41]),
    ("tensor_0d", lambda: torch.tensor(3.25)),
    ("tensor_empty", lambda: torch.zeros(0, 3, dtype=torch.float16)),
    # a leaf that requires grad, a non-leaf with a grad_fn, and a MetaTensor leaf: values kept, requires_grad not
    (
        "tensor_requires_grad",
        lambda: {
            "leaf": torch.linspace(-1, 1, 5, requires_grad=True),
            "non_leaf": torch.arange(4.0, requires_grad=True) * 2,
            "meta_leaf": _meta_tensor().requires_grad_(True),
        },
    ),
    ("tensor_conj", lambda: (torch.arange(4.0) * 1j).conj()),
    ("tensor_large", lambda: torch.arange(50_000, dtype=torch.float32).reshape(50, 1000)),
    ("ndarray_non_contiguous", lambda: np.arange(60.0).reshape(6, 10)[::2, 1::3]),
    ("ndarray_fortran", lambda: np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))),
    ("ndarray_0d", lambda: np.array(2.5)),
    ("ndarray_empty", lambda: np.zeros((0, 4), dtype=np.uint16)),
    ("ndarray_datetime", lambda: np.array(["2020-01-01", "2024-02-29"], dtype="datetime64[D]")),
    ("ndarray_structured", lambda: np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i4"), ("b", "<f8")])),
    ("ndarray_object", lambda: np.array([{"a": 1}, "x", None], dtype=object)),
    ("ndarray_large", lambda: np.arange(40_000, dtype=np.float64).reshape(200, 200)),
    ("scalars", lambda: [1, -(2**70), 2.5, 1 + 2j, True, False, np.float32(1.5), np.int64(3)]),
    ("strings", lambda: {"s": "text ünïcödé", "b": b"\x00bytes", "e": ""}),
    ("none", lambda: None),
    ("int", lambda: 42),
    (
        "nested",
        lambda: {
            "a": [{"t": torch.ones(2, 3)}, (np.ones(3), [None, "x", {"deep": torch.arange(3)}])],
            "meta": {"affine": torch.eye(4, dtype=torch.float64), "shape": (1, 2, 3)},
            "mt": [_meta_tensor()],
        },
    ),
]


class _TempRootMixin(unittest.TestCase):
    """A private temporary root for the stores of a test, removed afterwards with everything in it."""

    root_parent: str | None = None  # where to make the root; None: the system's temporary directory

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="test-cache-store-", dir=self.root_parent)
        self.stores: list[SharedCacheStore] = []

    def tearDown(self) -> None:
        for store in self.stores:
            store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def new_store(self, **kwargs: Any) -> SharedCacheStore:
        store = SharedCacheStore(root=self.root, **kwargs)
        self.stores.append(store)
        return store


# -- children of the multi-process tests (module level, so that they can run in another process) ---------------------


def _child_slow_writer(path: str) -> None:
    torch.set_num_threads(1)
    store = SharedCacheStore(path, participate=False)
    real_write = os.write

    def slow_write(fd: int, data: Any) -> int:
        time.sleep(0.01)
        return real_write(fd, memoryview(data)[:4096])

    os.write = slow_write  # type: ignore[assignment]
    store.put(0, "big", np.zeros(1 << 20, dtype=np.uint8))  # 256 slow writes: killed long before the end


def _child_fill(path: str, keys: list[str], counts: Any, shift: int) -> None:
    torch.set_num_threads(1)
    store = SharedCacheStore(path, participate=False)
    order = keys[shift:] + keys[:shift]
    for key in order + order:
        k = keys.index(key)

        def compute(k: int = k) -> dict:
            with counts.get_lock():
                counts[k] += 1
            time.sleep(0.02)
            return {"k": k, "t": torch.full((20_000,), float(k)), "a": np.full(100, k, dtype=np.int32)}

        item = store.get_or_compute(k, key, compute)
        ok = item["k"] == k and bool((item["t"] == k).all()) and item["t"].shape == (20_000,)
        if not (ok and bool((item["a"] == k).all())):
            raise AssertionError(f"wrong item for {key}")


def _child_create_and_wait(root: str, conn: Any) -> None:
    torch.set_num_threads(1)
    store = SharedCacheStore(root=root)
    store.put(0, "x", torch.ones(3))
    conn.send(store.path)  # a pipe, not a queue: a queue's lock may die with a killed child
    time.sleep(TIMEOUT)


def _child_attach_and_wait(path: str, conn: Any, event: Any) -> None:
    store = SharedCacheStore(path)
    conn.send("attached")
    if event is None:
        time.sleep(TIMEOUT)  # to be killed
    elif event.wait(TIMEOUT):
        store.close()


def _child_compute_forever(path: str, conn: Any) -> None:
    store = SharedCacheStore(path, participate=False, claim_timeout=TIMEOUT)

    def compute() -> int:
        conn.send("computing")
        time.sleep(TIMEOUT)  # to be killed
        return -1

    store.get_or_compute(0, "k", compute)


def _child_read_after_fork(path: str) -> None:
    store = SharedCacheStore(path, participate=False)
    for _ in range(3):
        t = store.get(0, "big")
        if t is MISS or int(t[-1]) != 299_999:
            raise AssertionError("wrong item")
        del t
        gc.collect()  # releases the mapping into the pool


def _child_count_and_die(path: str, hits: int) -> None:
    """Read the item ``k`` ``hits`` times and compute ``c``, then die without any cleanup (SIGKILL)."""
    store = SharedCacheStore(path, participate=False)
    for _ in range(hits):
        store.get_or_compute(0, "k", lambda: -1)
    store.get_or_compute(1, "c", lambda: 7)
    os.kill(os.getpid(), signal.SIGKILL)


def _child_stats(path: str, conn: Any) -> None:
    conn.send(SharedCacheStore(path, participate=False).stats())


def _child_many_items(path: str, n: int, n_mapped: int) -> None:
    import resource

    torch.set_num_threads(1)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    store = SharedCacheStore(path, participate=False)
    for i in range(n):
        if not store.put(i, f"key{i}", {"i": i, "t": torch.tensor([i, i + 1])}):
            raise AssertionError(f"put {i} failed")
    items = [store.get(i, f"key{i}") for i in range(n)]  # all alive at once
    if any(item is MISS or item["i"] != i or item["t"].tolist() != [i, i + 1] for i, item in enumerate(items)):
        raise AssertionError("wrong items")
    cache_mapping._SMALL_FILE = 0  # map every file: the mappings must not hold a descriptor each
    mapped = [store.get(i, f"key{i}") for i in range(n_mapped)]
    if any(item is MISS or item["t"].tolist() != [i, i + 1] for i, item in enumerate(mapped)):
        raise AssertionError("wrong mapped items")
    n_fds = len(os.listdir("/proc/self/fd"))
    if n_fds > 100:
        raise AssertionError(f"{n_fds} open descriptors for {n_mapped} mapped items")


# -- tests ------------------------------------------------------------------------------------------------------------


class TestRoundTrip(_TempRootMixin):
    @parameterized.expand(ROUND_TRIP_CASES + TORCH_CASES + NUMPY_CASES)
    def test_round_trip(self, _: str, make: Callable[[], Any]) -> None:
        store = self.new_store()
        self.assertTrue(store.put(0, "key", make()))
        out = store.get(0, "key")
        _assert_same(self, make(), out)
        if isinstance(out, (torch.Tensor, np.ndarray, list, dict)):
            self.assertIsNot(store.get(0, "key"), out)  # a fresh object graph every time

    def test_metatensor_details(self) -> None:
        store = self.new_store()
        mt = _meta_tensor()
        store.put(0, "k", {"img": mt})
        out = store.get(0, "k")["img"]
        self.assertIsInstance(out, MetaTensor)
        self.assertIs(type(out.affine), torch.Tensor)
        self.assertEqual(out.affine.dtype, torch.float64)
        self.assertTrue(torch.equal(out.affine, mt.affine))
        self.assertEqual(out.applied_operations[0]["extra_info"], {"axes": [0]})
        self.assertEqual(set(out.__dict__), set(mt.__dict__))
        out.meta["new"] = 1  # private metadata
        self.assertNotIn("new", store.get(0, "k")["img"].meta)

    def test_requires_grad_is_detached(self) -> None:
        store = self.new_store()
        store.put(0, "k", torch.ones(3, requires_grad=True) * 2)
        out = store.get(0, "k")
        self.assertFalse(out.requires_grad)
        self.assertEqual(out.tolist(), [2.0, 2.0, 2.0])

    def test_same_object_twice_stays_shared(self) -> None:
        store = self.new_store()
        t = torch.arange(3)
        store.put(0, "k", [t, t])
        a, b = store.get(0, "k")
        self.assertIs(a, b)

    def test_gpu_tensor_refused(self) -> None:
        store = self.new_store()
        with self.assertRaisesRegex(TypeError, "CPU tensors.*EnsureTyped"):
            store.put(0, "k", {"img": torch.empty(3, device="meta")})
        self.assertEqual(os.listdir(os.path.join(store.path, ".tmp")), [])
        self.assertIs(store.get(0, "k"), MISS)

    def test_unpicklable_item_raises_and_leaves_nothing(self) -> None:
        store = self.new_store()
        item = {"f": lambda x: x}
        with self.assertRaises(Exception) as pickling:
            pickle.dumps(item, protocol=5)
        with self.assertRaises(type(pickling.exception)):  # what pickling raises, not some other error
            store.put(0, "k", item)
        self.assertEqual(os.listdir(os.path.join(store.path, ".tmp")), [])
        self.assertEqual(_item_files(store.path), [])

    @parameterized.expand(
        [("safe", "0123abcdEF_-x", "0123abcdEF_-x"), ("unsafe", "a/b c.nii", None), ("long", "k" * 129, None)]
    )
    def test_key_file_names(self, _: str, key: str, stem: str | None) -> None:
        store = self.new_store()
        store.put(3, key, [key])
        stem = stem or hashlib.sha256(key.encode()).hexdigest()
        self.assertEqual(_item_files(store.path), [stem + ".item"])
        self.assertEqual(store.get(7, key), [key])  # the index is informational
        self.assertIs(store.get(3, key + "x"), MISS)

    def test_file_of_another_key_is_a_miss(self) -> None:
        store = self.new_store()
        store.put(0, "a", 1)
        shutil.copy(os.path.join(store.path, "a.item"), os.path.join(store.path, "b.item"))
        self.assertIs(store.get(0, "b"), MISS)
        self.assertEqual(store.get(0, "a"), 1)


class TestZeroCopy(_TempRootMixin):
    def _mapped_files(self, address: int) -> list[str]:
        found = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi and len(fields) >= 6:
                    found.append(fields[5])
        return found

    @skip_unless_linux
    @skip_unless_mapping_pool
    def test_unwritten_mapping_is_reused_written_one_never(self) -> None:
        store = self.new_store()
        store.put(0, "k", torch.arange(100_000))
        t = store.get(0, "k")  # below the pool's minimum size: unmapped with its last view
        address = t.data_ptr()
        del t
        gc.collect()
        self.assertEqual(self._mapped_files(address), [])
        patcher = mock.patch.object(cache_mapping._POOL, "MIN_SIZE", 0)
        patcher.start()
        self.addCleanup(patcher.stop)
        t = store.get(0, "k")
        address = t.data_ptr()
        del t
        gc.collect()
        t = store.get(0, "k")  # the mapping (and its page tables) of the same unchanged file is taken over
        self.assertEqual(t.data_ptr(), address)
        self.assertEqual(int(t[5]), 5)
        t[5] = -7  # written: this mapping must never be handed to another reader
        del t
        gc.collect()
        self.assertEqual(self._mapped_files(address), [])
        t = store.get(0, "k")
        self.assertEqual(int(t[5]), 5)
        self.assertTrue(torch.equal(t, torch.arange(100_000)))
        other = store.get(0, "k")  # a second reader while the first is alive gets its own mapping
        self.assertNotEqual(other.data_ptr(), t.data_ptr())
        store.put(0, "k", torch.arange(100_000) * 2)  # replaced: a kept mapping of the old file is not reused
        address = t.data_ptr()
        del t, other
        gc.collect()
        self.assertEqual(self._mapped_files(address), [])
        self.assertEqual(int(store.get(0, "k")[3]), 6)

    @skip_unless_linux
    @skip_unless_mapping_pool
    def test_watched_mapping_takes_no_fault_and_a_written_one_goes(self) -> None:
        """A mapping reused once is populated and write-watched: hits without page faults; a write still unmaps it."""
        import resource

        def faults_of_full_read() -> int:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = store.get(0, "k")
            total = int(t.sum())
            after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self.assertEqual(total, n * (n - 1) // 2)
            del t
            gc.collect()
            return after - before

        # on the default root (/dev/shm, tmpfs in 4 KiB pages): the tests' temporary root may be on a file system
        # whose files the kernel maps in huge pages, which are not watched
        store = SharedCacheStore()
        self.addCleanup(store.close)
        n = 1 << 22  # 32 MiB of int64: 8,192 pages
        store.put(0, "k", torch.arange(n))
        item = os.path.join(store.path, "k.item")
        fresh = faults_of_full_read()
        for _ in range(2):  # kept after the first read, watched after the first reuse
            faults_of_full_read()
        states = [entry[3] for entry in cache_mapping._POOL._order if entry[0][0] == item]
        if states != [cache_pages._WATCHED]:
            self.skipTest(f"no write watch on {store.path}: kernel < 6.7, userfaultfd refused, or huge pages: {states}")
        self.assertGreater(fresh, 20)  # a fresh mapping faults (fault-around maps up to a folio at a time)
        self.assertLess(faults_of_full_read(), min(10, fresh // 2))  # a watched one: every page is in, no fault
        t = store.get(0, "k")
        address = t.data_ptr()
        t[n - 1] = -7  # written: this mapping must never be handed to another reader
        del t
        gc.collect()
        self.assertEqual(self._mapped_files(address), [])
        t = store.get(0, "k")
        self.assertTrue(torch.equal(t, torch.arange(n)))
        t[3] = 0  # the first page written of a fresh mapping is caught by the category check too
        del t
        gc.collect()
        self.assertGreater(faults_of_full_read(), 20)  # unmapped again: a fresh mapping

    @skip_unless_linux
    @skip_unless_mapping_pool
    def test_release_from_garbage_collection_never_deadlocks(self) -> None:
        """A collection that frees a mapped item inside the pool's critical section must not wait for the pool."""
        code = textwrap.dedent(f"""
            import gc, tempfile
            import numpy as np
            from monai.data.cache_store import SharedCacheStore, _POOL
            _POOL.MIN_SIZE = 0  # pool these small items too
            st = SharedCacheStore(root=tempfile.mkdtemp(dir={self.root!r}))
            st.put(0, "k0", {{"a": np.ones(2**17)}})
            st.put(1, "k1", {{"a": np.ones(2**17)}})
            gc.collect()
            gc.freeze()  # collections then only scan what the loop makes: fast
            for threshold in range(1, 200):  # sweep, so that some collection starts inside the pool's lock
                gc.disable()
                a = st.get(0, "k0")
                a["self"] = a  # an unreachable cycle that holds a mapping
                del a
                b = st.get(1, "k1")
                gc.set_threshold(threshold)
                gc.enable()
                del b  # releasing b's mapping allocates: a collection there frees a's mapping
                gc.disable()
                gc.collect()
            gc.set_threshold(700)
            gc.enable()
            assert float(st.get(0, "k0")["a"].sum()) == 2**17
            st.close()
            print("ok")
            """)
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            self.fail("releasing a mapping from the garbage collector deadlocked")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "ok")

    @skip_unless_linux
    @skip_unless_mapping_pool
    def test_fork_while_pool_is_updated(self) -> None:
        """A worker forked while another thread holds the pool's lock, mid-update, can read items."""
        patcher = mock.patch.object(cache_mapping._POOL, "MIN_SIZE", 0)
        patcher.start()
        self.addCleanup(patcher.stop)
        store = self.new_store()
        store.put(0, "big", torch.arange(300_000))
        t = store.get(0, "big")
        del t
        gc.collect()  # a kept mapping
        pool = cache_mapping._POOL
        locked, release = threading.Event(), threading.Event()
        item = os.path.join(store.path, "big.item")
        st = os.stat(item)
        ident = (item, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

        def update() -> None:
            with pool._lock:
                # torn state, as in the middle of _process: a mapping in the free list, not yet in the eviction order
                pool._free.setdefault(ident, []).append((4096, 4096, 1))
                locked.set()
                release.wait(TIMEOUT)
                pool._free[ident].remove((4096, 4096, 1))

        thread = threading.Thread(target=update)
        thread.start()
        try:
            self.assertTrue(locked.wait(TIMEOUT))
            self.assertEqual(_run(_child_read_after_fork, store.path), 0)
        finally:
            release.set()
            thread.join(TIMEOUT)
        self.assertEqual(int(store.get(0, "big")[-1]), 299_999)

    @skip_unless_linux
    @skip_unless_mapping_pool
    def test_kept_mappings_do_not_pin_removed_items(self) -> None:
        def deleted_mappings(store_path: str) -> list[str]:
            with open("/proc/self/maps") as f:
                return [line for line in f if store_path in line and "(deleted)" in line]

        patcher = mock.patch.object(cache_mapping._POOL, "MIN_SIZE", 0)
        patcher.start()
        self.addCleanup(patcher.stop)
        store = self.new_store()
        for n in range(3):
            store.put(n, f"k{n}", torch.arange(200_000))
            t = store.get(n, f"k{n}")
            del t  # kept by the pool for the next read
        gc.collect()
        store.invalidate(["k0", "k1", "k2"], ["k2"])  # set_data dropped two inputs
        gc.collect()
        self.assertEqual(deleted_mappings(store.path), [])
        t = store.get(2, "k2")
        self.assertEqual(int(t[-1]), 199_999)
        del t
        gc.collect()
        path = store.path
        store.close()  # the directory goes: nothing of it may stay mapped in this process
        gc.collect()
        self.assertFalse(os.path.isdir(path))
        self.assertEqual(deleted_mappings(path), [])

    @skip_unless_linux
    def test_large_items_are_views_of_a_private_mapping(self) -> None:
        store = self.new_store()
        store.put(0, "k", {"t": torch.arange(100_000, dtype=torch.float32), "a": np.arange(50_000.0)})
        path = os.path.join(store.path, "k.item")
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        first, second = store.get(0, "k"), store.get(0, "k")
        # the data lives in a mapping of the item file, not in a copy
        self.assertEqual(self._mapped_files(first["t"].data_ptr()), [path])
        self.assertEqual(self._mapped_files(first["a"].ctypes.data), [path])
        self.assertNotEqual(first["t"].data_ptr(), second["t"].data_ptr())
        self.assertTrue(first["a"].flags.writeable and first["a"].flags.aligned)
        self.assertEqual(first["t"].data_ptr() % 64, 0)
        first["t"] += 1  # copy-on-write: private to this reader
        first["a"][:] = -1
        self.assertEqual(second["t"][:3].tolist(), [0.0, 1.0, 2.0])
        self.assertEqual(second["a"][:3].tolist(), [0.0, 1.0, 2.0])
        with open(path, "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), digest)
        third = store.get(0, "k")
        self.assertTrue(torch.equal(third["t"], torch.arange(100_000, dtype=torch.float32)))

    @skip_unless_linux
    def test_mapping_outlives_item_and_file(self) -> None:
        store = self.new_store()
        store.put(0, "k", torch.arange(100_000))
        t = store.get(0, "k")
        store.invalidate(["k"], [])  # the file is gone; the private mapping stays valid
        gc.collect()
        self.assertEqual(int(t[-1]), 99_999)
        address = t.data_ptr()
        del t
        gc.collect()
        self.assertEqual(self._mapped_files(address), [])  # unmapped with its last view

    def test_small_items_are_private(self) -> None:
        store = self.new_store()
        store.put(0, "k", {"t": torch.zeros(4), "a": np.zeros(4)})
        first, second = store.get(0, "k"), store.get(0, "k")
        first["t"][0], first["a"][0] = 5, 5
        self.assertEqual(second["t"].tolist(), [0.0] * 4)
        self.assertEqual(store.get(0, "k")["a"].tolist(), [0.0] * 4)
        self.assertTrue(SharedCacheStore.reads_are_private)


class TestClaims(_TempRootMixin):
    def test_hit_does_not_compute(self) -> None:
        store = self.new_store()
        store.put(0, "k", 1)
        self.assertEqual(store.get_or_compute(0, "k", lambda: 1 / 0), 1)

    def test_compute_error_propagates_and_releases_claim(self) -> None:
        store = self.new_store()
        with self.assertRaises(ZeroDivisionError):
            store.get_or_compute(0, "k", lambda: 1 / 0)
        self.assertEqual(_claims(store.path), [])
        self.assertEqual(store.get_or_compute(0, "k", lambda: 2), 2)
        self.assertEqual(store.get(0, "k"), 2)

    def test_threads_compute_once(self) -> None:
        store = self.new_store()
        calls: list[int] = []
        results: list[Any] = []
        barrier = threading.Barrier(4)

        def compute() -> torch.Tensor:
            calls.append(1)
            time.sleep(0.1)
            return torch.arange(5)

        def run() -> None:
            barrier.wait(TIMEOUT)
            results.append(store.get_or_compute(0, "k", compute))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        self.assertEqual(len(calls), 1)
        self.assertEqual(len(results), 4)
        self.assertTrue(all(torch.equal(r, torch.arange(5)) for r in results))

    def test_recursive_compute_of_same_key(self) -> None:
        store = self.new_store(claim_timeout=TIMEOUT)
        self.assertEqual(store.get_or_compute(0, "k", lambda: store.get_or_compute(0, "k", lambda: 7) + 1), 8)
        self.assertEqual(store.get(0, "k"), 8)

    @skip_unless_linux
    def test_claim_file_without_holder_is_free(self) -> None:
        store = self.new_store(claim_timeout=TIMEOUT)
        open(os.path.join(store.path, "k.claim"), "w").close()  # e.g. left by a process killed while computing
        start = time.monotonic()
        self.assertEqual(store.get_or_compute(0, "k", lambda: "computed"), "computed")
        self.assertLess(time.monotonic() - start, TIMEOUT / 2)
        self.assertEqual(store.get(0, "k"), "computed")
        self.assertEqual(_claims(store.path), [])

    @skip_unless_linux
    def test_claim_timeout_computes_without_storing(self) -> None:
        import fcntl

        store = self.new_store(claim_timeout=0.2)
        fd = os.open(os.path.join(store.path, "k.claim"), os.O_CREAT | os.O_RDWR, 0o600)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held by someone else (another descriptor) that never releases it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(store.get_or_compute(0, "k", lambda: 5), 5)
            self.assertEqual(store.get_or_compute(0, "k", lambda: 6), 6)
        self.assertEqual(len(_runtime_warnings(caught)), 1)
        self.assertIs(store.get(0, "k"), MISS)

    @skip_unless_linux
    def test_killed_owner_releases_claim_at_once(self) -> None:
        """A process killed while it computes an item delays the others by about one poll, not claim_timeout."""
        store = self.new_store(claim_timeout=TIMEOUT)
        receiver, sender = FORK.Pipe(duplex=False)  # type: ignore[union-attr]
        proc = FORK.Process(target=_child_compute_forever, args=(store.path, sender))  # type: ignore[union-attr]
        proc.start()
        try:
            self.assertEqual(_recv(receiver), "computing")
            calls: list[float] = []
            done: list[float] = []
            results: list[Any] = []

            def compute() -> str:
                calls.append(time.monotonic())
                return "again"

            def wait() -> None:
                results.append(store.get_or_compute(0, "k", compute))
                done.append(time.monotonic())

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.5)
            self.assertEqual(done, [], "the waiter did not wait for the owner of the claim")
            killed = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            waiter.join(TIMEOUT)
            self.assertFalse(waiter.is_alive())
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(TIMEOUT)
        self.assertLess(done[0] - killed, 1.0)
        self.assertEqual((results, len(calls)), (["again"], 1))  # computed once more, and stored
        self.assertEqual(store.get(0, "k"), "again")
        self.assertEqual(_claims(store.path), [])

    @skip_unless_linux
    def test_processes_compute_each_key_once(self) -> None:
        store = self.new_store()
        keys = [f"key{i}" for i in range(8)]
        counts = FORK.Array("i", len(keys))  # type: ignore[union-attr]
        procs = [
            FORK.Process(target=_child_fill, args=(store.path, keys, counts, 2 * i))  # type: ignore[union-attr]
            for i in range(4)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)
        self.assertEqual([p.exitcode for p in procs], [0] * 4)
        self.assertEqual(counts[:], [1] * len(keys))
        self.assertEqual(_item_files(store.path), sorted(k + ".item" for k in keys))
        self.assertEqual(_claims(store.path), [])


class TestAtomicPublish(_TempRootMixin):
    @skip_unless_linux
    def test_killed_writer_leaves_no_item(self) -> None:
        store = self.new_store()
        tmp_dir = os.path.join(store.path, ".tmp")
        proc = FORK.Process(target=_child_slow_writer, args=(store.path,))  # type: ignore[union-attr]
        proc.start()
        try:
            _wait_for(lambda: any(os.path.getsize(os.path.join(tmp_dir, n)) > 0 for n in os.listdir(tmp_dir)))
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(TIMEOUT)
        self.assertEqual(len(os.listdir(tmp_dir)), 1)  # the half-written temporary file
        self.assertEqual(_item_files(store.path), [])
        self.assertIs(store.get(0, "big"), MISS)
        self.assertTrue(store.put(0, "big", torch.ones(10)))
        self.assertEqual(os.listdir(tmp_dir), [])  # the dead writer's file is cleaned up
        self.assertTrue(torch.equal(store.get(0, "big"), torch.ones(10)))

    @skip_unless_linux
    def test_cleaner_holding_a_new_temp_file_does_not_lose_the_write(self) -> None:
        """A cleaner that takes a writer's new temporary file for a dead writer's, and still holds it when the writer
        tries to lock it, removes it: the writer makes it again and publishes (it once wrote to the removed file)."""
        import fcntl

        store = self.new_store()
        tmp_dir = os.path.join(store.path, ".tmp")
        real_flock, raced = fcntl.flock, []

        def flock(fd: int, op: int) -> None:
            if not raced and os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == tmp_dir:
                raced.append(True)
                path = os.readlink(f"/proc/self/fd/{fd}")
                cleaner = os.open(path, os.O_RDONLY)
                real_flock(cleaner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the cleaner got it first...
                try:
                    real_flock(fd, op)  # ...so the writer's lock fails
                finally:
                    os.unlink(path)  # ...and the cleaner removes the file
                    os.close(cleaner)
            real_flock(fd, op)

        with mock.patch.object(cache_coord.fcntl, "flock", flock):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a lost write would warn "cannot write items"
                self.assertTrue(store.put(0, "k", torch.arange(5)))
        self.assertEqual(raced, [True])
        self.assertTrue(torch.equal(store.get(0, "k"), torch.arange(5)))
        self.assertEqual(os.listdir(tmp_dir), [])

    @parameterized.expand(
        [
            ("garbage", lambda data: b"not an item at all"),
            ("empty", lambda data: b""),
            ("truncated", lambda data: data[:-7]),
            ("bad_version", lambda data: data[:8] + b"\x63\x00" + data[10:]),
            ("bad_magic", lambda data: b"X" + data[1:]),
            ("bad_pickle", lambda data: data[:-40] + b"\x00" * 40),
        ]
    )
    def test_malformed_file_is_a_miss_and_removed(self, _: str, damage: Callable[[bytes], bytes]) -> None:
        store = self.new_store()
        store.put(0, "k", {"x": "y" * 100})
        path = os.path.join(store.path, "k.item")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(damage(data))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertIs(store.get(0, "k"), MISS)
        self.assertFalse(os.path.exists(path))
        self.assertEqual(store.get_or_compute(0, "k", lambda: 1), 1)


class TestFaults(_TempRootMixin):
    def test_enospc(self) -> None:
        store = self.new_store()
        store.put(0, "old", 1)
        item = {"t": torch.arange(10), "a": np.ones(3)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mock.patch.object(os, "write", side_effect=OSError(errno.ENOSPC, "No space left on device")):
                out = store.get_or_compute(0, "k", lambda: item)
                self.assertFalse(store.put(1, "k2", item))
                self.assertFalse(store.put(1, "k2", item))
            self.assertEqual(store.get_or_compute(2, "k3", lambda: 3), 3)
        _assert_same(self, item, out)
        runtime = _runtime_warnings(caught)
        self.assertEqual(len(runtime), 1, [str(w.message) for w in runtime])
        self.assertIn("No space left", str(runtime[0].message))
        self.assertEqual(os.listdir(os.path.join(store.path, ".tmp")), [])
        self.assertEqual(_item_files(store.path), ["old.item"])
        self.assertEqual(store.get(0, "old"), 1)  # reads go on
        self.assertEqual(_claims(store.path), [])

    def test_directory_removed_mid_run(self) -> None:
        store = self.new_store()
        store.put(0, "k", 1)
        shutil.rmtree(store.path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertIs(store.get(0, "k"), MISS)
            self.assertFalse(store.put(0, "k", 2))
            self.assertEqual(store.get_or_compute(0, "k", lambda: 3), 3)
            store.resize(4)
            store.invalidate(["k"], [])
            self.assertEqual(len(store), 0)
            # the removed directory: one miss, one computation, and the two items not stored counted as refused
            counts = {"hits": 0, "misses": 1, "computed": 1, "refused": 2}
            self.assertEqual(store.stats(), {"filled": 0, "capacity": 0, "nbytes": 0, **counts})
            store.close()
        self.assertEqual(len(_runtime_warnings(caught)), 1)
        self.assertFalse(os.path.exists(store.path))  # never re-created

    def test_unreadable_item_is_a_miss(self) -> None:
        store = self.new_store()
        store.put(0, "k", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mock.patch.object(os, "open", side_effect=PermissionError(errno.EACCES, "Permission denied")):
                self.assertIs(store.get(0, "k"), MISS)
                self.assertIs(store.get(0, "k"), MISS)
        self.assertEqual(len(_runtime_warnings(caught)), 1)
        self.assertEqual(store.get(0, "k"), 1)


class TestSecurity(_TempRootMixin):
    @parameterized.expand([("group_other_rx", 0o755), ("world_writable", 0o777), ("group_rwx", 0o770)])
    @unittest.skipUnless(os.name == "posix", "POSIX modes")
    def test_refuses_shared_mode(self, _: str, mode: int) -> None:
        path = os.path.join(self.root, "d")
        os.mkdir(path)
        os.chmod(path, mode)
        with self.assertRaisesRegex(PermissionError, "mode.*unpickled"):
            SharedCacheStore(path)

    @unittest.skipUnless(os.name == "posix", "symbolic links")
    def test_refuses_symlink(self) -> None:
        store = self.new_store()
        link = os.path.join(self.root, "link")
        os.symlink(store.path, link)
        with self.assertRaisesRegex(PermissionError, "symbolic link"):
            SharedCacheStore(link)

    def test_refuses_file(self) -> None:
        path = os.path.join(self.root, "f")
        open(path, "w").close()
        os.chmod(path, 0o600)
        with self.assertRaisesRegex(PermissionError, "not a directory"):
            SharedCacheStore(path)

    @unittest.skipUnless(hasattr(os, "getuid"), "POSIX uids")
    def test_refuses_other_owner(self) -> None:
        store = self.new_store()
        with mock.patch.object(os, "getuid", return_value=os.getuid() + 4242):
            with self.assertRaisesRegex(PermissionError, "owned by uid"):
                SharedCacheStore(store.path)

    def test_missing_directory(self) -> None:
        with self.assertRaisesRegex(FileNotFoundError, "does not exist"):
            SharedCacheStore(os.path.join(self.root, "nope"))

    def test_arguments(self) -> None:
        store = self.new_store()
        with self.assertRaises(ValueError):
            SharedCacheStore(store.path, root=self.root)
        with self.assertRaises(ValueError):
            SharedCacheStore(store.path, claim_timeout=-1)
        with self.assertRaises(ValueError):
            store.resize(-1)

    @unittest.skipUnless(os.name == "posix", "POSIX modes")
    def test_created_directory_is_private(self) -> None:
        store = self.new_store()
        self.assertEqual(os.lstat(store.path).st_mode & 0o777, 0o700)
        self.assertTrue(os.path.basename(store.path).startswith("monai-cache-"))
        self.assertEqual(os.path.dirname(store.path), os.path.abspath(self.root))


class TestLifetime(_TempRootMixin):
    def test_default_root(self) -> None:
        store = SharedCacheStore()
        try:
            if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
                self.assertEqual(os.path.dirname(store.path), "/dev/shm")
            self.assertTrue(store.put(0, "k", torch.ones(2)))
            self.assertTrue(torch.equal(store.get(0, "k"), torch.ones(2)))
        finally:
            store.close()
        self.assertFalse(os.path.exists(store.path))

    def test_two_participants(self) -> None:
        first = self.new_store()
        second = SharedCacheStore(first.path)
        self.stores.append(second)
        first.close()
        first.close()  # idempotent
        self.assertTrue(os.path.isdir(first.path))
        self.assertIs(first.get(0, "k"), MISS)  # a closed store misses
        second.put(0, "k", 1)
        second.close()
        self.assertFalse(os.path.exists(first.path))

    def test_non_participant_does_not_keep_or_remove(self) -> None:
        store = self.new_store()
        reader = SharedCacheStore(store.path, participate=False)
        reader.close()
        self.assertTrue(os.path.isdir(store.path))
        store.close()
        self.assertFalse(os.path.exists(store.path))

    @skip_unless_linux
    def test_store_without_participant_is_a_leftover(self) -> None:
        store = self.new_store(participate=False)
        store.put(0, "k", 1)
        self.assertFalse(_participated(store.path))
        self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [store.path])  # at once: no age needed
        # a directory without a lock file: its creator may be making it, or died before
        creating = tempfile.mkdtemp(prefix="monai-cache-", dir=self.root)
        with mock.patch.object(cache_coord, "_LEFTOVER_MIN_AGE", LONG_MIN_AGE):  # however slowly this test runs
            self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [])
            _backdate(creating, 2 * LONG_MIN_AGE)
            self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [creating])
        creating = tempfile.mkdtemp(prefix="monai-cache-", dir=self.root)
        _backdate(creating)  # a minute is old enough with the real minimum age
        self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [creating])
        self.assertEqual(os.listdir(self.root), [])

    @skip_unless_linux
    def test_cleanup_keeps_stores_in_use(self) -> None:
        store = self.new_store()
        reader = SharedCacheStore(store.path, participate=False)
        _backdate(store.path)
        self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [])
        self.assertEqual(reader.get_or_compute(0, "k", lambda: 4), 4)
        self.assertEqual(store.get(0, "k"), 4)

    def test_garbage_collection_closes(self) -> None:
        store = SharedCacheStore(root=self.root)
        path = store.path
        del store
        gc.collect()
        self.assertFalse(os.path.exists(path))

    @skip_unless_linux
    def test_killed_creator_is_cleaned_up(self) -> None:
        paths: list[str] = []
        for _ in range(2):
            receiver, sender = FORK.Pipe(duplex=False)  # type: ignore[union-attr]
            proc = FORK.Process(target=_child_create_and_wait, args=(self.root, sender))  # type: ignore[union-attr]
            proc.start()
            try:
                paths.append(_recv(receiver))
                self.assertTrue(_participated(paths[-1]))
            finally:
                os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
                proc.join(TIMEOUT)
        # the second creator's cleanup removed the first one's directory, its creator killed: no age to wait for
        self.assertEqual(os.listdir(self.root), [os.path.basename(paths[1])])
        store = self.new_store()  # a new store cleans its root at once
        self.assertEqual(os.listdir(self.root), [os.path.basename(store.path)])

    @skip_unless_linux
    @skip_unless_unshare
    def test_participant_in_other_pid_namespace(self) -> None:
        """Processes of two PID namespaces share a store: it stays while either uses it and goes with the last."""
        store = self.new_store()
        store.put(0, "k", torch.arange(3))
        proc = _start_in_pid_namespace(store.path)
        try:
            store.close()  # the creator leaves first
            self.assertTrue(os.path.isdir(store.path))  # the other namespace still uses it
            self.assertTrue(_participated(store.path))
            self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [])
            other = SharedCacheStore(store.path)  # one more from this namespace
            self.assertTrue(torch.equal(other.get(0, "k"), torch.arange(3)))
        finally:
            code = _stop(proc)
        self.assertEqual(code, 0)
        self.assertTrue(os.path.isdir(store.path))  # this namespace still uses it
        other.close()
        self.assertFalse(os.path.exists(store.path))  # the last one removed it

    @skip_unless_linux
    @skip_unless_unshare
    def test_all_participants_killed_across_pid_namespaces(self) -> None:
        """A store whose participants were all killed, one in another PID namespace, is removed by the next one."""
        receiver, sender = FORK.Pipe(duplex=False)  # type: ignore[union-attr]
        creator = FORK.Process(target=_child_create_and_wait, args=(self.root, sender))  # type: ignore[union-attr]
        creator.start()
        other = None
        try:
            path = _recv(receiver)
            other = _start_in_pid_namespace(path)
            os.kill(creator.pid, signal.SIGKILL)  # type: ignore[arg-type]
            creator.join(TIMEOUT)
            self.assertTrue(os.path.isdir(path))
            self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [])  # still in use in the other one
            _stop(other, kill=True)
        finally:
            if creator.is_alive():
                os.kill(creator.pid, signal.SIGKILL)  # type: ignore[arg-type]
            creator.join(TIMEOUT)
            if other is not None and other.poll() is None:
                _stop(other, kill=True)
        store = self.new_store()  # no age wait: the lock file tells that no one is left
        self.assertEqual(os.listdir(self.root), [os.path.basename(store.path)])

    @skip_unless_linux
    def test_live_participant_in_other_process(self) -> None:
        store = self.new_store()
        (receiver, sender), event = FORK.Pipe(duplex=False), FORK.Event()  # type: ignore[union-attr]
        proc = FORK.Process(target=_child_attach_and_wait, args=(store.path, sender, event))  # type: ignore[union-attr]
        proc.start()
        try:
            self.assertEqual(_recv(receiver), "attached")
            store.close()
            self.assertTrue(os.path.isdir(store.path))  # the child still participates
            self.assertEqual(SharedCacheStore.cleanup_leftovers(self.root), [])
        finally:
            event.set()
            proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 0)
        self.assertFalse(os.path.exists(store.path))  # the last participant removed it

    @skip_unless_linux
    def test_dead_participant_does_not_keep_store(self) -> None:
        store = self.new_store()
        receiver, sender = FORK.Pipe(duplex=False)  # type: ignore[union-attr]
        proc = FORK.Process(target=_child_attach_and_wait, args=(store.path, sender, None))  # type: ignore[union-attr]
        proc.start()
        try:
            self.assertEqual(_recv(receiver), "attached")
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(TIMEOUT)
        self.assertTrue(_participated(store.path))  # this process
        store.close()
        self.assertFalse(os.path.exists(store.path))

    @skip_unless_linux
    def test_forked_child_never_removes(self) -> None:
        store = SharedCacheStore(root=self.root)
        store.put(0, "k", 1)
        path = store.path
        for how in ("gc", "close"):
            pid = os.fork()
            if pid == 0:  # pragma: no cover (child)
                code = 1
                try:
                    if how == "close":
                        store.close()
                    del store  # the only reference: the inherited finalizer runs here
                    gc.collect()
                    code = 0
                finally:
                    os._exit(code)
            deadline = time.monotonic() + TIMEOUT
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    self.fail("forked child did not exit")
                time.sleep(0.01)
            self.assertEqual(os.waitstatus_to_exitcode(status), 0, f"{how}: the child failed")
            self.assertTrue(os.path.isdir(path), how)
            self.assertTrue(_participated(path), how)
        self.assertEqual(store.get(0, "k"), 1)
        store.close()
        self.assertFalse(os.path.exists(path))

    @skip_unless_linux
    def test_forked_child_does_not_keep_store(self) -> None:
        store = SharedCacheStore(root=self.root)
        path = store.path
        event = FORK.Event()  # type: ignore[union-attr]
        proc = FORK.Process(target=event.wait, args=(TIMEOUT,))  # type: ignore[union-attr]
        proc.start()  # inherits the store, and the descriptor of its lock
        try:
            store.close()
            self.assertFalse(os.path.exists(path))  # the child, still alive, does not participate
        finally:
            event.set()
            proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 0)

    @slow
    @unittest.skipIf(QUICKTEST, "starts a new interpreter")
    def test_other_interpreter_unpickles_and_exits_cleanly(self) -> None:
        store = self.new_store()
        store.put(0, "k", {"img": _meta_tensor()})
        script = textwrap.dedent("""
            import pickle, sys
            import torch
            from monai.data.cache_store import SharedCacheStore

            shared = pickle.loads(sys.stdin.buffer.read())  # as a DataLoader worker under spawn
            item = shared.get(0, "k")
            shared.put(1, "from_child", torch.arange(3))
            shared.close()
            own = SharedCacheStore(root=sys.argv[1])
            own.put(0, "x", torch.ones(2))
            print(float(item["img"].sum()), item["img"].affine[0, 0].item(), own.path, flush=True)
            """)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.dirname(monai.__file__)), env.get("PYTHONPATH", "")]
        )
        out = subprocess.run(
            [sys.executable, "-c", script, self.root],
            input=pickle.dumps(store),
            capture_output=True,
            timeout=120,
            env=env,
            check=True,
        )
        total, affine00, own_path = out.stdout.decode().split()
        self.assertEqual(float(total), float(_meta_tensor().sum()))
        self.assertEqual(float(affine00), 1.5)
        self.assertTrue(os.path.isdir(store.path))  # the non-participant left it alone
        self.assertTrue(torch.equal(store.get(1, "from_child"), torch.arange(3)))
        self.assertFalse(os.path.exists(own_path))  # its own store went away at exit


class TestPickleAndStats(_TempRootMixin):
    def test_pickle_attaches_without_participating(self) -> None:
        store = self.new_store(claim_timeout=12.5)
        store.put(0, "k", {"t": torch.arange(4)})
        copy = pickle.loads(pickle.dumps(store))
        self.assertIsInstance(copy, SharedCacheStore)
        self.assertEqual(copy.path, store.path)
        self.assertEqual(copy._claim_timeout, 12.5)
        self.assertTrue(torch.equal(copy.get(0, "k")["t"], torch.arange(4)))
        copy.close()
        self.assertTrue(os.path.isdir(store.path))

    def test_unpickle_after_removal_degrades(self) -> None:
        store = self.new_store()
        data = pickle.dumps(store)
        store.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copy = pickle.loads(data)
            self.assertIs(copy.get(0, "k"), MISS)
            self.assertFalse(copy.put(0, "k", 1))
            self.assertEqual(copy.get_or_compute(0, "k", lambda: 2), 2)
        self.assertEqual(len(_runtime_warnings(caught)), 1)

    @skip_unless_linux
    def test_counts_of_dead_processes_are_kept_in_a_fixed_file(self) -> None:
        """Processes killed without cleanup keep their counts; their slots are reused, so the file never grows."""
        patcher = mock.patch.object(cache_counters, "_SLOTS", 2)  # this process and one more: each child reuses it
        patcher.start()
        self.addCleanup(patcher.stop)
        store = self.new_store()
        store.put(0, "k", torch.zeros(10))
        self.assertEqual(store.get_or_compute(0, "k", lambda: -1).sum(), 0)
        counters = os.path.join(store.path, ".counters")
        size = os.path.getsize(counters)
        for i in range(5):
            self.assertEqual(_run(_child_count_and_die, store.path, i + 1), -signal.SIGKILL)
            store.invalidate(["c"], [])  # so that the next child computes it again
        self.assertEqual(os.path.getsize(counters), size)
        stats = store.stats()
        self.assertEqual({k: stats[k] for k in ("hits", "misses", "computed", "refused")},
                         {"hits": 1 + 15, "misses": 5, "computed": 5, "refused": 0})  # fmt: skip
        self.assertEqual(store.process_stats(), {"hits": 1, "misses": 0, "computed": 0, "refused": 0})

    @skip_unless_linux
    def test_stats_len_and_invalidate(self) -> None:
        store = self.new_store()
        self.assertEqual(len(store), 0)
        no_events = {"hits": 0, "misses": 0, "computed": 0, "refused": 0}
        self.assertEqual(store.stats(), {"filled": 0, "capacity": 0, "nbytes": 0, **no_events})
        store.resize(10)
        for i in range(3):
            store.put(i, f"k{i}", torch.zeros(100))
        expected_bytes = sum(os.path.getsize(os.path.join(store.path, n)) for n in _item_files(store.path))
        expected = {"filled": 3, "capacity": 10, "nbytes": expected_bytes, **no_events}
        self.assertEqual(store.stats(), expected)
        self.assertGreater(expected_bytes, 3 * 400)
        receiver, sender = FORK.Pipe(duplex=False)  # type: ignore[union-attr]
        self.assertEqual(_run(_child_stats, store.path, sender), 0)
        self.assertEqual(_recv(receiver), expected)
        other = SharedCacheStore(store.path, participate=False)
        self.assertEqual(len(other), 10)
        other.resize(4)
        self.assertEqual(len(store), 4)
        store.invalidate(["k0", "k1", "gone"], ["k1", "k5"])  # only k0: k1 is still needed, k2 is not ours
        self.assertEqual(_item_files(store.path), ["k1.item", "k2.item"])


class TestManyItems(_TempRootMixin):
    # file creation on a disk file system can take a millisecond: use a root in shared memory when there is one
    root_parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None

    @slow
    @skip_unless_linux
    @unittest.skipIf(QUICKTEST, "writes 20,000 items")
    def test_many_items_with_few_descriptors(self) -> None:
        store = self.new_store()
        self.assertEqual(_run(_child_many_items, store.path, 20_000, 2_000, timeout=300), 0)
        self.assertEqual(store.stats()["filled"], 20_000)


def _child_refuse(path: str) -> None:
    store = SharedCacheStore(path, participate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.get_or_compute(9, "child", lambda: np.ones(40_000)).sum() == 40_000  # refused, still returned


class TestBudget(_TempRootMixin):
    """The store leaves room for the DataLoader: a reserve of free space and an optional cap, shared by its users."""

    ITEM = 8 * 40_000  # bytes of the float64 arrays below, without the file's header

    def test_cap_refuses_past_max_bytes(self) -> None:
        store = self.new_store(max_bytes=3 * self.ITEM + 3 * 4096, reserve=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                item = store.get_or_compute(i, f"k{i}", lambda i=i: np.full(40_000, float(i)))
                np.testing.assert_array_equal(item, np.full(40_000, float(i)))  # stored or not, the right item
        self.assertEqual(len(_item_files(store.path)), 3)
        self.assertEqual(store.stats()["refused"], 3)
        budget = [w for w in _runtime_warnings(caught) if "not storing" in str(w.message)]
        self.assertEqual(len(budget), 1, [str(w.message) for w in caught])  # once per process
        self.assertIn("max_bytes", str(budget[0].message))
        for option in ("--shm-size", "--ipc=host", "MONAI_CACHE_ROOT"):
            self.assertIn(option, str(budget[0].message))
        # another process attached to the store keeps to the same budget, and its refusals count for all
        self.assertEqual(_run(_child_refuse, store.path), 0)
        self.assertEqual(store.stats()["refused"], 4)
        self.assertEqual(len(_item_files(store.path)), 3)

    def test_reserve(self) -> None:
        full = self.new_store(reserve=2**62)  # more than any file system has free: nothing is stored
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(full.put(0, "k", np.ones(10)))
        self.assertIn("reserve", str(_runtime_warnings(caught)[0].message))
        self.assertEqual((full.stats()["filled"], full.stats()["refused"]), (0, 1))
        empty = self.new_store(reserve=0)
        self.assertTrue(empty.put(0, "k", np.ones(10)))

    def test_a_new_store_at_a_freed_stores_address_still_warns(self) -> None:
        """Warnings are once per store and process: a store that reuses the id() of a freed one warns too."""
        seen: dict[int, int] = {}
        for attempt in range(50):
            store = SharedCacheStore(root=self.root, reserve=2**62)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertFalse(store.put(0, "k", np.ones(10)))
            self.assertEqual(len(_runtime_warnings(caught)), 1, f"attempt {attempt}")
            seen[id(store)] = seen.get(id(store), 0) + 1
            store.close()
            del store
            gc.collect()
            if max(seen.values()) >= 2:
                return
        self.skipTest("no store reused the address of a freed one in 50 attempts")

    def test_default_reserve(self) -> None:
        from monai.data.cache_budget import default_reserve

        self.assertEqual(default_reserve(64 * 2**20), 32 * 2**20)  # half of Docker's default /dev/shm
        self.assertEqual(default_reserve(256 * 2**30), 4 * 2**30)  # at most 4 GiB of a large one
        store = self.new_store()
        with mock.patch("os.statvfs") as statvfs:  # a 64 MiB file system with 40 MiB free
            statvfs.return_value = mock.Mock(f_bavail=40 * 256, f_blocks=64 * 256, f_frsize=4096)
            self.assertTrue(store.put(0, "fits", np.ones(2**20 // 8)))  # 40 - 1 MiB >= 32 MiB
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.assertFalse(store.put(1, "too-big", np.ones(9 * 2**20 // 8)))  # 40 - 9 MiB < 32 MiB

    def test_environment(self) -> None:
        sub = os.path.join(self.root, "elsewhere")
        os.mkdir(sub, 0o700)
        env = {"MONAI_CACHE_ROOT": sub, "MONAI_CACHE_MAX_BYTES": "0", "MONAI_CACHE_RESERVE_BYTES": "0"}
        with mock.patch.dict(os.environ, env):
            store = SharedCacheStore()
            self.stores.append(store)
        self.assertEqual(os.path.dirname(store.path), sub)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertFalse(store.put(0, "k", 1))  # the cap of 0 bytes from the environment
        with mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": os.path.join(self.root, "missing")}):
            with self.assertRaisesRegex(FileNotFoundError, "MONAI_CACHE_ROOT"):
                SharedCacheStore()
        with mock.patch.dict(os.environ, {"MONAI_CACHE_MAX_BYTES": "lots"}):
            with self.assertRaisesRegex(ValueError, "MONAI_CACHE_MAX_BYTES='lots'"):
                SharedCacheStore(root=self.root)

    @parameterized.expand([("negative", {"reserve": -1}), ("float", {"max_bytes": 1.5}), ("bool", {"max_bytes": True})])
    def test_bad_values(self, _: str, kwargs: dict) -> None:
        with self.assertRaisesRegex(ValueError, "non-negative number of bytes"):
            SharedCacheStore(root=self.root, **kwargs)
        self.assertEqual(os.listdir(self.root), [])  # nothing was created

    def test_budget_only_at_creation(self) -> None:
        store = self.new_store()
        with self.assertRaisesRegex(ValueError, "only used to create a new store"):
            SharedCacheStore(store.path, max_bytes=10)


if __name__ == "__main__":
    unittest.main()
