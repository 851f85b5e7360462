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
import os
import re
import shutil
import stat
import tempfile
import time
import unittest
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from parameterized import parameterized

from monai.data import DataLoader
from monai.transforms import Compose, RandomizableTransform, Transform
from monai_sharedcache import SharedCacheStore, cache_stats, create_shared_cache, fill, persist, refresh
from monai_sharedcache import store as layer_store
from tests.layer.layer_utils import keyed_dataset
from tests.test_utils import DistCall, DistTestCase

needs_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl, missing on this platform")
N = 6
TIMEOUT = 120  # seconds for any wait on another process


class Load(Transform):
    """Deterministic, with a parameter: logs ``<i>`` at each computation (one O_APPEND write, atomic across processes)."""

    def __init__(self, log: str, scale: float = 1.0) -> None:
        self.log, self.scale = log, scale

    def __call__(self, i: int) -> dict:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{i}\n".encode())
        finally:
            os.close(fd)
        return {"i": i, "img": torch.full((2, 3), i * self.scale)}


class AddOne(RandomizableTransform):
    def __call__(self, d: dict) -> dict:
        d["img"] += 1  # in place: the cached item must not change
        return d


def _computed(log: str) -> list[int]:
    try:
        with open(log) as f:
            return sorted(int(line) for line in f)
    except FileNotFoundError:
        return []


@needs_store
class TestPersistentStore(DistTestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.path = os.path.join(self.tmp, "node", "cache")  # its parent is missing too
        self.log = os.path.join(self.tmp, "log")

    def open(self, path: str | None = None, **kwargs) -> SharedCacheStore:
        store = SharedCacheStore(path or self.path, persistent=True, **kwargs)
        self.addCleanup(store.close)
        return store

    def run_dataset(self, scale: float = 1.0, num_workers: int = 0, log: str | None = None) -> dict:
        """One run: a new store object (the first user, so a new session), a dataset, an epoch; its cache stats."""
        store = SharedCacheStore(self.path, persistent=True)
        try:
            ds = keyed_dataset(list(range(N)), Compose([Load(log or self.log, scale), AddOne()]), store)
            for batch in DataLoader(ds, batch_size=1, num_workers=num_workers):
                i = int(batch["i"])
                torch.testing.assert_close(batch["img"], torch.full((1, 2, 3), i * scale + 1))
            return cache_stats(ds)["cache"]
        finally:
            store.close()

    def test_kept_across_runs(self):
        store = self.open()
        self.assertTrue(store.persistent)
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o700)
        self.assertTrue(store.put("a", np.arange(100_000)))
        store.close()
        self.assertTrue(os.path.isdir(self.path))  # kept by its last user
        again = self.open()
        self.assertEqual(again.stats()["reused"], 0)
        np.testing.assert_array_equal(again.get_or_compute("a", self.fail), np.arange(100_000))
        stats = again.stats()
        self.assertEqual((stats["filled"], stats["reused"], stats["hits"], stats["computed"]), (1, 1, 1, 0))
        joined = SharedCacheStore(self.path)  # a store made persistent is joined as such
        self.assertTrue(joined.persistent)
        self.assertEqual(joined.get("a")[7], 7)
        joined.close()
        again.close()
        self.assertTrue(os.path.isdir(self.path))

    @parameterized.expand([(0,), (2,)])
    def test_two_runs_of_a_dataset(self, num_workers):
        first = self.run_dataset(num_workers=num_workers)
        self.assertEqual(_computed(self.log), list(range(N)))
        self.assertEqual((first["computed"], first["reused"]), (N, 0))
        second = self.run_dataset(num_workers=num_workers)
        self.assertEqual(_computed(self.log), list(range(N)))  # nothing computed again
        self.assertEqual((second["computed"], second["reused"], second["filled"]), (0, N, N))

    def test_changed_transforms_recompute(self):
        self.run_dataset(scale=1.0)
        other = self.run_dataset(scale=2.0)  # a changed parameter: every item again, never an old one
        self.assertEqual(_computed(self.log), sorted(2 * list(range(N))))
        self.assertEqual((other["computed"], other["reused"], other["filled"]), (N, 0, 2 * N))
        back = self.run_dataset(scale=1.0)  # the first parameters' items stayed
        self.assertEqual(_computed(self.log), sorted(2 * list(range(N))))
        self.assertEqual((back["computed"], back["reused"]), (0, N))

    def test_other_versions_are_not_served(self):
        store = self.open()
        store.put("a", 1)
        store.close()
        with mock.patch.object(persist, "version_tag", return_value="format1-monai0.0.0"):
            older = self.open()
            self.assertIsNone(older.get("a"))  # another MONAI release: a miss
            older.put("a", 2)
            older.close()
        store = self.open()
        self.assertEqual((store.get("a"), store.stats()["filled"]), (1, 2))  # both stayed, each for its version

    @parameterized.expand([("stripes", None), ("one_stripe", 1)])
    def test_max_bytes_evicts_earlier_runs_least_recently_used_first(self, _, stripes):
        """With one stripe, every item shares the turn of the put that evicts it (with 128, a key did by chance)."""
        if stripes is not None:
            patcher = mock.patch.object(layer_store, "_STRIPES", stripes)
            patcher.start()
            self.addCleanup(patcher.stop)
        item = np.zeros(25_000)  # 200 kB
        store = self.open()
        for k in ("k0", "k1", "k2", "k3"):
            store.put(k, item)
        nbytes = store.stats()["nbytes"] // 4
        store.close()
        for age, k in enumerate(("k3", "k2", "k1", "k0")):  # k0 used last, long ago; k3 first
            path = store._stem(k) + ".item"
            when = time.time_ns() - (age + 10) * 10**9  # written before it was last used: relatime leaves it
            os.utime(os.path.join(self.path, path), ns=(when, when - 10**9))
        store = self.open(max_bytes=4 * nbytes + 1000, reserve=0)
        self.assertIsNotNone(store.get("k2"))  # used by this run: never evicted for it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in ("n0", "n1", "n2", "n3"):
                store.put(k, item)
        kept = {k for k in ("k0", "k1", "k2", "k3", "n0", "n1", "n2", "n3") if store.get(k) is not None}
        self.assertEqual(kept, {"k2", "n0", "n1", "n2"})  # k3, k1, k0 went in that order; then n3 was refused
        self.assertIn("max_bytes", " ".join(str(w.message) for w in caught))

    def test_clear(self):
        probe = self.open(os.path.join(self.tmp, "probe"))
        probe.put("x", np.zeros(500))
        store = self.open(max_bytes=3 * probe.stats()["nbytes"], reserve=0)  # room for 3 items exactly
        for k in range(3):
            self.assertTrue(store.put(str(k), np.zeros(500)))
        store.clear()
        self.assertEqual((store.stats()["filled"], store.get("1")), (0, None))
        self.assertTrue(store.put("1", np.zeros(500)))  # room again at once

    def test_reserve_is_kept_on_its_own_file_system(self):
        store = self.open(reserve=0)
        st = os.statvfs(self.path)
        store.close()
        store = self.open(reserve=st.f_bavail * st.f_frsize + 2**30)  # more than its file system has free
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertFalse(store.put("a", 1))
        self.assertIn(f"free of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB", str(caught[-1].message))

    def test_killed_run_leaves_nothing_to_misread(self):
        store = self.open()
        store.put("whole", np.arange(50_000))
        store.put("torn", np.arange(50_000))
        store.close()
        torn = os.path.join(self.path, store._stem("torn") + ".item")
        os.truncate(torn, os.path.getsize(torn) // 2)  # what no writer publishes: a half file
        dead = os.path.join(self.path, ".tmp", "killed-writer")
        with open(dead, "wb") as f:
            f.write(b"half an item")
        os.utime(dead, (time.time() - 60, time.time() - 60))
        store = self.open()
        self.assertTrue(store.put("next", 1))
        self.assertFalse(os.path.exists(dead))  # the temporary file of a dead writer, removed at a write
        np.testing.assert_array_equal(store.get("whole"), np.arange(50_000))
        self.assertIsNone(store.get("torn"))  # a miss, and removed
        self.assertFalse(os.path.exists(torn))

    def test_stores_of_the_guide_open_as_written(self):
        """The stores of the guide's examples, in its order, under a temporary root; the parent of one stays refused."""
        guide = Path(__file__).resolve().parents[2] / "docs" / "source" / "caching_persistent.rst"
        code = re.compile(r'^    store = SharedCacheStore\("(/[^"]+)", persistent=True', re.MULTILINE)
        shown = code.findall(guide.read_text())
        self.assertGreaterEqual(len(shown), 2)
        for path in shown:
            SharedCacheStore(self.tmp + path, persistent=True).close()
        with self.assertRaisesRegex(ValueError, "holds .* and no store kept across runs"):  # the safety check holds
            SharedCacheStore(os.path.dirname(self.tmp + shown[0]), persistent=True)

    def test_leftover_cleaner_keeps_persistent_stores(self):
        kept = self.open()
        kept.put("a", 1)
        kept.close()
        named = os.path.join(self.tmp, "monai-cache-kept")  # named as temporary stores are, by hand
        os.rename(self.path, named)
        new = SharedCacheStore(root=self.tmp)  # a new temporary store cleans the leftovers of its root
        new.close()
        self.assertEqual(len([n for n in os.listdir(named) if n.endswith(".item")]), 1)
        with self.assertRaisesRegex(ValueError, "must not start with 'monai-cache-'"):  # older cleaners would
            SharedCacheStore(named, persistent=True)

    def test_umask_002(self):
        old = os.umask(0o002)  # the default of many distributions: group-writable files, unless made private
        try:
            self.open().put("a", 1)
            self.assertEqual(self.open().get("a"), 1)  # every file of the store is private
        finally:
            os.umask(old)
        modes = [stat.S_IMODE(os.stat(p).st_mode) for p in (os.path.dirname(self.path), self.path)]
        self.assertEqual(modes, [0o700, 0o700])  # the missing parent that it made too

    def test_set_data_keeps_and_refresh_drops(self):
        store = self.open()
        ds = keyed_dataset(list(range(N)), Compose([Load(self.log), AddOne()]), store)
        fill(ds)
        ds.set_data(list(range(N, 2 * N)))  # the items of the first inputs stay, for later runs
        fill(ds)
        self.assertEqual(store.stats()["filled"], 2 * N)
        refresh(ds)  # inputs rewritten in place: their items go
        self.assertEqual(store.stats()["filled"], N)

    def test_budget_is_recorded(self):
        self.open(max_bytes=10**9).close()
        self.open(reserve=0).close()  # replaces the reserve only
        store = self.open()
        self.assertEqual(store.put("a", 1), True)
        with open(os.path.join(self.path, ".budget")) as f:
            self.assertEqual(f.read(), '{"reserve": 0, "max_bytes": 1000000000}')

    @parameterized.expand([("full", errno.ENOSPC), ("read_only", errno.EROFS)])
    def test_file_system_without_room_at_open(self, _, code):
        with mock.patch.object(persist, "resolve", side_effect=OSError(code, os.strerror(code))):
            with self.assertWarnsRegex(RuntimeWarning, "cannot make or open the store"):
                store = self.open()  # the job goes on, without the cache
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once already
            self.assertEqual(
                (store.get_or_compute("k", lambda: 3), store.put("k", 1), store.get("k")), (3, False, None)
            )
        self.assertEqual(self.open().get_or_compute("k", lambda: 4), 4)  # with room again, a store as usual
        self.assertEqual(self.open().get("k"), 4)
        with mock.patch.object(persist, "join", side_effect=OSError(code, os.strerror(code))):
            with self.assertWarnsRegex(RuntimeWarning, "cannot open the persistent store"):
                joined = SharedCacheStore(self.path)  # joined as persistent, without the flag
            joined.clear()  # of a store it could not open: nothing
        self.assertEqual((joined.get("k"), self.open().get("k")), (None, 4))

    def test_a_session_that_its_starter_left_unmade_is_started_by_the_next_user(self):
        first = self.open()
        self.assertTrue(first.put("a", 1))
        os.unlink(os.path.join(self.path, ".session"))  # as a first user killed before it made it
        joined = SharedCacheStore(self.path)  # another user, without the flag: still persistent, and starts it
        self.addCleanup(joined.close)
        self.assertTrue(joined.persistent and os.path.exists(os.path.join(self.path, ".session")))
        self.assertEqual((joined.get("a"), first.get("a")), (1, 1))  # one key for both: the version tag

    def test_torn_records_are_removed(self):
        self.open().close()
        torn = [os.path.join(self.path, ".records", f"{name}-123-456-0") for name in (".budget", ".budget-1")]
        for path in torn + [os.path.join(self.path, ".budget-mine")]:
            with open(path, "w") as f:
                f.write("{")  # a write that a killed run left
            os.utime(path, (1, 1))
        self.open().close()  # a new run
        self.assertEqual([os.path.exists(p) for p in torn], [False] * 2)
        self.assertTrue(os.path.exists(os.path.join(self.path, ".budget-mine")))  # not named as the store names them

    def test_budget_of_a_store_in_use_holds(self):
        first = self.open(max_bytes=10**9, reserve=0)
        with self.assertWarnsRegex(RuntimeWarning, "another run uses .* max_bytes=1000000000 \\(asked: 100\\)"):
            second = self.open(max_bytes=100)  # a second job on the same store, while the first runs
        self.assertTrue(second.put("a", np.ones(1000)))  # the first job's cap holds: not 100 bytes
        second.close()
        first.close()
        self.open(max_bytes=100).close()  # alone: its budget is recorded
        self.assertFalse(self.open().put("b", np.ones(1000)))

    @parameterized.expand([("directory", "", 0o777), ("directory", "", 0o750), ("budget", ".budget", 0o666)])
    def test_refuses_what_others_could_write(self, _, which, mode):
        store = self.open()
        store.put("a", 1)
        store.close()
        names = [n for n in os.listdir(self.path) if n.endswith(which)] if which else []
        os.chmod(os.path.join(self.path, *names), mode)
        with self.assertRaises(PermissionError) as err:
            SharedCacheStore(self.path, persistent=True)
        self.assertIn("unpickled", str(err.exception))
        self.assertIn(oct(mode), str(err.exception))
        os.chmod(os.path.join(self.path, *names), 0o700 if not which else 0o644)  # readable by others is fine
        self.assertEqual(self.open().get("a"), 1)

    def test_refuses_symbolic_links(self):
        store = self.open()
        store.close()
        link = os.path.join(self.tmp, "link")
        os.symlink(self.path, link)  # the user's own, in a directory that only the user can write: followed
        linked = SharedCacheStore(link, persistent=True)
        self.assertEqual(linked.path, self.path)
        linked.close()
        if os.geteuid() == 0:
            os.lchown(link, 4321, 4321)  # another user's: refused
            with self.assertRaisesRegex(PermissionError, "symbolic link owned by uid 4321"):
                SharedCacheStore(link, persistent=True)
        os.unlink(os.path.join(self.path, ".budget"))
        os.symlink(os.path.join(self.tmp, "log"), os.path.join(self.path, ".budget"))
        with self.assertRaisesRegex(PermissionError, "\\.budget' in it is a symbolic link"):
            SharedCacheStore(self.path, persistent=True)

    def test_opens_without_a_look_at_its_items(self):
        store = self.open()
        self.assertTrue(store.put("a", 1) and store.put("b", 2))
        store.close()
        writable, linked = sorted(os.path.join(self.path, n) for n in os.listdir(self.path) if n.endswith(".item"))
        Path(self.log).write_text("mine")
        os.chmod(writable, 0o666)
        os.unlink(linked)
        os.symlink(self.log, linked)
        again = self.open()  # each item is checked when it is read, none at open
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not an item the store wrote"
            self.assertEqual((again.get("a"), again.get("b")), (None, None))  # never unpickled
        self.assertEqual((again.get_or_compute("a", lambda: 3), again.get_or_compute("b", lambda: 4)), (3, 4))
        self.assertEqual(Path(self.log).read_text(), "mine")  # the link was replaced, not followed
        self.assertFalse(os.path.islink(linked))  # a file of the store's own now

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0, "needs root to make a link of another user")
    def test_links_that_another_user_could_point_elsewhere(self):
        """
        In a project directory that everyone can write, another user points ``pub/proj2`` at the victim's other
        project: the victim's store there is neither cleared nor joined. Links of the victim's own in a private
        directory (or root's) are followed, and ``path`` is the store's real path.
        """
        other = os.path.join(self.tmp, "otherproj", "cache")
        kept = SharedCacheStore(other, persistent=True)
        kept.put("a", 1)
        kept.close()
        pub = os.path.join(self.tmp, "pub")
        os.mkdir(pub)
        os.chmod(pub, 0o777)
        theirs, mine = os.path.join(pub, "proj2"), os.path.join(pub, "proj3")
        os.symlink(os.path.join("..", "otherproj"), theirs)
        os.lchown(theirs, 4321, 4321)  # made by another user
        os.symlink(os.path.join(self.tmp, "otherproj"), mine)  # the victim's own, but where others can write
        for link, problem in ((theirs, "owned by uid 4321"), (mine, "in a directory that other users can write")):
            with self.assertRaisesRegex(PermissionError, f"'{link}' is a symbolic link {problem}"):
                SharedCacheStore(os.path.join(link, "cache"), persistent=True).clear()
        self.assertEqual(SharedCacheStore(other, persistent=True).get("a"), 1)  # untouched
        private = os.path.join(self.tmp, "private")
        os.mkdir(private, 0o700)
        os.symlink(os.path.join("..", "otherproj"), os.path.join(private, "proj"))
        store = SharedCacheStore(os.path.join(private, "proj", ".", "cache"), persistent=True)
        self.addCleanup(store.close)
        self.assertEqual((store.path, store.get("a")), (other, 1))
        made = SharedCacheStore(os.path.join(private, "proj", "new", "deeper"), persistent=True)
        self.addCleanup(made.close)
        self.assertEqual(made.path, os.path.join(self.tmp, "otherproj", "new", "deeper"))
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(made.path)).st_mode), 0o700)

    def test_directories_made_meanwhile_by_another_process(self):
        real = os.mkdir

        def raced(name, mode=0o777, *, dir_fd=None):
            real(name, mode, dir_fd=dir_fd)  # another process made it first
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), name)

        with mock.patch.object(os, "mkdir", raced):
            store = self.open()
        self.assertEqual((store.path, store.put("a", 1), store.get("a")), (self.path, True, 1))

    def test_path_with_dot_entries_is_refused_and_kept(self):
        path = os.path.join(self.tmp, "data")
        for sub in (".tmp", ".counters"):
            os.makedirs(os.path.join(path, sub), 0o700)
            Path(path, sub, "0").write_text(sub)
        for name in (".node-1", ".persistent", "x.item"):
            Path(path, name).write_text(name)
        os.chmod(path, 0o700)
        with self.assertRaisesRegex(ValueError, "holds .* and no store kept across runs"):
            SharedCacheStore(path, persistent=True)
        for name in (".tmp/0", ".counters/0", ".node-1", ".persistent", "x.item"):  # nothing removed or changed
            self.assertEqual(Path(path, name).read_text(), os.path.dirname(name) or name)
        self.assertEqual(len(os.listdir(path)), 5)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "needs path"):
            SharedCacheStore(persistent=True)
        with self.assertRaisesRegex(ValueError, "no root"):
            SharedCacheStore(self.path, root=self.tmp, persistent=True)
        with self.assertRaisesRegex(ValueError, "goes with persistent=True"):
            create_shared_cache(path=self.path)
        with self.assertRaisesRegex(ValueError, "goes with persistent=True"):
            create_shared_cache(persistent=True)
        os.makedirs(self.path, 0o700)
        open(os.path.join(self.path, "notes.txt"), "w").close()
        with self.assertRaisesRegex(ValueError, "holds .* and no store kept across runs"):
            SharedCacheStore(self.path, persistent=True)

    def test_refuses_a_network_file_system(self):
        self.open().close()  # a store made on a node-local file system
        fake = os.path.join(self.tmp, "mountinfo")
        with open(fake, "w") as f:
            f.write("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
            f.write(f"36 22 0:40 / {os.path.realpath(self.tmp)} rw - lustre 10.0.0.1@tcp:/scratch rw\n")
        other = os.path.join(self.tmp, "other", "cache")
        with mock.patch.object(persist.memory, "MOUNTINFO", fake):  # sessions rely on flock, local to a node there
            for path, kwargs in ((other, {"persistent": True}), (self.path, {"persistent": True}), (self.path, {})):
                with self.assertRaisesRegex(ValueError, "network file system \\(lustre\\).*node-local file system"):
                    SharedCacheStore(path, **kwargs)
        self.assertFalse(os.path.exists(os.path.dirname(other)))  # nothing made
        self.assertEqual(self.open().get_or_compute("k", lambda: 1), 1)

    def test_create_shared_cache_without_distributed(self):
        store = create_shared_cache(path=self.path, persistent=True)
        self.addCleanup(store.close)
        self.assertEqual((store.path, store.persistent), (self.path, True))

    @DistCall(nproc_per_node=2, timeout=TIMEOUT)
    def run_ranks(self, log: str) -> None:
        os.umask(0o002)  # in this rank only: every file the ranks make stays private all the same
        store = create_shared_cache(path=self.path, persistent=True)
        try:
            ds = keyed_dataset(list(range(N)), Compose([Load(log), AddOne()]), store)
            fill(ds)
            for i in range(N):
                torch.testing.assert_close(ds[i]["img"], torch.full((2, 3), i + 1.0))
        finally:
            store.close()

    def test_two_runs_of_two_ranks(self):
        self.run_ranks(self.log)
        self.assertEqual(_computed(self.log), list(range(N)))  # once per node
        self.run_ranks(self.log)  # the same transforms (the log's path is one of their parameters)
        self.assertEqual(_computed(self.log), list(range(N)))  # the second run computes nothing


if __name__ == "__main__":
    unittest.main()
