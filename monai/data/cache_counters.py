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
Event counters of a :py:class:`monai.data.SharedCacheStore` that every process of the store adds to and any process
can read: hits, misses, computations and refused items, per process and in total.

Why: the work of a cache happens in processes that the user does not hold on to (DataLoader workers, which exit at
the end of every epoch unless they are persistent, and the other ranks of the node), so counts kept in a process are
lost with it, and a count per event in a file would grow with every hit of a week-long training.

How: the file ``.counters`` of the store has a fixed number of slots of a few 64-bit counters. A process takes a
slot by an open file description lock (``F_OFD_SETLK``) on the slot's bytes, which the kernel releases when the
process dies, in any PID namespace, and adds to it through a shared mapping: one memory write per event, no system
call, and exactly one writer per slot. A process that takes the slot of a dead one goes on adding to its counts, so
the totals (the sum of all slots) keep the counts of processes that are gone, and the file never grows. A forked
child (a DataLoader worker) takes a slot of its own at its first event. Where such locks do not exist (not Linux), or
all slots are taken, a process counts for itself only.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no locks, each process counts for itself
    fcntl = None  # type: ignore[assignment]

__all__ = ["COMPUTED", "FIELDS", "HITS", "MISSES", "REFUSED", "Counters"]

FIELDS = ("hits", "misses", "computed", "refused")
HITS, MISSES, COMPUTED, REFUSED = range(len(FIELDS))
_SLOT = 64  # bytes per slot: one cache line, room for 8 counters
_SLOTS = 4096  # processes that can count at once (a sparse file of 256 KiB)
_FILE = ".counters"
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None) if fcntl is not None else None


def _lock_range(fd: int, start: int) -> bool:
    """Take a write lock on ``[start, start + _SLOT)`` of ``fd``'s open file description, without waiting."""
    # struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (0 for OFD locks)
    arg = struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, start, _SLOT, 0)  # type: ignore[union-attr]
    try:
        fcntl.fcntl(fd, _OFD_SETLK, arg)  # type: ignore[union-attr,arg-type]
    except OSError:
        return False
    return True


class Counters:
    """
    The counters of the store in ``path``, for this process and for all processes (see the module documentation).
    A copy pickled to another process (a spawned DataLoader worker) counts for that process, from zero.

    Args:
        path: the store's directory; ``None`` to count in this process only (a cache that no process shares).
    """

    def __init__(self, path: str | None = None) -> None:
        self._file = None if path is None else os.path.join(path, _FILE)
        self._lock = threading.Lock()
        self._pid = -1
        self._mine: Any = None  # this process's slot in the shared mapping, or a private array
        self._local = np.zeros(len(FIELDS), dtype=np.int64)  # this process's own counts (its slot may hold more)
        self._map: mmap.mmap | None = None

    def _attach(self) -> None:
        """Take a slot of the file in this process (first event, or first event after a fork)."""
        inherited, self._mine = self._map, None
        if inherited is not None:  # the parent's slot: its lock stays with the parent's own descriptor
            try:
                inherited.close()
            except BufferError:
                pass
        self._pid, self._local[:] = os.getpid(), 0
        self._map, self._mine = None, np.zeros(len(FIELDS), dtype=np.int64)
        if _OFD_SETLK is None or self._file is None:
            return
        try:
            fd = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < _SLOT * _SLOTS:
                os.ftruncate(fd, _SLOT * _SLOTS)  # every process truncates to the same size: harmless
            start = os.getpid() % _SLOTS
            for i in range(_SLOTS):
                slot = (start + i) % _SLOTS
                if _lock_range(fd, slot * _SLOT):
                    # the mapping keeps a duplicate of the descriptor, hence the lock, until the process exits
                    self._map = mmap.mmap(fd, _SLOT * _SLOTS)
                    self._mine = np.frombuffer(self._map, dtype=np.int64, count=len(FIELDS), offset=slot * _SLOT)
                    return
        except OSError:
            pass
        finally:
            os.close(fd)

    def add(self, field: int, n: int = 1) -> None:
        """Add ``n`` to the counter ``FIELDS[field]`` of this process."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        with self._lock:
            if self._pid != os.getpid():
                self._attach()
            self._mine[field] += n
            self._local[field] += n

    def __getstate__(self) -> dict[str, Any]:
        return {"path": None if self._file is None else os.path.dirname(self._file)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def local(self) -> dict[str, int]:
        """The counts of this process (since its first event, in this object)."""
        with self._lock:
            counts = self._local if self._pid == os.getpid() else np.zeros(len(FIELDS), dtype=np.int64)
            return {name: int(v) for name, v in zip(FIELDS, counts)}

    def total(self) -> dict[str, int]:
        """The counts of all processes, dead or alive, that counted in this store (this process's own if unknown)."""
        if self._file is None:
            return self.local()
        try:
            with open(self._file, "rb") as f:
                data = f.read()
        except OSError:
            return self.local()
        n = len(data) // _SLOT
        slots = np.frombuffer(data[: n * _SLOT], dtype=np.int64).reshape(n, _SLOT // 8)[:, : len(FIELDS)]
        sums = slots.sum(axis=0) if n else np.zeros(len(FIELDS), dtype=np.int64)
        return {name: int(v) for name, v in zip(FIELDS, sums)}
