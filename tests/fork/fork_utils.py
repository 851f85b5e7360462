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
"""Helpers of the fork's own tests (tests/fork/): processes with timeouts, namespaces, and the platform checks."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest
from collections import Counter
from typing import Any, Callable

import torch

import monai
from monai.transforms import RandomizableTransform, Transform

try:
    from monai.data import SharedCacheStore

    STORE = SharedCacheStore.supported
except ImportError:  # PR 01 alone has no store: its fork-only tests import these helpers too
    STORE = False

TIMEOUT = 120.0  # seconds for any wait on another process
IS_LINUX = sys.platform.startswith("linux")
FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
skip_unless_fork = unittest.skipIf(FORK is None, "needs the fork start method (not on Windows)")
skip_unless_linux = unittest.skipUnless(IS_LINUX, "needs Linux (/proc, PID namespaces)")
skip_unless_store = unittest.skipUnless(STORE, "SharedCacheStore needs fcntl (not on Windows)")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(monai.__file__)), os.environ.get("PYTHONPATH", "")]),
}
ENV_DEFAULT_ROOT = {k: v for k, v in ENV.items() if not k.startswith("MONAI_CACHE_")}  # stores in /dev/shm


def run_forked(target: Callable, *args: Any, timeout: float = TIMEOUT) -> int:
    """Run ``target(*args)`` in a forked process; its exit code. Killed, and a failure, past ``timeout``."""
    assert FORK is not None
    proc = FORK.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(TIMEOUT)
        raise AssertionError(f"{target.__name__} did not finish in {timeout} s")
    return proc.exitcode  # type: ignore[return-value]


def run_ranks(fn: Callable, args: tuple, nprocs: int = 2, timeout: float = 2 * TIMEOUT) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; kill them and fail past ``timeout``."""
    ctx = torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError("the ranks timed out")
    finally:  # a rank that failed or timed out leaves no process behind
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(TIMEOUT)


def recv(conn: Any, timeout: float = TIMEOUT) -> Any:
    if not conn.poll(timeout):
        raise AssertionError("no message from the child process")
    return conn.recv()


def wait_for(cond: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def backdate(path: str, seconds: float = 60.0) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def participated(path: str) -> bool:
    """Whether some process uses the store ``path`` (holds its lock file)."""
    import fcntl

    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _unshare_works() -> bool:
    if not IS_LINUX or shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


skip_unless_unshare = unittest.skipUnless(
    _unshare_works(), "cannot start a process in a new PID namespace here (`unshare --pid --fork` not permitted)"
)

# a participant in another PID namespace: joins the store, says so, and stays until its stdin closes (or it is killed)
_NAMESPACE_PARTICIPANT = """
import os, sys
from monai.data import SharedCacheStore
store = SharedCacheStore(sys.argv[1])
print("attached", os.getpid(), flush=True)
sys.stdin.read()
store.close()
"""


def start_in_pid_namespace(path: str) -> subprocess.Popen:
    """Start a participant of the store ``path`` in a new PID namespace; wait until it has joined."""
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", _NAMESPACE_PARTICIPANT, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=ENV,
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


def stop(proc: subprocess.Popen, kill: bool = False) -> int:
    """End a participant started by :py:func:`start_in_pid_namespace`: close its stdin, or SIGKILL it."""
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


# the start of a command that runs a shell script (its argument) in a private mount namespace: root and unshare(1)
IN_PRIVATE_MOUNTS = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]


def private_mount_namespace() -> str | None:
    """Why a private mount namespace with its own /dev/shm cannot be made here, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a 64 MB tmpfs on /dev/shm in a private mount namespace"
    cmd = [*IN_PRIVATE_MOUNTS, "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    probe = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a private namespace: {probe.stderr.strip()}"


QUICK = os.environ.get("QUICKTEST", "").lower() == "true"  # as MONAI's tests/test_utils.py reads it
skip_if_quick = unittest.skipIf(QUICK, "a slow test: QUICKTEST=true")


class Evil:
    """Unpickled, it creates the file ``canary``: the code of whoever wrote the file ran."""

    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple:
        return open, (self.canary, "w")


def item_files(path: str) -> list[str]:
    """The names of the item files of the store ``path``."""
    return sorted(n for n in os.listdir(path) if n.endswith(".item"))


def end(proc: Any) -> None:
    """SIGKILL the multiprocessing ``proc`` if it is still alive, and reap it."""
    if proc.pid is None:  # never started
        return
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)


# -- what the fork-only tests cache: children import these by this module's name --------------------------------------


class Load(Transform):
    """Deterministic: appends each input that it computes to the file ``log``, if given (one write: atomic)."""

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


class CountedLoad(Load):
    """``Load`` holding members that pickle cannot store: a lock and a ``multiprocessing.Value``."""

    def __init__(self, log: str) -> None:
        super().__init__(log)
        self.lock = threading.Lock()
        self.calls = multiprocessing.Value("i", 0)

    def __call__(self, x):
        with self.lock, self.calls.get_lock():
            self.calls.value += 1
        return super().__call__(x)


class RandAdd(RandomizableTransform):
    """Random: adds 1 in place, so that an item shared with the cache would come back with 2, then 3."""

    def __call__(self, d):
        d["img"] += 1.0
        return d


class Scale(Transform):
    """Another deterministic transform: other cached content for the same input."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, d):
        return {**d, "img": d["img"] * self.factor}


def executions(log: str) -> Counter:
    """How many times :py:class:`Load` computed each input, in any process."""
    if not os.path.exists(log):
        return Counter()
    with open(log) as f:
        return Counter(int(line) for line in f.read().split())


def mapped_files(address: int) -> list[str]:
    """The files mapped at ``address`` in this process (from /proc/self/maps; empty: nothing, or anonymous memory)."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi and len(fields) >= 6:
                found.append(fields[5])
    return found
