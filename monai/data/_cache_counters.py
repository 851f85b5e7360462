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
Counts of what a runtime cache did (hits, misses, computations, refused items), for this process and, for a
:py:class:`monai.data.SharedCacheStore`, for all the processes that used it.

The work of a shared cache happens in processes that the user does not hold on to: DataLoader workers, which exit
at the end of every epoch, and the other ranks of the node. So every process counts into a slot of the store, a file
``.counters/<n>`` that it holds with an exclusive ``flock``, and rewrites it at every event (one ``pwrite``). A
process that dies releases its slot's lock with it, and the next process to take the slot goes on from its counts:
the sum of the slots keeps the counts of the processes that are gone, and there are never more slots than processes
counting at once. A forked child (a DataLoader worker) takes a slot of its own at its first event.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from typing import cast

from monai.data import _cache_locks as locks

FIELDS = ("hits", "misses", "computed", "refused")
HITS, MISSES, COMPUTED, REFUSED = range(len(FIELDS))
_SLOT = struct.Struct(f"<{len(FIELDS)}q")
SLOTS_DIR = ".counters"
_MAX_SLOTS = 4096


class Counters:
    """
    The counts of this process and, with ``d``, of all processes that counted in the store of the directory ``d`` (a
    ``Dir``). A copy pickled to another process counts for that process alone, from zero.
    """

    def __init__(self, d: locks.Dir | None = None) -> None:
        self._at, self._dir = d, cast("locks.Dir | None", None)  # the store's directory; its slots' once opened
        self._lock = threading.Lock()
        self._pid = -1
        self._local = [0] * len(FIELDS)  # the events of this process
        self._slot = [0] * len(FIELDS)  # what its slot holds: the counts of the slot's earlier holders, plus those
        self._held: locks.Held | None = None
        _ALL.add(self)
        if not _HOOKED and hasattr(os, "register_at_fork"):  # at the first counts made, never at import
            _HOOKED.append(True)
            os.register_at_fork(after_in_child=_after_fork_in_child)

    def _attach(self) -> None:
        """Take a slot, at the first event of this process."""
        self._pid, self._local, self._slot, self._held = os.getpid(), [0] * len(FIELDS), [0] * len(FIELDS), None
        if self._at is None:
            return
        try:
            try:
                os.mkdir(SLOTS_DIR, 0o700, dir_fd=self._at.fd)
            except FileExistsError:
                pass
            self._dir = locks.Dir(self._at.path, SLOTS_DIR, self._at)
        except OSError:
            return
        for i in range(_MAX_SLOTS):
            try:
                held = locks.try_hold(str(i), os.O_CREAT, at=self._dir)
            except OSError:
                return
            if held is not None:
                data = os.pread(held.fd, _SLOT.size, 0)
                self._slot = list(_SLOT.unpack(data)) if len(data) == _SLOT.size else self._slot
                self._held = held
                return

    def add(self, field: int, n: int = 1) -> None:
        """Count ``n`` events of the kind ``FIELDS[field]`` in this process."""
        with self._lock:
            if self._pid != os.getpid():
                self._attach()
            self._local[field] += n
            self._slot[field] += n
            if self._held is not None:
                try:
                    os.pwrite(self._held.fd, _SLOT.pack(*self._slot), 0)
                except OSError:
                    self._held = None

    def close(self) -> None:
        """Give this process's slot up; its counts stay in it."""
        with self._lock:
            if self._held is not None and self._pid == os.getpid():
                self._held.close()
            self._held = None

    def local(self) -> dict[str, int]:
        """The counts of this process."""
        with self._lock:
            mine = self._local if self._pid == os.getpid() else [0] * len(FIELDS)
            return dict(zip(FIELDS, mine))

    def total(self) -> dict[str, int]:
        """The counts of all processes, alive or not, that counted in the store (this process's own without one)."""
        if self._at is None:
            return self.local()
        sums = [0] * len(FIELDS)
        try:
            slots = self._dir = self._dir or locks.Dir(self._at.path, SLOTS_DIR, self._at)
            names = slots.names()
        except OSError:
            names = []
        for name in names:
            try:
                found = slots.read_checked(name, _SLOT.size)
            except OSError:
                continue
            if found is not None and len(found[0]) == _SLOT.size:
                sums = [a + b for a, b in zip(sums, _SLOT.unpack(found[0]))]
        return dict(zip(FIELDS, sums)) if names else self.local()

    def __reduce__(self) -> tuple:
        return Counters, ()


def _after_fork_in_child() -> None:
    for counts in list(_ALL):
        counts._lock = threading.Lock()  # another thread may have held it at the fork


_ALL: weakref.WeakSet[Counters] = weakref.WeakSet()
_HOOKED: list = []  # whether the at-fork hook is registered
