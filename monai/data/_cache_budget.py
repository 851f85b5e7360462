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

The DataLoader hands every batch from a worker to the main process through shared memory, by default files in
``/dev/shm``: the store's file system. A store that filled it would not fail itself, but the next batch would
(``unable to allocate shared memory``), and Docker gives containers a 64 MB ``/dev/shm``. So a store never writes an
item that would leave less than a reserve free on its file system, nor one past an optional cap on its own size: such
items are computed and returned without being stored. The default reserve is half the file system, at most 4 GiB (8
workers x a prefetch of 2 x a 256 MiB batch).

The cap holds for the store, not per process: the bytes and the number of its items are counted in the store
(``.used``, 16 bytes read and written under ``flock``), and a writer reserves an item's bytes there before it writes,
so what one process writes every other one sees before its next write, and no operation lists the store's directory.
It makes its temporary file once they are counted, under the same lock: a recount then finds the files of the writers
that counted, and of no other (a writer refused by the budget makes none).
A writer that dies gives its reservation back through its temporary file, whose name holds the bytes reserved: the
cleaner of dead temporary files returns them. What a process killed at a worse moment leaves counted (an item removed,
its bytes not yet given back) can only make the count too high, never too low: the store counts its items again when
the count would refuse an item, and the count changed since it last did.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable

from monai.data import _cache_locks as locks

ENV_RESERVE = "MONAI_CACHE_RESERVE_BYTES"  # the reserve of new stores, in bytes
ENV_MAX_BYTES = "MONAI_CACHE_MAX_BYTES"  # the cap of new stores, in bytes
BUDGET_FILE = ".budget"
USED_FILE = (
    ".used"  # the bytes (the writes under way included) and the number of the store's items, for all its processes
)
_USED = struct.Struct("<qq")


def default_reserve(total: int) -> int:
    """The reserve kept free on a file system of ``total`` bytes: half of it, at most 4 GiB."""
    return min(total // 2, 4 << 30)


def check_bytes(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be None or a non-negative number of bytes, got {value!r}.")
    return value


def env_bytes(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()):  # int() would take other digits, such as superscripts
        raise ValueError(f"{name}={value!r} must be a non-negative number of bytes.")
    return int(value)


class Budget:
    """The reserve and cap of one store, as its creator recorded them for all its users, and its count of bytes."""

    def __init__(self, d: Any, reserve: int | None = None, max_bytes: int | None = None) -> None:
        self.dir, self.reserve, self.max_bytes = d, reserve, max_bytes  # d: the store's directory (a Dir)
        self.space: Callable[[], tuple[int, int] | None] = self.statvfs  # the store's free_space
        self.recount: Callable[[], tuple[int, int]] | None = None  # the bytes of items and temporary files, items
        self._recounted: int | None = None  # the count of bytes that the last recount found

    @classmethod
    def create(cls, d: Any, reserve: int | None, max_bytes: int | None) -> None:
        """Record the budget of a new store; ``None`` takes the environment variable, then the default."""
        reserve = env_bytes(ENV_RESERVE) if reserve is None else reserve
        max_bytes = env_bytes(ENV_MAX_BYTES) if max_bytes is None else max_bytes
        fd = d.open(BUDGET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            json.dump({"reserve": reserve, "max_bytes": max_bytes}, f)

    @classmethod
    def load(cls, d: Any) -> Budget:
        """The budget recorded in the store ``d`` (the defaults if none can be read)."""
        try:
            found = d.read_checked(BUDGET_FILE)
            recorded = json.loads(found[0]) if found is not None else {}
            return cls(d, recorded.get("reserve"), recorded.get("max_bytes"))
        except (OSError, ValueError, AttributeError):  # AttributeError: not a JSON object
            return cls(d)

    def statvfs(self) -> tuple[int, int] | None:
        """The bytes free (to this user) and in all on the store's file system; ``None`` if they cannot be told."""
        try:
            st = os.statvfs(self.dir.fd)
        except (OSError, AttributeError):
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def room_for(self, nbytes: int, made: Callable[[], object] | None = None) -> str | None:
        """
        ``None`` if an item of ``nbytes`` may be written, and its bytes are then counted; else why not. Once they are
        counted, and under the count's lock, ``made()`` makes the writer's temporary file, whose name holds them: so a
        recount finds the file of every writer that counted, and of no other.
        """
        space = self.space()
        if space is not None:  # else the write itself will tell what is wrong
            free, total = space
            reserve = default_reserve(total) if self.reserve is None else self.reserve
            if free - nbytes < reserve:
                return (
                    f"{free / 2**20:.0f} MiB are free of {total / 2**20:.0f} MiB where its items count, and "
                    f"{reserve / 2**20:.0f} MiB are kept free for the DataLoader's shared memory (reserve)"
                )
        used = self._update(nbytes, cap=self.max_bytes, made=made)[0]
        full = self.max_bytes is not None and used + nbytes > self.max_bytes
        if full and self.recount is not None and used != self._recounted:  # what killed processes left counted
            used = self._recounted = self._update(nbytes, cap=self.max_bytes, recount=True, made=made)[0]
        if self.max_bytes is not None and used + nbytes > self.max_bytes:
            return f"the store holds {used / 2**20:.0f} MiB and its cap is max_bytes={self.max_bytes}"
        return None

    def count(self, nbytes: int, items: int = 0) -> int:
        """
        Add ``nbytes`` (negative: bytes removed) and ``items`` to the store's counts; the bytes counted before.

        Raises:
            OSError: the count cannot be opened, read or written.
        """
        return self._update(nbytes, items=items)[0]

    def counted(self) -> tuple[int, int]:
        """The store's bytes (the writes under way included) and its number of items, as counted."""
        return self._update(0)

    def _update(
        self,
        nbytes: int,
        *,
        cap: int | None = None,
        items: int = 0,
        recount: bool = False,
        made: Callable[[], object] | None = None,
    ) -> tuple[int, int]:
        """
        Add ``nbytes`` and ``items`` to the counts unless that would pass ``cap``, then ``made()``; the counts before.
        With ``recount`` (or a count of an older layout), the counts are first replaced by what :py:attr:`recount`
        finds in the store, which the items removed or published before the call have left already: then only the
        bytes of a writer's item to come (``nbytes`` > 0) are added.
        """
        fd = self.dir.open(USED_FILE, os.O_RDWR | os.O_CREAT)  # per call:
        try:  # threads too are kept apart by flock, which one descriptor shared by threads or a fork would not do
            locks.lock(fd)
            data = os.pread(fd, _USED.size, 0)
            used, n = _USED.unpack(data) if len(data) == _USED.size else (0, 0)
            if (recount or len(data) not in (0, _USED.size)) and self.recount is not None:
                used, n = self.recount()
                os.pwrite(fd, _USED.pack(used, n), 0)
                nbytes, items = max(nbytes, 0), 0
            fits = cap is None or used + nbytes <= cap
            if fits and (nbytes or items):
                os.pwrite(fd, _USED.pack(max(0, used + nbytes), max(0, n + items)), 0)
            if fits and made is not None:
                try:
                    made()
                except BaseException:
                    os.pwrite(fd, _USED.pack(used, n), 0)  # not made: not counted
                    raise
            return int(used), int(n)
        finally:
            os.close(fd)  # and with it the lock
