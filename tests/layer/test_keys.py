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

import importlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import unittest
import warnings
from typing import Any
from unittest import mock

import numpy as np
import torch
from parameterized import parameterized

from monai.data import CacheDataset
from monai.transforms import Compose, Lambda, Transform
from monai_sharedcache import SharedCacheStore, cache_stats, transforms_hashing
from monai_sharedcache.keys import data_key, stamp_files, transforms_fingerprint, transforms_key
from tests.layer.layer_utils import DictCache, forks_wheel, keyed_dataset, needs_forks_wheel

TIMEOUT = 120


class Holds(Transform):
    """A transform with one member, which must not change its output."""

    def __init__(self, member: object = None) -> None:
        self.member = member

    def __call__(self, x):
        return x


class Scale(Transform):
    """Multiplies by a factor: a method that the tests edit by making a subclass with another body."""

    factor = 2

    def __call__(self, x):
        return x * self.factor


class Load(Transform):
    """Loads an input file, and logs each computation to a file (state of its own would change its fingerprint)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, path: str):
        with open(self.log, "a") as f:
            f.write(path + "\n")
        return torch.as_tensor(np.load(path))

    @property
    def calls(self) -> int:
        with open(self.log) as f:
            return len(f.read().split())


def _other_pipelines(messages: list) -> list[str]:
    return [str(m.message) for m in messages if "with other cached transforms" in str(m.message)]


def _run_pipeline(path: str, member: object, ready, go, results) -> None:
    """In a child process: cache 4 inputs in the store ``path`` with ``Holds(member)``, once ``go`` is set."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = SharedCacheStore(path)
        ds = keyed_dataset(list(range(4)), Compose([Holds(member), Scale()]), store, progress=False)
        ready.set()
        go.wait(TIMEOUT)
        values = [ds[i] for i in range(4)]
        store.close()
    results.put((values, cache_stats(ds)["process"]["computed"], _other_pipelines(caught)))


class TestTransformsFingerprint(unittest.TestCase):
    keys: dict = {"hash_func": data_key, "hash_transform": transforms_key}  # the package's keys of a container

    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def write_module(self, name: str, body: str):
        with open(os.path.join(self.tmp, f"{name}.py"), "w") as f:
            f.write(body)
        if self.tmp not in sys.path:
            sys.path.insert(0, self.tmp)
            self.addCleanup(sys.path.remove, self.tmp)
        self.addCleanup(sys.modules.pop, name, None)
        importlib.invalidate_caches()
        if name in sys.modules:
            return importlib.reload(sys.modules[name])
        return importlib.import_module(name)

    def test_user_code_counts_by_its_code(self):
        """An edited module function, global constant, method and default argument: each a new fingerprint."""
        versions = {
            "original": "K = 2\ndef f(x, k=1):\n    return x * K * k\n",
            "body": "K = 2\ndef f(x, k=1):\n    return x * K * k + 1\n",
            "constant": "K = 3\ndef f(x, k=1):\n    return x * K * k\n",
            "default": "K = 2\ndef f(x, k=2):\n    return x * K * k\n",
            "cached": "import functools\nK = 2\n@functools.lru_cache\ndef f(x, k=1):\n    return x * K * k\n",
            "cached, body": "import functools\nK = 2\n@functools.lru_cache\ndef f(x, k=1):\n    return x * K + k\n",
        }
        digests = {}
        for name, body in versions.items():
            module = self.write_module("keys_userfn", body)
            digests[name] = transforms_hashing([Lambda(module.f)])
        self.assertEqual(len(set(digests.values())), len(versions), digests)
        module = self.write_module("keys_userfn", versions["original"])
        self.assertEqual(transforms_hashing([Lambda(module.f)]), digests["original"])  # back: the same again

        class Scale3(Scale):
            def __call__(self, x):
                return x * self.factor + 1

        self.assertNotEqual(transforms_hashing([Scale()]), transforms_hashing([Scale3()]))

    def test_closures_and_library_code(self):
        def make(k):
            return lambda x: x * k

        self.assertNotEqual(transforms_hashing([Lambda(make(2))]), transforms_hashing([Lambda(make(3))]))
        self.assertEqual(transforms_hashing([Lambda(make(2))]), transforms_hashing([Lambda(make(2))]))
        self.assertEqual(transforms_hashing([Lambda(np.sqrt)]), transforms_hashing([Lambda(np.sqrt)]))
        self.assertNotEqual(transforms_hashing([Lambda(np.sqrt)]), transforms_hashing([Lambda(np.exp)]))

    def test_stateless_members_count_by_type(self):
        for make in (threading.Lock, threading.RLock, threading.Event, lambda: logging.getLogger("keys")):
            first, second = transforms_fingerprint([Holds(make())]), transforms_fingerprint([Holds(make())])
            self.assertEqual((first.private, first.digest), ((), second.digest))  # shared, by type
            self.assertNotEqual(first.digest, transforms_fingerprint([Holds(None)]).digest)

    def test_shared_values_count_by_content(self):
        two, three = multiprocessing.Value("d", 2.0), multiprocessing.Value("d", 3.0)
        self.assertNotEqual(transforms_hashing([Holds(two)]), transforms_hashing([Holds(three)]))
        self.assertEqual(transforms_hashing([Holds(two)]), transforms_hashing([Holds(two)]))
        self.assertEqual(transforms_hashing([Holds(two)]), transforms_hashing([Holds(multiprocessing.Value("d", 2.0))]))

    def test_a_shared_value_keeps_its_first_content(self):
        """A transform that counts its calls in a Value: the key stays as the count moves, and set_data reuses all."""
        if not SharedCacheStore.supported:
            self.skipTest("SharedCacheStore needs fcntl, missing on this platform")
        calls = multiprocessing.Value("i", 0)

        def count(x):
            with calls.get_lock():
                calls.value += 1
            return x * 2

        first = transforms_hashing([Holds(calls)])
        calls.value = 5
        self.assertEqual(transforms_hashing([Holds(calls)]), first)
        self.assertNotEqual(transforms_hashing([Holds(multiprocessing.Value("i", 5))]), first)  # another, from 5
        store = SharedCacheStore()
        self.addCleanup(store.close)
        ds = keyed_dataset(list(range(4)), Compose([Holds(calls), Lambda(count)]), store, progress=False)
        self.assertEqual([ds[i] for i in range(4)], [0, 2, 4, 6])
        ds.set_data(list(range(4)))
        ds.set_data(list(range(2, 6)))
        self.assertEqual([ds[i] for i in range(4)], [4, 6, 8, 10])
        self.assertEqual(calls.value - 5, 6)  # 4, then the 2 new inputs only

    def test_a_member_pickle_cannot_store_is_private(self):
        import socket

        a, b = socket.socket(), socket.socket()
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        fa = transforms_fingerprint([Holds(a)])
        self.assertIsNone(transforms_hashing([Holds(a)]))
        self.assertIn("socket", fa.private[0])
        self.assertEqual(fa, transforms_fingerprint([Holds(a)]))  # the same object: the same in this process
        self.assertNotEqual(fa.digest, transforms_fingerprint([Holds(b)]).digest)  # another one: never shared

        data = [np.arange(3.0)]
        with self.assertWarnsRegex(UserWarning, "socket.*neither shared .* hash_transform="):
            CacheDataset(data, Compose([Holds(a)]), runtime_cache=DictCache({}), progress=False, **self.keys)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fingerprint of the user's own: no warning
            keys = {**self.keys, "hash_transform": lambda t: b"mine"}
            ds = CacheDataset(data, Compose([Holds(a)]), runtime_cache=DictCache({}), progress=False, **keys)
        self.assertTrue(ds.cache_key(0).endswith("mine"))


@unittest.skipUnless(SharedCacheStore.supported, "the store needs fcntl")
class TestProcessesOfOneStore(unittest.TestCase):
    """Processes (ranks, say) that cache the same inputs in one store: they share, or are told why they cannot."""

    def run_two(self, member, child_member):
        """This process and a spawned child cache 4 inputs, holding ``member`` and ``child_member``."""
        ctx = multiprocessing.get_context("spawn")
        ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
        store = SharedCacheStore()
        self.addCleanup(store.close)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = keyed_dataset(list(range(4)), Compose([Holds(member), Scale()]), store, progress=False)
            child = ctx.Process(target=_run_pipeline, args=(store.path, child_member, ready, go, results))
            child.start()
            try:
                self.assertTrue(ready.wait(TIMEOUT))  # both have made their datasets, as ranks before training
                go.set()
                values = [ds[i] for i in range(4)]
                child_values, child_computed, child_told = results.get(timeout=TIMEOUT)
            finally:
                child.join(TIMEOUT)
                if child.is_alive():
                    child.kill()
        self.assertEqual(child.exitcode, 0)
        self.assertEqual(values, [0, 2, 4, 6])
        self.assertEqual(child_values, [0, 2, 4, 6])
        computed = cache_stats(ds)["process"]["computed"] + child_computed
        return computed, _other_pipelines(caught), child_told

    def test_one_value_made_before_both_is_shared(self):
        """Processes that hold one ``multiprocessing.Value`` made before them compute each item once, untold."""
        value = multiprocessing.get_context("spawn").Value("d", 2.0)
        self.assertEqual(self.run_two(value, value), (4, [], []))

    @needs_forks_wheel
    def test_pipelines_that_differ_in_one_member_are_told_which(self):
        computed, told, child_told = self.run_two("rank 0", "rank 1")
        self.assertEqual(computed, 8)  # once per pipeline: they cannot share
        self.assertEqual((len(told), len(child_told)), (1, 1), (told, child_told))
        for message in told + child_told:
            self.assertIn("What differs: transform 0 (Holds), member member.", message)

    @parameterized.expand(
        [
            ("unpicklable", lambda x: threading.Lock(), lambda item: isinstance(item, type(threading.Lock()))),
            ("meta", lambda x: torch.empty(x, device="meta"), lambda item: item.device.type == "meta"),
        ]
    )
    def test_an_item_that_cannot_be_stored_is_returned(self, _, fn, is_item):
        """An unpicklable item, and one on the meta device (a stand-in for CUDA), are returned uncached."""
        store = SharedCacheStore()
        self.addCleanup(store.close)
        ds = keyed_dataset([1, 2], Compose([Lambda(fn)]), store, progress=False)
        with self.assertWarnsRegex(RuntimeWarning, "runtime_cache=False"):
            self.assertTrue(is_item(ds[0]))
        self.assertTrue(is_item(ds[0]))
        self.assertEqual(cache_stats(ds)["cache"]["refused"], 2)


class TestFileStamps(unittest.TestCase):
    keys: dict = {"hash_func": data_key, "hash_transform": transforms_key}  # the package's keys of a container

    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        cwd = os.getcwd()
        self.addCleanup(os.chdir, cwd)

    def save(self, rel: str, value: float) -> str:
        path = os.path.join(self.tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, np.full(4, value))
        return path

    def test_a_directory_that_many_inputs_name_is_listed_once(self):
        """A label naming the data's root: the keys of its inputs list it once, not once per input (quadratic)."""
        os.makedirs(os.path.join(self.tmp, "root"))
        for i in range(20):
            open(os.path.join(self.tmp, "root", f"f{i}"), "w").close()
        data = [{"id": i, "site": os.path.join(self.tmp, "root")} for i in range(20)]
        ds = CacheDataset(
            data, Compose([Lambda(lambda d: d["id"])]), runtime_cache=DictCache({}), progress=False, **self.keys
        )
        with mock.patch("os.scandir", wraps=os.scandir) as lists:
            self.assertEqual([ds[i] for i in range(20)], list(range(20)))
        self.assertEqual(lists.call_count, 1)
        open(os.path.join(self.tmp, "root", "new"), "w").close()  # the directory changed: listed anew
        ds.set_data(data)
        with mock.patch("os.scandir", wraps=os.scandir) as lists:
            self.assertEqual(ds[0], 0)
        self.assertEqual(lists.call_count, 1)

    def test_keys_read_no_file_until_an_item_is_needed(self):
        """
        The constructor and set_data stat and list nothing; an item's files, and the entries of a directory that it
        names (one level), are stat'ed when it is needed, once per slot and process.
        """
        paths = [self.save(f"img{i}.npy", float(i)) for i in range(3)]
        os.makedirs(os.path.join(self.tmp, "train", "sub"))  # a directory that the entries name
        data = [{"img": p, "site": "train", "id": "no such file"} for p in paths]
        os.chdir(self.tmp)
        load = Load(os.path.join(self.tmp, "log"))
        with mock.patch("os.stat", wraps=os.stat) as stats, mock.patch("os.scandir", wraps=os.scandir) as lists:
            t = Compose([Lambda(lambda d: d["img"]), load])
            ds = CacheDataset(data, t, runtime_cache=DictCache({}), progress=False, **self.keys)
            ds.set_data(data)
            stat_of = lambda: [c.args[0] for c in stats.call_args_list if c.args[0] in {*paths, "train"}]  # noqa
            self.assertEqual((stat_of(), lists.call_count), ([], 0))
            self.assertEqual([float(ds[1][0]), float(ds[1][0])], [1.0, 1.0])
            # the item's files alone, once: a slot's key is made at its first use in a process, and kept until set_data
            self.assertEqual(sorted(stat_of()), sorted([paths[1], "train"]))
            self.assertEqual([c.args[0] for c in lists.call_args_list], [os.path.join(self.tmp, "train")])
            st = os.stat(paths[0])
        stamp = ("file", paths[0], (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        self.assertEqual(stamp_files(data[0])["img"], stamp)
        self.assertEqual(stamp_files(data[0])["id"], "no such file")  # plain data
        ds.set_data(data)
        self.assertEqual(([float(ds[i][0]) for i in range(3)], load.calls), ([0.0, 1.0, 2.0], 3))
        open(os.path.join(self.tmp, "train", "x"), "w").close()  # in the directory that each entry names
        ds.set_data(data)
        self.assertEqual(([float(ds[i][0]) for i in range(3)], load.calls), ([0.0, 1.0, 2.0], 6))

    @parameterized.expand([("keyed",), ("list",)])
    def test_same_relative_name_in_two_directories(self, kind):
        """One shared cache, two projects naming ``img.npy`` relatively: each gets its own item."""
        if kind == "list" and not forks_wheel():
            self.skipTest("a container of slots is keyed in the fork's wheel only: upstream empties it at set_data")
        self.save("a/img.npy", 1.0)
        self.save("b/img.npy", 2.0)
        container: Any = [] if kind == "list" else DictCache({})
        values = []
        for project in ("a", "b"):
            os.chdir(os.path.join(self.tmp, project))
            t = Compose([Load(os.path.join(self.tmp, "log"))])
            ds = CacheDataset(["img.npy"], t, runtime_cache=container, progress=False, **self.keys)
            values.append(float(ds[0][0]))
        self.assertEqual(values, [1.0, 2.0])

    def test_rewritten_in_place_is_recomputed_and_unchanged_is_not(self):
        path = self.save("img.npy", 1.0)
        load = Load(os.path.join(self.tmp, "log"))
        ds = CacheDataset([path], Compose([load]), runtime_cache=DictCache({}), progress=False, **self.keys)
        self.assertEqual((float(ds[0][0]), load.calls), (1.0, 1))
        ds.set_data([path])  # nothing changed: nothing computed
        self.assertEqual((float(ds[0][0]), load.calls), (1.0, 1))
        st = os.stat(path)
        self.save("img.npy", 5.0)  # in place: the same inode and size, and the very same mtime restored
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        ds.set_data([path])
        self.assertEqual((float(ds[0][0]), load.calls), (5.0, 2))
        shutil.copyfile(path, path + ".copy")
        os.replace(path + ".copy", path)  # copied afresh: other stat data (content digests are a persistent store's)
        ds.set_data([path])
        self.assertEqual((float(ds[0][0]), load.calls), (5.0, 3))

    def test_own_hash_func_is_used_as_given(self):
        path = self.save("img.npy", 1.0)
        load = Load(os.path.join(self.tmp, "log"))
        keys = {**self.keys, "hash_func": lambda p: b"k"}
        ds = CacheDataset([path], Compose([load]), runtime_cache=DictCache({}), progress=False, **keys)
        self.assertEqual(ds.cache_key(0), "k" + ds.transform_hash)
        self.assertEqual((float(ds[0][0]), load.calls), (1.0, 1))
        self.save("img.npy", 5.0)
        ds.set_data([path])  # its key does not see the file: the cached item
        self.assertEqual((float(ds[0][0]), load.calls), (1.0, 1))


if __name__ == "__main__":
    unittest.main()
