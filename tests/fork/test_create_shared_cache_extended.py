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
The extended tests of ``create_shared_cache`` with real processes: DDP ranks on gloo (CPU), started with ``mp.spawn``
and as separate interpreters like ``torchrun`` starts them, with DataLoader workers, simulated nodes, early exits, a
removed directory, crashed owners, timeouts, and a rank that builds no dataset.

Every spawned interpreter imports MONAI (several seconds on 2 cores), so the scenarios are grouped into two launches:
one ``mp.spawn`` run of 2 ranks and one ``torchrun``-style run of 4 ranks as 2 simulated nodes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import unittest
import warnings
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from fork_utils import (
    FORK,
    TIMEOUT,
    backdate,
    end,
    item_files,
    skip_if_quick,
    skip_unless_fork,
    skip_unless_linux,
    skip_unless_store,
    wait_for,
)
from parameterized import parameterized
from torch.utils.data.distributed import DistributedSampler

from monai.data import CacheDataset, DataLoader, create_shared_cache
from monai.transforms import Compose, Randomizable, Transform

LAUNCH_TIMEOUT = 300.0  # seconds for a whole multi-process launch (interpreters importing MONAI on 2 busy cores)
PG_TIMEOUT = 90.0  # seconds, the timeout of the ranks' process groups: a mismatched collective fails, never hangs
N_ITEMS = 12
SHORT = 3.0  # seconds, the `timeout` of create_shared_cache while one rank never calls it
NODE_ID_ENV = "MONAI_CACHE_NODE_ID"
# a torchrun-style rank: a new interpreter that imports this module by the name the test runner gave it
MODULE = os.path.splitext(os.path.basename(__file__))[0] if __name__ == "__main__" else __name__
RANK_SCRIPT = "import importlib, sys; importlib.import_module(sys.argv[1]).torchrun_style_rank(*sys.argv[2:])"


# -- the pipeline: a deterministic transform that logs each execution, then a random one that works in place ----------


class CountedLoad(Transform):
    """Deterministic: appends one line ``<id> <pid>`` to ``log`` per execution (O_APPEND: atomic across processes)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, d: dict) -> dict:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{d['id']} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return {"id": d["id"], "img": torch.full((2, 3), float(d["id"]))}


class RandShift(Randomizable, Transform):
    """Random: adds a random integer ``r`` to the image in place (a shared, unprotected cached item would change)."""

    def __init__(self) -> None:
        self.r = 0

    def randomize(self, data: Any = None) -> None:
        self.r = int(self.R.randint(1, 1000))

    def __call__(self, d: dict) -> dict:
        self.randomize()
        d["img"] += self.r
        d["r"] = self.r
        return d


def make_dataset(log: str, store: Any) -> CacheDataset:
    data = [{"id": i} for i in range(N_ITEMS)]
    return CacheDataset(data, Compose([CountedLoad(log), RandShift()]), runtime_cache=store, progress=False)


def executions(log: str) -> Counter:
    """How many times the deterministic transform ran for each id."""
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line.split()[0]) for line in f if line.strip())


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def run_epochs(ds: CacheDataset, rank: int, world: int, epochs: list[int], workers: int) -> set[int]:
    """Iterate ``ds`` with a shuffling DistributedSampler; check every item; return the ids this rank got."""
    sampler: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=7)
    # fork workers: the ranks of mp.spawn default to spawn, and a spawned worker re-imports MONAI (~10 s each).
    # A bounded wait for the workers: a worker that hangs (e.g. a child deadlocked inside fork itself, as older
    # Python 3.11 releases can when another thread holds the runtime lock, CPython gh-112275) fails this rank and is
    # terminated by its loader, instead of blocking the rank until its process group times out and living on, orphaned
    loader = DataLoader(
        ds,
        batch_size=2,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        timeout=TIMEOUT if workers else 0,
    )
    seen: set[int] = set()
    for epoch in epochs:
        sampler.set_epoch(epoch)
        got = []
        for batch in loader:
            for i, img, r in zip(batch["id"].tolist(), batch["img"], batch["r"].tolist()):
                check(1 <= r < 1000, f"rank {rank}: item {i} did not go through the random transform")
                expected = torch.full((2, 3), float(i + r))
                check(torch.equal(torch.as_tensor(img), expected), f"rank {rank} epoch {epoch}: wrong item {i}")
                got.append(i)
        check(sorted(got) == sorted(sampler), f"rank {rank} epoch {epoch}: got {sorted(got)}, not {sorted(sampler)}")
        seen.update(got)
    return seen


def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def store_dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("monai-cache-"))


def participants(path: str) -> int:
    """How many store objects participate in the store ``path``: the flock holders of its ``.lock`` (/proc/locks)."""
    st = os.stat(os.path.join(path, ".lock"))
    with open("/proc/locks") as f:
        fields = [line.split() for line in f]
    suffix = f":{st.st_ino}"
    return sum(1 for x in fields if len(x) > 5 and x[1] == "FLOCK" and x[5].endswith(suffix))


def write_facts(tmp: str, rank: int, facts: dict) -> None:
    path = os.path.join(tmp, f"facts-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)


def read_facts(tmp: str, rank: int) -> dict:
    with open(os.path.join(tmp, f"facts-{rank}.json")) as f:
        return json.load(f)  # type: ignore[no-any-return]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the mp.spawn launch: 2 ranks on one node ------------------------------------------------------------------------


def spawn_rank(rank: int, world: int, tmp: str, root: str) -> None:
    """Every scenario of one node, in order; the last one ends with rank 0 exiting early."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT)
    )
    facts: dict[str, Any] = {"pid": os.getpid(), "times": []}
    t0 = time.monotonic()

    def mark(label: str) -> None:
        facts["times"].append((label, round(time.monotonic() - t0, 2)))

    try:
        # 1. the creator (rank 0) cannot create its store: every rank gets an error, none hangs
        bad_root = os.path.join(tmp, "no-such-dir", "root")
        try:
            create_shared_cache(root=bad_root if rank == 0 else root)
            facts["error"] = "returned a store"
        except RuntimeError as err:
            facts["error"] = str(err)
        dist.barrier()

        mark("phase 2")
        # 2. the main scenario: 2 ranks x 2 DataLoader workers, shuffling DistributedSampler, 3 epochs. The exchange
        # runs over a private gloo group because of `timeout`
        store = create_shared_cache(root=root, timeout=60)
        facts["main_paths"] = gather(store.path)
        facts["main_dirs"] = store_dirs(root)
        facts["main_mode"] = stat.S_IMODE(os.stat(store.path).st_mode)
        log = os.path.join(tmp, "main.log")
        run_epochs(make_dataset(log, store), rank, world, [0, 1, 2], workers=2)
        dist.barrier()
        facts["main_executions"] = dict(executions(log))
        facts["main_filled"] = len(item_files(store.path))
        dist.barrier()
        store.close()
        dist.barrier()
        facts["main_exists_after_close"] = os.path.exists(store.path)

        mark("phase 3")
        # 3. rank 1 builds no dataset and goes straight to a barrier, while rank 0 builds one and iterates it with
        # workers: a collective call hidden in CacheDataset or its loader would be paired with that barrier
        store = create_shared_cache(root=root)
        if rank == 0:
            log = os.path.join(tmp, "lonely.log")
            run_epochs(make_dataset(log, store), 0, 1, [0, 1], workers=2)
            facts["lonely_executions"] = dict(executions(log))
        dist.barrier()
        store.close()
        dist.barrier()

        mark("phase 4")
        # 4. over a gloo subgroup (monitored barrier for `timeout`), the directory is removed between epochs by
        # rank 1: both ranks finish with right items (computed again) and warn, without workers to catch warnings
        sub = dist.new_group([0, 1], backend="gloo")
        store = create_shared_cache(sub, root=root, timeout=60)
        log = os.path.join(tmp, "removed.log")
        ds = make_dataset(log, store)
        run_epochs(ds, rank, world, [0], workers=0)
        dist.barrier()
        if rank == 1:
            shutil.rmtree(store.path)
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_epochs(ds, rank, world, [1, 2], workers=0)
        facts["removed_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        store.close()
        dist.barrier()
        facts["removed_executions"] = dict(executions(log))
        dist.destroy_process_group(sub)

        mark("phase 5")
        # 5. rank 0 exits right after the first epoch; rank 1 goes on with cache hits, the directory stays until
        # rank 1, the last participant, closes it
        store = create_shared_cache(root=root)
        gather(os.getpid())
        log = os.path.join(tmp, "early.log")
        ds = make_dataset(log, store)
        run_epochs(ds, rank, world, [0], workers=2)
        dist.barrier()
        facts["early_path"] = store.path
        if rank == 0:
            facts["done"] = True
            mark("end")
            return  # exits without close(): the store's exit hook removes this rank's marker only
        wait_for(lambda: participants(store.path) == 1)  # rank 1's own lock is left
        facts["early_markers_after_rank0"] = participants(store.path)
        before = executions(log)
        run_epochs(ds, rank, world, [1, 2], workers=2)
        facts["early_executions_before"] = dict(before)
        facts["early_executions_after"] = dict(executions(log))
        facts["early_exists_before_close"] = os.path.isdir(store.path)
        store.close()
        facts["early_exists_after_close"] = os.path.exists(store.path)
        facts["done"] = True
        mark("end")
    finally:
        write_facts(tmp, rank, facts)
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the torchrun-style launch: 4 separate interpreters, 2 simulated nodes of 2 ranks -----------------------------------


def torchrun_style_rank(tmp: str, root: str) -> None:
    """Like a rank started by ``torchrun``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and the node in the env."""
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=PG_TIMEOUT))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ[NODE_ID_ENV]
    facts: dict[str, Any] = {"node": node, "local_rank": int(os.environ["LOCAL_RANK"])}
    try:
        store = create_shared_cache(root=root)  # the node comes from $MONAI_CACHE_NODE_ID
        facts["paths"] = gather(store.path)
        facts["nodes"] = gather(node)
        facts["authkeys"] = gather(bytes(multiprocessing.current_process().authkey).hex())
        log = os.path.join(tmp, f"{node}.log")
        seen = run_epochs(make_dataset(log, store), rank, world, [0, 1], workers=1)
        facts["seen"] = gather(sorted(seen))
        dist.barrier()
        facts["executions"] = {n: dict(executions(os.path.join(tmp, f"{n}.log"))) for n in sorted(set(facts["nodes"]))}
        dist.barrier()
        store.close()
        dist.barrier()

        # a rank that never calls create_shared_cache: the others fail after `timeout`, they do not hang
        if rank == world - 1:
            write_facts(tmp, rank, facts)
            others = [os.path.join(tmp, f"facts-timeout-{r}.json") for r in range(world - 1)]
            wait_for(lambda: all(os.path.exists(p) for p in others), LAUNCH_TIMEOUT)
            return
        start = time.monotonic()
        try:
            create_shared_cache(root=root, timeout=SHORT).close()
            outcome: dict[str, Any] = {"raised": None}
        except Exception as err:  # recorded, and checked by the test: only the timeout of the collective may pass
            outcome = {
                "raised": f"{type(err).__module__}.{type(err).__qualname__}",
                "is_runtime_error": isinstance(err, RuntimeError),
                "message": str(err),
            }
        facts["timeout"] = {**outcome, "seconds": time.monotonic() - start}
        write_facts(tmp, rank, facts)
        with open(os.path.join(tmp, f"facts-timeout-{rank}.json"), "w") as f:
            f.write("done")
    finally:
        if not os.path.exists(os.path.join(tmp, f"facts-{rank}.json")):
            write_facts(tmp, rank, facts)
        dist.destroy_process_group()


# -- forked helpers of the single-process tests -----------------------------------------------------------------------


def _create_and_hang(root: str, conn: Any) -> None:
    store = create_shared_cache(root=root)
    conn.send(store.path)
    time.sleep(TIMEOUT)


def _create_in_world_of_one(root: str, init: str, conn: Any) -> None:
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT))
    store = create_shared_cache(root=root, node_id="solo")
    conn.send((store.path, store_dirs(root)))
    store.close()
    dist.destroy_process_group()


# -- tests ------------------------------------------------------------------------------------------------------------


class SharedCacheTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="monai-test-shared-cache-")
        self.root = os.path.join(self.tmp, "root")
        os.mkdir(self.root, 0o700)
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)


@skip_unless_store
@skip_unless_fork
class TestLeftovers(SharedCacheTestCase):
    @parameterized.expand([("local",), ("distributed",)])
    def test_leftover_of_killed_owner_is_removed(self, how: str) -> None:
        """A process SIGKILLed after creating its store leaves it behind; the next creation in the root removes it."""
        assert FORK is not None
        recv, send = FORK.Pipe(duplex=False)
        owner = FORK.Process(target=_create_and_hang, args=(self.root, send))
        owner.start()
        self.addCleanup(end, owner)
        self.assertTrue(recv.poll(TIMEOUT), "the owner did not create its store")
        leftover = recv.recv()
        os.kill(owner.pid, signal.SIGKILL)  # type: ignore[arg-type]
        owner.join(TIMEOUT)
        self.assertEqual(owner.exitcode, -signal.SIGKILL)
        self.assertTrue(os.path.isdir(leftover))
        backdate(leftover)  # a leftover without a lock file is only removed once unmodified for a few seconds
        if how == "local":
            store = create_shared_cache(root=self.root)
            dirs = store_dirs(self.root)
            store.close()
        else:
            recv, send = FORK.Pipe(duplex=False)
            proc = FORK.Process(target=_create_in_world_of_one, args=(self.root, f"file://{self.tmp}/init", send))
            proc.start()
            self.addCleanup(end, proc)
            self.assertTrue(recv.poll(TIMEOUT), "create_shared_cache did not return")
            path, dirs = recv.recv()
            proc.join(TIMEOUT)
            self.assertEqual(proc.exitcode, 0)
            self.assertNotEqual(path, leftover)
        self.assertFalse(os.path.exists(leftover))
        self.assertEqual(len(dirs), 1)
        self.assertEqual(store_dirs(self.root), [])


@skip_if_quick
@skip_unless_store
@skip_unless_fork
@skip_unless_linux  # /proc/locks
class TestSpawn(SharedCacheTestCase):
    def test_two_ranks_one_node(self) -> None:
        """mp.spawn, 2 ranks: creation error, exactly-once with workers, no hidden collectives, removed dir, early exit."""
        ctx = torch_mp.spawn(spawn_rank, args=(2, self.tmp, self.root), nprocs=2, join=False)
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    self.fail(f"the ranks did not finish in {LAUNCH_TIMEOUT} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(TIMEOUT)
        f0, f1 = read_facts(self.tmp, 0), read_facts(self.tmp, 1)
        self.assertTrue(f0.get("done") and f1.get("done"), (f0, f1))
        all_once = {str(i): 1 for i in range(N_ITEMS)}  # json keys are strings

        # a creation error reaches every rank, naming the rank that failed
        for f in (f0, f1):
            self.assertIn("rank 0", f["error"])
            self.assertIn("FileNotFoundError", f["error"])

        # one store for the node, private, every item computed exactly once across ranks and workers
        self.assertEqual(f0["main_paths"][0], f0["main_paths"][1])
        self.assertEqual(f0["main_dirs"], [os.path.basename(f0["main_paths"][0])])
        self.assertEqual(f1["main_dirs"], f0["main_dirs"])
        self.assertEqual(f0["main_mode"], 0o700)
        self.assertEqual(f0["main_executions"], all_once)
        self.assertEqual(f0["main_filled"], N_ITEMS)
        self.assertFalse(f0["main_exists_after_close"])

        # no collective call in CacheDataset: rank 0 iterated alone while rank 1 waited in a barrier
        self.assertEqual(f0["lonely_executions"], all_once)

        # removed directory: right items (checked in the ranks), computed again, and a warning on both ranks
        for f in (f0, f1):
            self.assertTrue(any("gone" in w for w in f["removed_warnings"]), f["removed_warnings"])
        self.assertEqual(set(f0["removed_executions"]), set(all_once))
        # once each in epoch 0, then without the cache (the store is never made again): every access computes
        self.assertEqual(sum(f0["removed_executions"].values()), 3 * N_ITEMS)

        # early exit of rank 0: rank 1 still hits the cache; the directory goes with the last participant
        self.assertEqual(f1["early_markers_after_rank0"], 1)
        self.assertEqual(f1["early_executions_before"], all_once)
        self.assertEqual(f1["early_executions_after"], all_once)  # cache hits only after rank 0 left
        self.assertTrue(f1["early_exists_before_close"])
        self.assertFalse(f1["early_exists_after_close"])
        self.assertEqual(store_dirs(self.root), [])


@skip_if_quick
@skip_unless_store
@skip_unless_fork
class TestTorchrunStyle(SharedCacheTestCase):
    def test_two_nodes_of_two_ranks(self) -> None:
        """4 interpreters (distinct authkeys), env://, 2 nodes via MONAI_CACHE_NODE_ID; then a timeout."""
        world, port = 4, free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank % 2),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYTHONPATH=os.pathsep.join(p for p in sys.path if p),  # as multiprocessing gives a spawned child
                **{NODE_ID_ENV: f"node{rank // 2}"},
            )
            out = open(os.path.join(self.tmp, f"rank{rank}.out"), "wb")
            self.addCleanup(out.close)
            cmd = [sys.executable, "-c", RANK_SCRIPT, MODULE, self.tmp, self.root]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.fail(f"the ranks did not finish in {LAUNCH_TIMEOUT} s:\n{self._outputs(world)}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(TIMEOUT)
        self.assertEqual([p.returncode for p in procs], [0] * world, self._outputs(world))
        facts = [read_facts(self.tmp, r) for r in range(world)]
        f0 = facts[0]

        # separate interpreters: distinct multiprocessing authkeys, nothing relies on them
        self.assertEqual(len(set(f0["authkeys"])), world)
        # one store per node, different between nodes
        paths = f0["paths"]
        self.assertEqual(paths[0], paths[1])
        self.assertEqual(paths[2], paths[3])
        self.assertNotEqual(paths[0], paths[2])
        # each node computed exactly the items its ranks used, each once: nothing was shared across nodes
        self.assertEqual(set().union(*f0["seen"]), set(range(N_ITEMS)))  # the ranks used every item between them
        for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
            used = set(f0["seen"][ranks[0]]) | set(f0["seen"][ranks[1]])
            self.assertEqual(f0["executions"][node], {str(i): 1 for i in sorted(used)}, node)
        # every store was removed when its node's ranks closed it
        self.assertEqual(store_dirs(self.root), [])
        # the ranks that called create_shared_cache(timeout=SHORT) without the last rank failed with the timeout
        # of the collective (raised as torch.distributed raises it: a RuntimeError such as DistStoreError whose
        # message says it timed out), after waiting about `timeout` seconds, not for any other reason
        self.assertNotIn("timeout", facts[-1])  # the last rank never called it
        for rank, f in enumerate(facts[:-1]):
            outcome = f["timeout"]
            self.assertIsNotNone(outcome["raised"], f"rank {rank} got a store without the last rank")
            self.assertTrue(outcome["is_runtime_error"], f"rank {rank}: {outcome}")
            self.assertRegex(outcome["message"], r"(?i)time[ds]? ?out", f"rank {rank}: {outcome}")
            self.assertGreaterEqual(outcome["seconds"], 0.9 * SHORT, f"rank {rank} did not wait for the timeout")
            self.assertLess(outcome["seconds"], 10 * SHORT, f"rank {rank} waited far longer than the timeout")

    def _outputs(self, world: int) -> str:
        text = []
        for rank in range(world):
            try:
                with open(os.path.join(self.tmp, f"rank{rank}.out"), errors="replace") as f:
                    text.append(f"--- rank {rank}\n" + f.read()[-3000:])
            except OSError:
                pass
        return "\n".join(text)


if __name__ == "__main__":
    unittest.main()
