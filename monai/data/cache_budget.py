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
How much of its file system a :py:class:`monai.data.SharedCacheStore` may fill: room for the DataLoader.

PyTorch's DataLoader hands every batch from a worker to the main process through shared memory, by default files in
``/dev/shm``: the same file system as the store. A cache that fills ``/dev/shm`` does not fail itself (it stops
storing on ``ENOSPC``), but the next batch does (``unable to allocate shared memory``), and the job dies. Docker
gives containers a 64 MB ``/dev/shm`` by default, so this happens with small datasets already. A store therefore
never writes an item that would leave less than a *reserve* free on its file system, nor past an optional *cap* on
its own size; such items are computed and returned without being stored.

The default reserve is half of the file system, at most 4 GiB: a DataLoader holds about ``num_workers *
prefetch_factor`` batches in shared memory at once (8 workers x 2 x a 256 MiB batch is 4 GiB), and a small
``/dev/shm`` (a container's 64 MB, a Kubernetes memory ``emptyDir``) is shared with everything else that uses it.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["ENV_ROOT", "ENV_RESERVE", "ENV_MAX_BYTES", "Budget", "default_reserve", "scan_items"]

ENV_ROOT = "MONAI_CACHE_ROOT"  # where new stores are created, instead of /dev/shm
ENV_RESERVE = "MONAI_CACHE_RESERVE_BYTES"  # the reserve of new stores, in bytes
ENV_MAX_BYTES = "MONAI_CACHE_MAX_BYTES"  # the cap of new stores, in bytes
MAX_DEFAULT_RESERVE = 4 << 30
_BUDGET_FILE = ".budget"
_RESCAN = 1.0  # seconds between two scans of the store's size, per process


def scan_items(path: str) -> tuple[int, int]:
    """``(number, total size)`` of the item files in the store directory ``path`` (one scan)."""
    count = nbytes = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.name.endswith(".item") and not entry.name.startswith("."):
                    try:
                        nbytes += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
                    count += 1
    except OSError:
        pass
    return count, nbytes


def default_reserve(total: int) -> int:
    """The reserve kept free on a file system of ``total`` bytes: half of it, at most 4 GiB."""
    return min(total // 2, MAX_DEFAULT_RESERVE)


def _env_bytes(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative number of bytes.")
    return number


def _check(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be None or a non-negative number of bytes, got {value!r}.")
    return value


class Budget:
    """
    The budget of the store in directory ``path``, shared by every process that uses the store (it is recorded in
    the directory when the store is created).

    Args:
        path: the store's directory.
        reserve: bytes to keep free on the file system; ``None`` for :py:func:`default_reserve`.
        max_bytes: the cap on the total size of the store's items; ``None`` for no cap.
    """

    def __init__(self, path: str, reserve: int | None = None, max_bytes: int | None = None) -> None:
        self.path = path
        self.reserve = _check("reserve", reserve)
        self.max_bytes = _check("max_bytes", max_bytes)
        self._used = 0
        self._scanned_at = -float("inf")

    @classmethod
    def create(cls, path: str, reserve: int | None = None, max_bytes: int | None = None) -> Budget:
        """Record the budget of a new store; ``None`` takes the environment variable, then the default."""
        budget = cls(
            path,
            _env_bytes(ENV_RESERVE) if reserve is None else reserve,
            _env_bytes(ENV_MAX_BYTES) if max_bytes is None else max_bytes,
        )
        fd = os.open(os.path.join(path, _BUDGET_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"reserve": budget.reserve, "max_bytes": budget.max_bytes}, f)
        return budget

    @classmethod
    def load(cls, path: str) -> Budget:
        """The budget recorded in ``path`` (the defaults if there is none, as in a store of an older version)."""
        try:
            with open(os.path.join(path, _BUDGET_FILE)) as f:
                recorded = json.load(f)
            return cls(path, recorded.get("reserve"), recorded.get("max_bytes"))
        except (OSError, ValueError, AttributeError):
            return cls(path)

    def room_for(self, nbytes: int) -> str | None:
        """``None`` if an item of ``nbytes`` may be written, else why not (for the warning)."""
        statvfs = getattr(os, "statvfs", None)
        if statvfs is not None:
            try:
                st = statvfs(self.path)
            except OSError:
                return None  # the write itself will tell what is wrong
            free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            reserve = default_reserve(total) if self.reserve is None else self.reserve
            if free - nbytes < reserve:
                return (
                    f"its file system has {free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB, and "
                    f"{reserve / 2**20:.0f} MiB are kept free for the DataLoader's shared memory (reserve)"
                )
        if self.max_bytes is not None and self.used() + nbytes > self.max_bytes:
            return f"the store holds {self.used() / 2**20:.0f} MiB and its cap is max_bytes={self.max_bytes}"
        return None

    def used(self) -> int:
        """The total size of the store's items, scanned at most once a second (plus what this process wrote)."""
        now = time.monotonic()
        if now - self._scanned_at >= _RESCAN:
            self._used, self._scanned_at = scan_items(self.path)[1], now
        return self._used

    def written(self, nbytes: int) -> None:
        """Count an item this process has just written, until the next scan."""
        self._used += nbytes
