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
The extended tests of PR 02's ``SharedCacheStore`` core, which do not fit the exported
``tests/data/test_cache_store.py``: every dtype and container of the round trip, the zero-copy mappings, the lifetime
across processes and interpreters, 20,000 items with few descriptors, and (with PR 02's wiring) the store as the
runtime cache of datasets, DataLoader workers and gloo ranks.
"""

from __future__ import annotations

import collections
import errno
import functools
import gc
import hashlib
import io
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
import unittest
import warnings
from collections import Counter
from typing import Any, Callable
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from fork_utils import (
    ENV,
    FORK,
    TIMEOUT,
    CountedLoad,
    Evil,
    Load,
    RandAdd,
    Scale,
    end,
    executions,
    item_files,
    mapped_files,
    participated,
    recv,
    run_forked,
    run_ranks,
    skip_if_quick,
    skip_unless_fork,
    skip_unless_linux,
    skip_unless_store,
)
from parameterized import parameterized

from monai.data import CacheDataset, DataLoader, MetaTensor, PydicomReader, SharedCacheStore
from monai.data.utils import pickle_hashing, set_rnd
from monai.transforms import Compose, LoadImage, Transform
from monai.utils import optional_import
from monai_sharedcache import _format as fmt
from monai_sharedcache import _locks as locks
from monai_sharedcache import store as cache_store

get_testdata_file, has_pydicom = optional_import("pydicom.data", name="get_testdata_file")
UID, _ = optional_import("pydicom.uid", name="UID")

# -- items ------------------------------------------------------------------------------------------------------------


def _assert_same(tc: unittest.TestCase, a: Any, b: Any, where: str = "item") -> None:
    """
    Recursive equality of ``a``, what was stored, and ``b``, what came back, that also checks the types, dtypes, shapes
    and MetaTensor metadata, and that no tensor of ``b`` requires grad (the store keeps tensors detached).
    """
    tc.assertIs(type(a), type(b), where)
    if isinstance(a, torch.Tensor):
        tc.assertFalse(b.requires_grad, f"{where}: a tensor out of the store must be detached")
        tc.assertIsNone(b.grad_fn, where)
        tc.assertEqual((a.dtype, a.shape, a.device), (b.dtype, b.shape, b.device), where)
        x, y = torch.Tensor.as_subclass(a, torch.Tensor), torch.Tensor.as_subclass(b, torch.Tensor)
        if "float8" in str(a.dtype):  # no comparison kernels: compare the bytes
            x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        tc.assertTrue(torch.equal(x.detach().resolve_conj(), y.resolve_conj()), where)
        if isinstance(a, MetaTensor):
            _assert_same(tc, a.meta, b.meta, where + ".meta")
            _assert_same(tc, a.applied_operations, b.applied_operations, where + ".applied_operations")
            tc.assertEqual(a.is_batch, b.is_batch, where + ".is_batch")
    elif isinstance(a, np.ndarray):
        tc.assertEqual((a.dtype, a.shape), (b.dtype, b.shape), where)
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
    elif isinstance(a, float) and a != a:  # NaN, as a DICOM image's original_channel_dim
        tc.assertNotEqual(b, b, where)
    else:
        tc.assertEqual(a, b, where)


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


class StoreCase(unittest.TestCase):
    """A private temporary root for the stores of a test, removed afterwards with everything in it."""

    root_parent: str | None = None

    def setUp(self) -> None:
        self.root = tempfile.mkdtemp(prefix="test-store-extended-", dir=self.root_parent)
        self.addCleanup(shutil.rmtree, self.root, True)

    def new_store(self, path: str | None = None) -> SharedCacheStore:
        store = SharedCacheStore(path) if path else SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        return store


@skip_unless_store
class TestRoundTrip(StoreCase):
    @parameterized.expand(ROUND_TRIP_CASES + TORCH_CASES + NUMPY_CASES)
    def test_round_trip(self, name: str, make: Callable[[], Any]) -> None:
        store = self.new_store()
        if name == "ndarray_object":  # its elements are pickles of any type: only without the allow-list
            with self.assertWarnsRegex(RuntimeWarning, "_reconstruct is not among the types allowed"):
                self.assertFalse(store.put("key", make()))
            store = SharedCacheStore(store.path, weights_only=False)
            self.addCleanup(store.close)
        self.assertTrue(store.put("key", make()))
        out = store.get("key")
        _assert_same(self, make(), out)
        if isinstance(out, (torch.Tensor, np.ndarray, list, dict)):
            self.assertIsNot(store.get("key"), out)  # a fresh object graph every time

    def test_metatensor_details(self) -> None:
        store = self.new_store()
        mt = _meta_tensor()
        store.put("k", {"img": mt})
        out = store.get("k")["img"]
        self.assertIsInstance(out, MetaTensor)
        self.assertIs(type(out.affine), torch.Tensor)
        self.assertEqual(out.affine.dtype, torch.float64)
        self.assertTrue(torch.equal(out.affine, mt.affine))
        self.assertEqual(out.applied_operations[0]["extra_info"], {"axes": [0]})
        self.assertEqual(set(out.__dict__), set(mt.__dict__))
        out.meta["new"] = 1  # private metadata
        self.assertNotIn("new", store.get("k")["img"].meta)

    def test_requires_grad_is_detached(self) -> None:
        store = self.new_store()
        leaf = torch.ones(3, requires_grad=True)
        store.put("k", {"non_leaf": leaf * 2, "leaf": leaf})
        out = store.get("k")
        for name, value in (("non_leaf", [2.0] * 3), ("leaf", [1.0] * 3)):
            self.assertFalse(out[name].requires_grad, name)
            self.assertIsNone(out[name].grad_fn, name)
            self.assertEqual(out[name].tolist(), value)

    def test_same_object_twice_stays_shared(self) -> None:
        store = self.new_store()
        t = torch.arange(3)
        store.put("k", [t, t, {"again": t}])
        a, b, c = store.get("k")
        self.assertIs(a, b)
        self.assertIs(a, c["again"])

    @parameterized.expand(
        [("safe", "0123abcdEF_-x", "0123abcdEF_-x"), ("unsafe", "a/b c.nii", None), ("long", "k" * 129, None)]
    )
    def test_key_file_names(self, _: str, key: str, stem: str | None) -> None:
        store = self.new_store()
        store.put(key, [key])
        stem = stem or hashlib.sha256(key.encode()).hexdigest()
        self.assertEqual(item_files(store.path), [stem + ".item"])
        self.assertEqual(store.get(key), [key])
        self.assertIsNone(store.get(key + "x"))

    def test_unpicklable_item_is_refused_with_what_pickling_raises(self) -> None:
        store = self.new_store()
        item = {"f": lambda x: x}
        with self.assertRaises(Exception) as pickling:
            pickle.dumps(item, protocol=5)
        with self.assertWarnsRegex(RuntimeWarning, f"cannot store some items \\({type(pickling.exception).__name__}: "):
            self.assertFalse(store.put("k", item))  # what pickling raises, in the warning: not some other error
        self.assertEqual((item_files(store.path), os.listdir(os.path.join(store.path, ".tmp"))), ([], []))

    def test_discard_removes_those_items_only(self) -> None:
        store = self.new_store()
        for key in ("k0", "k1", "k2"):
            store.put(key, key)
        store.discard(["k0", "missing"])  # other datasets may keep items here; a missing key is no error
        self.assertEqual(item_files(store.path), ["k1.item", "k2.item"])
        self.assertEqual([store.get(k) for k in ("k0", "k1", "k2")], [None, "k1", "k2"])

    @parameterized.expand(
        [
            ("empty", lambda data: b""),
            ("bad_magic", lambda data: b"X" + data[1:]),
            ("bad_pickle", lambda data: data[:-40] + b"\x00" * 40),
        ]
    )
    def test_malformed_file_is_removed_when_read(self, _: str, damage: Callable[[bytes], bytes]) -> None:
        store = self.new_store()
        store.put("k", {"x": "y" * 100})
        path = os.path.join(store.path, "k.item")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(damage(data))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a damaged file is a miss, not a fault
            self.assertEqual(store.get("k", "miss"), "miss")
        self.assertFalse(os.path.exists(path))

    def test_unreadable_item_is_a_miss(self) -> None:
        store = self.new_store()
        store.put("k", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mock.patch.object(os, "open", side_effect=PermissionError(errno.EACCES, "Permission denied")):
                self.assertEqual((store.get("k", "miss"), store.get("k", "miss")), ("miss", "miss"))
        self.assertEqual([str(w.message).count("Permission denied") for w in caught], [1])  # one warning
        self.assertEqual(store.get("k"), 1)  # kept, and read again once readable

    @parameterized.expand([("group_rwx", 0o770), ("world_writable", 0o777)])
    def test_refuses_shared_mode(self, _: str, mode: int) -> None:
        path = os.path.join(self.root, "d")
        os.mkdir(path)
        os.chmod(path, mode)
        with self.assertRaisesRegex(PermissionError, "mode.*unpickled"):
            SharedCacheStore(path)

    def test_default_root(self) -> None:
        with mock.patch.dict(os.environ):
            os.environ.pop("MONAI_CACHE_ROOT", None)
            store = SharedCacheStore()
        try:
            if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
                self.assertEqual(os.path.dirname(store.path), "/dev/shm")
            else:
                self.assertEqual(os.path.dirname(store.path), tempfile.gettempdir())
            self.assertTrue(store.put("k", torch.ones(2)))
            self.assertTrue(torch.equal(store.get("k"), torch.ones(2)))
        finally:
            store.close()
        self.assertFalse(os.path.exists(store.path))


@skip_unless_store
class TestSettings(StoreCase):
    """A root, a path or an environment that cannot serve: a clear error that names it, or one warning and no cache."""

    def unusable(self) -> list[tuple[str, type]]:
        with open(os.path.join(self.root, "afile"), "w"):
            pass
        missing, afile = os.path.join(self.root, "missing"), os.path.join(self.root, "afile")
        return [(missing, FileNotFoundError), (afile, NotADirectoryError), ("/proc", FileNotFoundError)]

    def test_root_that_cannot_hold_a_store(self) -> None:
        for root, error in self.unusable():
            with self.assertRaisesRegex(error, f"root='{root}' cannot hold a store.*must be an existing directory"):
                SharedCacheStore(root=root)
            with mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": root}), warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                store = SharedCacheStore()
                self.assertEqual(
                    (store.get_or_compute("k", lambda: 3), store.put("k", 1), store.get("k")), (3, False, None)
                )
            self.assertEqual(len(w), 1)  # one warning, naming the setting and what it must be
            self.assertRegex(str(w[0].message), f"MONAI_CACHE_ROOT='{root}'.*must be an existing directory")
        self.assertEqual(os.listdir(self.root), ["afile"])

    def test_path_that_is_a_file(self) -> None:
        afile = self.unusable()[1][0]
        with self.assertRaisesRegex(NotADirectoryError, f"'{afile}' is a file, not a store"):
            SharedCacheStore(afile)

    def test_home_and_bytes(self) -> None:
        with mock.patch.dict(os.environ, {"HOME": self.root}):
            store = SharedCacheStore(root="~")
            self.addCleanup(store.close)
            self.assertEqual(os.path.dirname(store.path), self.root)
            joined = SharedCacheStore(os.path.join("~", os.path.basename(store.path)))
            self.addCleanup(joined.close)
            self.assertEqual(joined.path, store.path)
            with mock.patch.dict(os.environ, {"MONAI_CACHE_ROOT": "~"}):
                self.assertEqual(os.path.dirname(self.new_store().path), self.root)
        self.assertEqual(self.new_store(os.fsencode(store.path)).path, store.path)
        self.assertEqual(os.path.dirname(SharedCacheStore(root=os.fsencode(self.root)).path), self.root)
        self.assertFalse(os.path.exists(os.path.join(os.getcwd(), "~")))

    def test_new_directory_replaced(self) -> None:
        """Made in a root that others can write, and replaced before it was checked: the message says so."""
        shared = os.path.join(self.root, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        with mock.patch.object(tempfile, "mkdtemp", return_value=shared):
            with self.assertRaisesRegex(PermissionError, f"of mode 0o777.*made in root='{self.root}': use a directory"):
                SharedCacheStore(root=self.root)
        self.assertTrue(os.path.isdir(shared))

    @skip_unless_fork
    def test_warning_after_a_fork(self) -> None:
        """A thread in the middle of a warning when another forks: the child still warns (no lock left held)."""
        store, inside, release = self.new_store(), threading.Event(), threading.Event()
        parent = os.getpid()

        class Blocking(dict):
            def _block(self) -> None:
                if os.getpid() == parent and threading.current_thread() is not threading.main_thread():
                    inside.set()
                    release.wait(TIMEOUT)

            def setdefault(self, *args: Any) -> Any:
                self._block()
                return super().setdefault(*args)

            def __contains__(self, key: Any) -> bool:
                self._block()
                return super().__contains__(key)

        store._warned = Blocking()
        thread = threading.Thread(target=store.put, args=("k", threading.Lock()))  # unpicklable: it warns
        thread.start()
        try:
            self.assertTrue(inside.wait(TIMEOUT))
            self.assertEqual(run_forked(_warn_quietly, store, timeout=30), 0)  # would wait for the thread's lock
        finally:
            release.set()
            thread.join(TIMEOUT)


class Point:
    """A type of the user's: not read from a store unless allowed."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __repr__(self) -> str:
        return f"Point({self.x})"


class Label:
    """Another type of the user's."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Label({self.name!r})"


class MakePoints(Transform):
    """Items that hold types of the user's; each input computed is logged, as ``Load`` logs it."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, i: int) -> dict:
        return {**Load(self.log)(i), "p": Point(i), "tag": Label(f"t{i}")}


def _log_warnings(path: str, worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``: its warnings go to the file ``path``, which the test reads."""

    def show(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{category.__name__}: {message}\n".encode())
        finally:
            os.close(fd)

    warnings.showwarning = show


@skip_unless_store
class TestAllowList(StoreCase):
    """Items are read with an allow-list of types, as PersistentDataset's weights_only=True: reading runs no code."""

    def test_a_planted_item_runs_nothing(self) -> None:
        store, canary = self.new_store(), os.path.join(self.root, "pwned")
        trusting = SharedCacheStore(store.path, weights_only=False)
        self.addCleanup(trusting.close)
        self.assertTrue(trusting.put("k", {"img": torch.ones(2), "x": Evil(canary)}))  # written as someone could
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual((store.get("k"), store.get("k")), (None, None))
            self.assertEqual(store.get_or_compute("k", lambda: 3), 3)  # computed anew, and stored in its place
        self.assertFalse(os.path.exists(canary))
        messages = [str(w.message) for w in caught]
        self.assertEqual(len(messages), 1, messages)
        self.assertRegex(messages[0], r"\.open is not among the types allowed.*add_safe_globals")
        self.assertEqual(store.get("k"), 3)

    def test_types_of_the_user(self) -> None:
        store = self.new_store()
        with self.assertWarnsRegex(RuntimeWarning, f"{__name__}.Point is not among.*computed without being stored"):
            self.assertFalse(store.put("p", Point(1)))
        self.assertEqual(item_files(store.path), [])
        with torch.serialization.safe_globals([Point]):
            self.assertTrue(store.put("p", [Point(2)]))
            self.assertEqual(store.get("p")[0].x, 2)
        trusting = SharedCacheStore(store.path, weights_only=False)
        self.addCleanup(trusting.close)
        copy = pickle.loads(pickle.dumps(trusting))  # a DataLoader worker's copy trusts as its parent
        self.addCleanup(copy.close)
        self.assertTrue(trusting.put("q", Point(3)))
        self.assertEqual((copy.get("q").x, trusting.get("p")[0].x), (3, 2))
        self.assertIsNone(pickle.loads(pickle.dumps(store)).get("q"))

    @parameterized.expand(["array", "scalar", "sparse", "import"])
    def test_crafted_streams_are_refused(self, kind: str) -> None:
        """
        Forged numpy dtypes (whose object fields would read file bytes as pointers), unchecked sparse indices and a
        module's ``__getattr__`` (which imports) are out of reach: each stream is refused in a child, which never
        crashes nor imports what it names.
        """
        self.assertEqual(run_forked(_load_crafted, kind), 0)

    def test_the_allowed_types_go_with_the_store(self) -> None:
        """A store pickled to another process allows there what was allowed where it was made; still no more."""
        canary = os.path.join(self.root, "pwned")
        with torch.serialization.safe_globals([Point, RandAdd]):
            store = self.new_store()
        set_rnd(store, 0)  # as MONAI's DataLoader seeds a dataset: an allowed class is no attribute to seed
        copy = pickle.loads(pickle.dumps(store))  # as a spawned DataLoader worker receives it
        self.addCleanup(copy.close)
        self.assertTrue(copy.put("p", Point(1)))
        self.assertEqual((store.get("p").x, copy.get("p").x), (1, 1))
        trusting = SharedCacheStore(store.path, weights_only=False)
        self.addCleanup(trusting.close)
        self.assertTrue(trusting.put("k", [Point(2), Evil(canary)]))  # planted
        with self.assertWarnsRegex(RuntimeWarning, r"refused items.*\.open is not among the types allowed"):
            self.assertIsNone(copy.get("k"))
        self.assertFalse(os.path.exists(canary))

    @parameterized.expand(
        [(m,) for m in ("spawn", "forkserver", "fork") if m in multiprocessing.get_all_start_methods()]
    )
    def test_types_allowed_in_the_parent_hold_in_its_workers(self, method: str) -> None:
        """
        Issue 56: a type allowed in the parent alone (as in a script's ``main()``, which spawned DataLoader workers do
        not run) was refused in the workers, every item and every epoch. The store carries the types allowed where it
        is made and those allowed by the time it is pickled to a worker; an entry that pickle cannot store, or that a
        worker cannot import, is left out, and nothing fails. The parent computes and stores half of the items, and
        the workers read those and compute and store the others: each input is computed once, and nothing is refused.
        """
        prior = torch.serialization.get_safe_globals()
        self.addCleanup(lambda: (torch.serialization.clear_safe_globals(), torch.serialization.add_safe_globals(prior)))
        only_here = types.ModuleType(f"{__name__}_only_here")  # importable in this process alone
        only_here.Gone = type("Gone", (), {"__module__": only_here.__name__})  # type: ignore[attr-defined]
        sys.modules[only_here.__name__] = only_here
        self.addCleanup(sys.modules.pop, only_here.__name__, None)

        class Local:  # pickle cannot store it
            pass

        with torch.serialization.safe_globals([Point, Local, only_here.Gone]):  # type: ignore[attr-defined]
            store = self.new_store()  # allowed where it is made, and no longer in torch's list
        torch.serialization.add_safe_globals([Label])  # allowed after, before the workers start
        log, seen = os.path.join(self.root, "log"), os.path.join(self.root, "warnings")
        ds = CacheDataset(list(range(6)), MakePoints(log), runtime_cache=store, progress=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual([ds[i]["p"].x for i in range(3)], [0, 1, 2])  # computed and stored here
            init = functools.partial(_log_warnings, seen)
            loader = DataLoader(
                ds, batch_size=2, num_workers=2, multiprocessing_context=method, timeout=TIMEOUT, collate_fn=list,
                worker_init_fn=init,
            )  # fmt: skip
            got = [(d["src"], d["p"].x, d["tag"].name) for batch in loader for d in batch]
            self.assertEqual([ds[i]["tag"].name for i in range(3, 6)], ["t3", "t4", "t5"])  # stored by the workers
        self.assertEqual(sorted(got), [(i, i, f"t{i}") for i in range(6)])
        self.assertEqual(executions(log), Counter(range(6)))  # once each: nothing refused, in a worker or here
        self.assertEqual(len(item_files(store.path)), 6)
        self.assertEqual([str(w.message) for w in caught if "SharedCacheStore" in str(w.message)], [])
        with open(seen, "a+") as f:  # made if no worker warned
            f.seek(0)
            self.assertNotIn("SharedCacheStore", f.read())

    def test_each_refused_type_is_named_once(self) -> None:
        """
        Issue 56: only the first type refused was named (one warning per store and process); the later ones were
        silent. Each refused type is named in one warning, when stored and when read; a tensor off the CPU (here on
        the ``meta`` device, as on a GPU) is one too. Other faults, such as unpicklable items, still warn once.
        """
        store = self.new_store()
        trusting = SharedCacheStore(store.path, weights_only=False)
        self.addCleanup(trusting.close)
        unstorable = [
            Point(1), types.SimpleNamespace(a=1), torch.zeros(2, device="meta"), threading.Lock(), (x for x in ()),
        ]  # fmt: skip
        self.assertTrue(trusting.put("p", Point(2)) and trusting.put("ns", types.SimpleNamespace(b=2)))  # planted
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                self.assertEqual([store.put(str(n), [item]) for n, item in enumerate(unstorable)], [False] * 5)
                self.assertEqual((store.get("p"), store.get("ns")), (None, None))
        expected = [
            rf"cannot store some items .*{__name__}\.Point is not among the types allowed",
            r"cannot store some items .*types\.SimpleNamespace is not among the types allowed",
            r"cannot store some items .*CPU tensors only, got one on meta.*keep the cached transforms on the CPU",
            r"cannot store some items .*cannot pickle '_thread.lock' object",
            rf"refused items of a type not allowed .*{__name__}\.Point is not among",
            r"refused items of a type not allowed .*types\.SimpleNamespace is not among",
        ]
        messages = [str(w.message) for w in caught]
        self.assertEqual(len(messages), len(expected), messages)
        for message, pattern in zip(messages, expected):
            self.assertRegex(message, pattern)

    @unittest.skipUnless(has_pydicom, "pydicom is not installed")
    def test_dicom_meta_with_pydicom_uids(self) -> None:
        """
        Issue 56: the meta of MONAI's DICOM reader with ``prune_metadata=False`` holds pydicom's ``UID`` (a ``str``);
        it is stored and read back as it was, with no setting.
        """
        img = LoadImage(reader=PydicomReader(prune_metadata=False), image_only=True)(get_testdata_file("CT_small.dcm"))
        uids = sorted(k for k, v in img.meta.items() if isinstance(v, dict) and isinstance(v.get("Value", [0])[0], UID))
        self.assertEqual(len(uids), 6)  # such as 0020000D, the study's
        store = self.new_store()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            self.assertTrue(store.put("ct", {"img": img}))
            out = store.get("ct")["img"]
        _assert_same(self, img, out)  # types included
        self.assertEqual({type(out.meta[k]["Value"][0]) for k in uids}, {UID})

    def test_what_monai_items_hold(self) -> None:
        store = self.new_store()
        meta = MetaTensor(torch.ones(2, 3), affine=torch.eye(4), meta={"filename_or_obj": "a.nii", "dim": np.int64(3)})
        item = {
            "img": meta,
            "label": np.zeros((2, 2), dtype=np.uint8),
            "misc": [1 + 2j, slice(1, 2), range(3), {1, 2}, frozenset([3]), bytearray(b"x"), torch.Size([2])],
            "dtypes": (np.dtype("f4"), torch.float16, np.float64(2.0), torch.device("cpu")),
            "ordered": collections.OrderedDict(a=1),
        }
        self.assertTrue(store.put("k", item))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _assert_same(self, item, store.get("k"))


class _Forged:
    def __init__(self, *reduce: Any) -> None:
        self.reduce = reduce

    def __reduce__(self) -> tuple:
        return self.reduce


def _load_crafted(kind: str) -> None:
    """Exit 0 if the crafted stream ``kind`` is refused without importing anything; a crash fails the test."""
    state = (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0)  # an object field, flags 0: no pointers, says
    forged = _Forged(np.dtype, ("V8", False, True), state)
    multiarray = np.core.multiarray if hasattr(np, "core") else np._core.multiarray
    streams = {
        "array": _Forged(multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), forged, False, b"A" * 8)),
        "scalar": _Forged(multiarray.scalar, (forged, b"A" * 8)),
        "sparse": torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1), (2,)),  # its indices go unchecked
        "import": None,
    }
    stream = io.BytesIO()
    fmt._Pickler(stream, protocol=5).dump(streams[kind])  # as the store writes (its tensors' bytes in band here)
    raw = stream.getvalue() if kind != "import" else b"\x80\x04ctorch\n_inductor\n."
    before = set(sys.modules)
    try:
        item = fmt.loads(raw, [], True)
        item["a"][0] if kind in ("array", "scalar") else item.to_dense()  # a crash, were it loaded
        os._exit(1)
    except pickle.UnpicklingError:
        os._exit(0 if set(sys.modules) == before else 2)


def _warn_quietly(store: SharedCacheStore) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.put("k2", threading.Lock())


@skip_unless_store
class TestZeroCopy(StoreCase):
    def test_small_items_are_private(self) -> None:
        store = self.new_store()
        store.put("k", {"t": torch.zeros(4), "a": np.zeros(4)})
        first, second = store.get("k"), store.get("k")
        first["t"][0], first["a"][0] = 5, 5
        self.assertEqual(second["t"].tolist(), [0.0] * 4)
        self.assertEqual(store.get("k")["a"].tolist(), [0.0] * 4)

    @skip_unless_linux
    def test_large_items_are_views_of_a_private_mapping(self) -> None:
        store = self.new_store()
        store.put("k", {"t": torch.arange(100_000, dtype=torch.float32), "a": np.arange(50_000.0)})
        path = os.path.join(store.path, "k.item")
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        first, second = store.get("k"), store.get("k")
        # the data lives in a mapping of the item file, not in a copy
        self.assertEqual(mapped_files(first["t"].data_ptr()), [path])
        self.assertEqual(mapped_files(first["a"].ctypes.data), [path])
        self.assertNotEqual(first["t"].data_ptr(), second["t"].data_ptr())
        self.assertTrue(first["a"].flags.writeable and first["a"].flags.aligned)
        self.assertEqual(first["t"].data_ptr() % 64, 0)
        first["t"] += 1  # copy-on-write: private to this reader
        first["a"][:] = -1
        self.assertEqual(second["t"][:3].tolist(), [0.0, 1.0, 2.0])
        self.assertEqual(second["a"][:3].tolist(), [0.0, 1.0, 2.0])
        with open(path, "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), digest)
        third = store.get("k")
        self.assertTrue(torch.equal(third["t"], torch.arange(100_000, dtype=torch.float32)))

    @skip_unless_linux
    def test_mapping_outlives_item_and_file(self) -> None:
        store = self.new_store()
        store.put("k", torch.arange(100_000))
        t = store.get("k")
        path = os.path.join(store.path, "k.item")
        self.assertEqual(mapped_files(t.data_ptr()), [path])
        store.discard(["k"])  # the file is gone; the private mapping stays valid
        gc.collect()
        self.assertFalse(os.path.exists(path))
        self.assertEqual((int(t[-1]), int(t.sum())), (99_999, 99_999 * 100_000 // 2))
        address = t.data_ptr()
        del t
        gc.collect()
        self.assertEqual(mapped_files(address), [])  # unmapped with its last view
        self.assertIsNone(store.get("k"))


# -- lifetime ---------------------------------------------------------------------------------------------------------


def _child_attach_and_wait(path: str, conn: Any, event: Any) -> None:
    store = SharedCacheStore(path)
    conn.send("attached")  # a pipe, not a queue: a queue's lock may die with a killed child
    if event is None:
        event = threading.Event()  # never set: to be killed
    if event.wait(TIMEOUT):
        store.close()


def _child_many_items(path: str, n: int, n_mapped: int) -> None:
    import resource

    torch.set_num_threads(1)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    store = pickle.loads(pickle.dumps(SharedCacheStore(path)))  # as a DataLoader worker has it
    for i in range(n):
        if not store.put(f"key{i}", {"i": i, "t": torch.tensor([i, i + 1])}):
            raise AssertionError(f"put {i} failed")
    items = [store.get(f"key{i}") for i in range(n)]  # all alive at once
    if any(item is None or item["i"] != i or item["t"].tolist() != [i, i + 1] for i, item in enumerate(items)):
        raise AssertionError("wrong items")
    fmt._SMALL_FILE = 0  # map every file: the mappings must not hold a descriptor each
    mapped = [store.get(f"key{i}") for i in range(n_mapped)]
    if any(item is None or item["t"].tolist() != [i, i + 1] for i, item in enumerate(mapped)):
        raise AssertionError("wrong mapped items")
    n_fds = len(os.listdir("/proc/self/fd"))
    if n_fds > 100:
        raise AssertionError(f"{n_fds} open descriptors for {n_mapped} mapped items")


_OTHER_INTERPRETER = """
import pickle, sys
import torch
from monai.data import SharedCacheStore

shared = pickle.loads(sys.stdin.buffer.read())  # as a DataLoader worker under spawn
item = shared.get("k")
shared.put("from_child", torch.arange(3))
shared.close()
own = SharedCacheStore(root=sys.argv[1])
own.put("x", torch.ones(2))
print(float(item["img"].sum()), item["img"].affine[0, 0].item(), own.path, flush=True)
"""


_UNTIL_A_STORE = """
import json
import sys
import numpy as np
import monai
from monai.data import CacheDataset
from monai_sharedcache import _locks as _cache_locks
from monai.transforms import Compose, Lambda


def hooks():
    pool = sys.modules.get("monai_sharedcache._pool")  # the fork's layer: not even imported before a store is made
    fast = [pool is not None and "ENABLED" in vars(pool), pool is not None and pool._LIBC_LOADED]
    counts = sys.modules.get("monai_sharedcache.counters")  # registers its hook when imported, at the first store
    return [bool(_cache_locks._HOOKED), counts is not None, *fast]


ds = CacheDataset([np.zeros(2)] * 4, Compose([Lambda(lambda x: x + 1)]), progress=False)
eager = [float(ds[i][0]) for i in range(4)], hooks()
from monai.data import SharedCacheStore
store = SharedCacheStore()
ds = CacheDataset([np.zeros(2**21)] * 2, Compose([Lambda(lambda x: x + 1)]), runtime_cache=store, progress=False)
used = [float(ds[i][0]) for i in range(2)] + [float(ds[i][0]) for i in range(2)], hooks()
store.close()
print(json.dumps([eager, used]))
"""


@skip_unless_store
class TestNothingUntilAStore(unittest.TestCase):
    def test_import_and_the_eager_path_register_no_hook_and_load_no_libc(self):
        """``import monai`` and ``runtime_cache=False`` register no at-fork hook and load no libc; a store does."""
        out = subprocess.run([sys.executable, "-c", _UNTIL_A_STORE], capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        (eager, eager_hooks), (used, used_hooks) = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual((eager, eager_hooks), ([1.0] * 4, [False] * 4))
        self.assertEqual(used, [1.0] * 4)
        self.assertEqual(used_hooks[:2], [True, True])  # the locks and counts of a store: closed in forked children
        if sys.platform.startswith("linux"):
            self.assertEqual(used_hooks[2:], [True, True])  # a large item's read decided on the fast path


@skip_unless_store
class TestLifetime(StoreCase):
    def test_non_participant_neither_keeps_nor_removes(self) -> None:
        first = self.new_store()
        second = self.new_store(first.path)
        copy = pickle.loads(pickle.dumps(first))  # what a DataLoader worker gets
        copy.close()
        del copy
        gc.collect()
        self.assertTrue(os.path.isdir(first.path))  # a copy does not remove
        first.close()
        self.assertTrue(os.path.isdir(first.path))  # the second participant keeps it
        copy = pickle.loads(pickle.dumps(second))
        self.assertTrue(copy.put("k", 1))
        second.close()  # the last participant: the live copy does not keep it
        self.assertFalse(os.path.exists(first.path))
        self.assertIsNone(copy.get("k"))

    def test_last_user_removes_all_it_holds_and_follows_no_link(self) -> None:
        """Everything in the store's directory goes with it (files and private directories of any name, those of the
        layer too), through its descriptor: a link is removed, never followed; a directory open to others stays."""
        outside = os.path.join(self.root, "outside")
        os.mkdir(outside, 0o700)
        with open(os.path.join(outside, "keep"), "w") as f:
            f.write("mine")
        store = self.new_store()
        store.put("k", torch.ones(3))
        os.mkdir(os.path.join(store.path, ".extra"), 0o700)
        os.mkdir(os.path.join(store.path, ".extra", "deeper"), 0o700)
        with open(os.path.join(store.path, ".extra", "deeper", "f"), "w") as f:
            f.write("x")
        os.symlink(outside, os.path.join(store.path, ".link"))
        os.symlink(os.path.join(outside, "keep"), os.path.join(store.path, "keep.item"))
        open_dir = os.path.join(store.path, ".open")
        os.mkdir(open_dir)
        os.chmod(open_dir, 0o777)  # not a directory of the store's own: neither listed nor removed
        with open(os.path.join(open_dir, "theirs"), "w") as f:
            f.write("y")
        store.close()
        self.assertEqual(os.listdir(outside), ["keep"])
        # the store's directory stays for what is left, with its mark: the next cleaner knows it as a store's
        self.assertEqual(sorted(os.listdir(store.path)), [".monai-cache", ".open"])
        self.assertEqual(os.listdir(open_dir), ["theirs"])
        os.chmod(open_dir, 0o700)
        os.remove(os.path.join(open_dir, "theirs"))
        os.rmdir(open_dir)
        os.remove(os.path.join(store.path, ".monai-cache"))
        os.rmdir(store.path)

    @skip_unless_fork
    def test_forked_child_does_not_keep_store(self) -> None:
        store = self.new_store()
        event = FORK.Event()  # type: ignore[union-attr]
        proc = FORK.Process(target=event.wait, args=(TIMEOUT,))  # type: ignore[union-attr]
        proc.start()  # inherits the store, and the descriptor of its lock
        self.addCleanup(end, proc)
        store.close()
        self.assertFalse(os.path.exists(store.path))  # the child, still alive, does not participate
        event.set()
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 0)

    def test_live_participant_in_other_process_keeps_store(self) -> None:
        store = self.new_store()
        ctx = multiprocessing.get_context()  # the default start method: fork, or spawn in the spawn mode
        (receiver, sender), event = ctx.Pipe(duplex=False), ctx.Event()
        proc = ctx.Process(target=_child_attach_and_wait, args=(store.path, sender, event))
        proc.start()
        self.addCleanup(end, proc)
        self.assertEqual(recv(receiver), "attached")
        store.close()
        self.assertTrue(os.path.isdir(store.path))  # the child still participates
        self.assertTrue(participated(store.path))
        event.set()
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, 0)
        self.assertFalse(os.path.exists(store.path))  # the last participant removed it

    def test_killed_participant_does_not_keep_store(self) -> None:
        store = self.new_store()
        ctx = multiprocessing.get_context()
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_attach_and_wait, args=(store.path, sender, None))
        proc.start()
        self.addCleanup(end, proc)
        self.assertEqual(recv(receiver), "attached")
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(TIMEOUT)
        self.assertEqual(proc.exitcode, -signal.SIGKILL)
        self.assertTrue(participated(store.path))  # this process
        store.close()
        self.assertFalse(os.path.exists(store.path))

    @skip_if_quick
    def test_other_interpreter_unpickles_and_exits_cleanly(self) -> None:
        store = self.new_store()
        store.put("k", {"img": _meta_tensor()})
        out = subprocess.run(
            [sys.executable, "-c", _OTHER_INTERPRETER, self.root],
            input=pickle.dumps(store),
            capture_output=True,
            timeout=TIMEOUT,
            env=ENV,
        )
        self.assertEqual(out.returncode, 0, out.stderr.decode()[-3000:])
        self.assertNotIn(b"Warning", out.stderr)  # and no warning at exit
        total, affine00, own_path = out.stdout.decode().split()
        self.assertEqual((float(total), float(affine00)), (float(_meta_tensor().sum()), 1.5))
        self.assertTrue(os.path.isdir(store.path))  # the non-participant left it alone
        self.assertTrue(torch.equal(store.get("from_child"), torch.arange(3)))
        self.assertTrue(own_path.startswith(self.root))
        self.assertFalse(os.path.exists(own_path))  # its own store went away at exit


def _join_refused(path: str, pickled: bytes) -> None:
    """In a child: joining, and unpickling, a store closed to nobody are refused without opening anything in it."""
    for join in (lambda: SharedCacheStore(path), lambda: pickle.loads(pickled)):
        try:
            join()
        except PermissionError:
            continue
        os._exit(1)
    os._exit(0)


@skip_unless_store
@skip_unless_fork
class TestResources(StoreCase):
    """A store leaves no descriptor open, and opens nothing in a directory before it is checked."""

    def test_nothing_in_an_unchecked_directory_is_opened(self) -> None:
        store = self.new_store()
        pickled = pickle.dumps(store)
        if os.path.exists(os.path.join(store.path, ".budget")):  # with the layer's budget
            os.unlink(os.path.join(store.path, ".budget"))
        os.mkfifo(os.path.join(store.path, ".budget"))  # opening it would block until someone writes
        os.chmod(store.path, 0o755)  # readable by others: refused
        self.addCleanup(os.chmod, store.path, 0o700)
        self.assertEqual(run_forked(_join_refused, store.path, pickled, timeout=30), 0)

    def test_lock_error_leaves_no_descriptor(self) -> None:
        opened, real_open = [], os.open

        def spy(*args: Any, **kwargs: Any) -> int:
            opened.append(real_open(*args, **kwargs))
            return opened[-1]

        with mock.patch.object(locks.os, "open", spy):
            with mock.patch.object(locks.fcntl, "flock", side_effect=OSError(errno.ENOLCK, "no locks")):
                with self.assertRaises(OSError):
                    locks.try_hold(os.path.join(self.root, "slot"), os.O_CREAT)
        self.assertEqual(len(opened), 1)
        with self.assertRaises(OSError):  # closed
            os.fstat(opened[0])


@skip_unless_store
@skip_unless_fork
@skip_unless_linux
class TestManyItems(StoreCase):
    # file creation on a disk file system can take a millisecond: use a root in shared memory when there is one
    root_parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None

    @skip_if_quick
    def test_many_items_with_few_descriptors(self) -> None:
        store = self.new_store()
        self.assertEqual(run_forked(_child_many_items, store.path, 20_000, 2_000, timeout=600), 0)
        self.assertEqual(len(item_files(store.path)), 20_000)


# -- the store as the runtime cache of datasets -----------------------------------------------------------------------

DATA = list(range(10))


class Tag(Transform):
    """Tells whether it was given a whole list or one element of it."""

    def __call__(self, x):
        return {"tag": ("whole", x) if isinstance(x, list) else ("item", x), "img": torch.zeros(1)}


def _key_train(item) -> bytes:
    return pickle_hashing(("train", item))


def _key_val(item) -> bytes:
    return pickle_hashing(("val", item))


def _unpicklable_rank(rank: int, world: int, init: str, path: str, log: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        store = SharedCacheStore(path)  # the parent's store, joined by path in each rank (one node)
        data = list(range(24))
        ds = CacheDataset(data, Compose([CountedLoad(log), RandAdd()]), runtime_cache=store, progress=False)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=3)
        # fork workers: a multiprocessing.Value is passed to a process by inheritance only
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
            dist.barrier()
        with open(os.path.join(out_dir, f"seen-rank{rank}"), "w") as f:
            f.write(" ".join(map(str, seen)))
        store.close()
    finally:
        dist.destroy_process_group()


@skip_unless_store
class TestDatasets(StoreCase):
    def check_item(self, item: dict, src: int, added: float = 1.0) -> None:
        self.assertEqual(item["src"], src)
        self.assertTrue(torch.equal(torch.as_tensor(item["img"]), torch.full((3, 4), src + added)), item)

    def test_two_datasets_share_a_store(self) -> None:
        store = self.new_store()
        log = os.path.join(self.root, "log")
        a = CacheDataset(DATA, Compose([Load(log), RandAdd()]), runtime_cache=store, progress=False)
        b = CacheDataset([20 + i for i in DATA], Compose([Load(log), RandAdd()]), runtime_cache=store, progress=False)
        for _ in range(3):
            for i in range(10):
                self.check_item(a[i], DATA[i])
                self.check_item(b[i], 20 + i)
        self.assertEqual(executions(log), Counter(dict.fromkeys(DATA + [20 + i for i in DATA], 1)))
        self.assertEqual(len(item_files(store.path)), 20)

    def test_same_data_other_transforms_share_a_store(self) -> None:
        """A training and a validation dataset over the same inputs, one store: each gets its own transforms' items."""
        store = self.new_store()
        train = CacheDataset(DATA, Compose([Load(), RandAdd()]), runtime_cache=store, progress=False)
        val = CacheDataset(DATA, Compose([Load(), Scale(10.0), RandAdd()]), runtime_cache=store, progress=False)
        for _ in range(2):
            for i in range(10):
                self.check_item(train[i], DATA[i])
                self.assertTrue(torch.equal(val[i]["img"], torch.full((3, 4), 10.0 * DATA[i] + 1)), i)
        self.assertEqual(len(item_files(store.path)), 20)

    @parameterized.expand([(m, r) for m in ("process", "store") for r in (0.5, 1.0)])
    def test_sequence_indexing(self, mode: str, rate: float) -> None:
        cache = self.new_store() if mode == "store" else mode
        ds = CacheDataset(DATA, Compose([Load(), RandAdd()]), cache_rate=rate, runtime_cache=cache, progress=False)
        store = ds._cache.cache  # the view of the dataset's runtime cache
        self.assertIsInstance(store, cache_store.SharedCacheStore)  # "process": the package's store
        if mode == "process":
            self.addCleanup(store.close)
        for _ in range(2):  # the second time from the store
            for i in range(-len(DATA), len(DATA)):
                self.check_item(ds[i], DATA[i])
        for i in (len(DATA), -len(DATA) - 1):
            with self.assertRaises(IndexError):
                ds[i]
        self.assertEqual([d["src"] for d in ds], DATA)
        self.assertEqual([d["src"] for d in ds[1:8:3]], [1, 4, 7])
        self.assertEqual([d["src"] for d in ds[[9, -10]]], [9, 0])
        self.assertEqual(len(ds), len(DATA))
        self.assertEqual([d["src"] for d in ds._cache], DATA[: ds.cache_num])
        self.assertEqual(len(item_files(store.path)), ds.cache_num)

    def test_compose_options_are_part_of_the_key(self) -> None:
        """Two datasets that differ only in Compose(map_items=...) share a store and never read each other's items."""
        store = self.new_store()
        data = [[1, 2], [3, 4]]
        whole = CacheDataset(data, Compose([Tag(), RandAdd()], map_items=False), runtime_cache=store, progress=False)
        each = CacheDataset(data, Compose([Tag(), RandAdd()], map_items=True), runtime_cache=store, progress=False)
        for _ in range(2):
            for i, d in enumerate(data):
                self.assertEqual(whole[i]["tag"], ("whole", d))
                self.assertEqual([x["tag"] for x in each[i]], [("item", v) for v in d])
        self.assertEqual(len(item_files(store.path)), 4)

    def test_namespace_by_hash_func(self) -> None:
        """Pipelines that the hash cannot tell apart get separate items with a namespaced hash_func (the guide's)."""
        store = self.new_store()
        log = os.path.join(self.root, "log")
        for hash_func in (_key_train, _key_val, _key_val):
            ds = CacheDataset(DATA, Compose([Load(log), RandAdd()]), hash_func=hash_func, runtime_cache=store)
            for i in range(len(DATA)):
                self.check_item(ds[i], DATA[i])
        self.assertEqual(executions(log), Counter(dict.fromkeys(DATA, 2)))  # once per namespace

    @skip_unless_fork
    @unittest.skipUnless(dist.is_available(), "needs torch.distributed")
    def test_two_gloo_ranks_unpicklable_transform_compute_each_item_once(self) -> None:
        """2 ranks x 2 workers x 3 epochs, 24 items, a transform holding a multiprocessing.Value: 24 computations."""
        store = self.new_store()
        log = os.path.join(self.root, "log")
        init = f"file://{os.path.join(self.root, 'rdzv')}"
        run_ranks(_unpicklable_rank, (2, init, store.path, log, self.root))
        self.assertEqual(executions(log), Counter(dict.fromkeys(range(24), 1)))
        seen = []
        for r in range(2):
            with open(os.path.join(self.root, f"seen-rank{r}")) as f:
                seen += [int(x) for x in f.read().split()]
        self.assertEqual(sorted(seen), sorted(list(range(24)) * 3))  # each item once per epoch across the ranks
        self.assertEqual(len(item_files(store.path)), 24)


if __name__ == "__main__":
    unittest.main()
