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
Helpers of the package's tests (tests/layer/), on the package's names and MONAI's public ones that exist with the
upstream series alone, so that they run on MONAI 1.6.1 + the series (``--mode series``) and on the fork's wheel.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import unittest
from typing import Any, Callable

import monai
from monai.data import CacheDataset, KeyedCache
from monai_sharedcache import SharedCacheStore

TIMEOUT = 120.0  # seconds for any wait on another process
IS_LINUX = sys.platform.startswith("linux")
FORK = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
skip_unless_linux = unittest.skipUnless(IS_LINUX, "needs Linux (/proc, PID namespaces)")
skip_unless_store = unittest.skipUnless(SharedCacheStore.supported, "SharedCacheStore needs fcntl (not on Windows)")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(monai.__file__)), os.environ.get("PYTHONPATH", "")]),
}
ENV_DEFAULT_ROOT = {k: v for k, v in ENV.items() if not k.startswith("MONAI_CACHE_")}  # stores in /dev/shm
# the start of a command that runs a shell script (its argument) in a private mount namespace: root and unshare(1)
IN_PRIVATE_MOUNTS = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]


class DictCache(KeyedCache):
    """A keyed cache (``get`` and ``put``, MONAI's ``KeyedCache``) over a ``dict`` or a ``Manager().dict()``."""

    def __init__(self, items: Any) -> None:
        self.items = items

    def get(self, key: str) -> Any:
        return self.items.get(key)

    def put(self, key: str, item: Any) -> None:
        self.items[key] = item

    def discard(self, keys: Any) -> None:
        for key in keys:
            self.items.pop(key, None)


def exact_keys(store: Any) -> dict[str, Any]:
    """The arguments of ``CacheDataset`` that key its items in ``store`` by the store's exact keys."""
    return {"runtime_cache": store, "hash_func": store.hash_func, "hash_transform": store.hash_transform}


def keyed_dataset(data: Any, transform: Any, store: Any, **kwargs: Any) -> CacheDataset:
    """A ``CacheDataset`` of ``data`` whose items ``store`` keeps under its exact keys (files, code, tensors)."""
    return CacheDataset(data, transform, **exact_keys(store), **kwargs)


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


def wait_for(cond: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def backdate(path: str, seconds: float = 60.0) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def unshare_works() -> bool:
    """Whether a process can be started in a new PID namespace here."""
    if not IS_LINUX or shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def private_mount_namespace() -> str | None:
    """Why a private mount namespace with its own /dev/shm cannot be made here, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a 64 MB tmpfs on /dev/shm in a private mount namespace"
    cmd = [*IN_PRIVATE_MOUNTS, "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    probe = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a private namespace: {probe.stderr.strip()}"


def item_files(path: str) -> list[str]:
    """The names of the item files of the store ``path``."""
    return sorted(n for n in os.listdir(path) if n.endswith(".item"))


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


def forks_wheel() -> bool:
    """Whether the tests run on the fork's wheel (MONAI with the series and the fork's patch)."""
    from monai.data import CacheDataset

    return callable(getattr(CacheDataset, "cache_stats", None))


# a dataset notes its pipeline in a store (so that processes caching its inputs otherwise are told) on the fork's wheel
# alone: the keyed protocol hands a store one key at a time, never the dataset's inputs
needs_forks_wheel = unittest.skipUnless(forks_wheel(), "the fork's wheel tells a store of the dataset's pipeline")
