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
Counts of what a runtime cache did (hits, misses, computations, refused items), for this process and, for a store,
for all the processes that used it.

The work of a shared cache happens in processes that the user does not hold on to: DataLoader workers, which exit
at the end of every epoch, and the other ranks of the node. So every process counts into a slot of the store, a file
``.counters/<n>`` that it holds with an exclusive ``flock``, and rewrites it at every event (one ``pwrite``). A
process that dies releases its slot's lock with it, and the next process to take the slot goes on from its counts:
the sum of the slots keeps the counts of the processes that are gone, and there are never more slots than processes
counting at once. A forked child (a DataLoader worker) takes a slot of its own at its first event.

A dataset counts its own events in this process too, in counts without a slot: the fork's ``CacheDataset`` calls its
store :py:func:`on_behalf` of them, so that each event of the store in that call counts for the dataset as well, and
datasets that share a store (a train and a validation dataset) each report their own.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from typing import Any, Callable

from monai_sharedcache import _flock

FIELDS = ("hits", "misses", "computed", "refused", "reused")
HITS, MISSES, COMPUTED, REFUSED, REUSED = range(len(FIELDS))
SLOTS_DIR = ".counters"
_SLOT = struct.Struct(f"<{len(FIELDS)}q")
_MAX_SLOTS = 4096
_CALLER = threading.local()  # the counts of the caller (a dataset) that a thread's store events count for too


class Counters:
    """
    The counts of this process and, with ``slots`` (which gives the checked directory of the store's slots), of all
    the processes that counted in that store. A copy pickled to another process counts for that process alone.
    """

    def __init__(self, slots: Callable[[], Any] | None = None, persistent: bool = False) -> None:
        self.fields = FIELDS if persistent else FIELDS[:REUSED]  # only a store kept across runs reuses items
        self._slots = slots
        self._lock = threading.Lock()
        self._pid = -1
        self._local = [0] * len(FIELDS)  # the events of this process
        self._slot = [0] * len(FIELDS)  # what its slot holds: the counts of the slot's earlier holders, plus those
        self._held: _flock.Held | None = None
        _ALL.add(self)

    def _attach(self) -> None:
        """Take a slot, at the first event of this process."""
        self._pid, self._local, self._slot, self._held = os.getpid(), [0] * len(FIELDS), [0] * len(FIELDS), None
        try:
            at = self._slots() if self._slots is not None else None
            for i in range(_MAX_SLOTS if at is not None else 0):
                held = _flock.hold(at, str(i))
                if held is not None:
                    data = os.pread(held.fd, _SLOT.size, 0)
                    self._slot = list(_SLOT.unpack(data)) if len(data) == _SLOT.size else self._slot
                    self._held = held
                    return
        except OSError:  # the store is gone or full: this process counts for itself
            pass

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
            return dict(zip(self.fields, mine))

    def total(self) -> dict[str, int]:
        """The counts of all the processes, alive or not, that counted in the store (this process's without one)."""
        sums, found = [0] * len(FIELDS), False
        try:
            at: Any = self._slots() if self._slots is not None else None
            names = at.names() if at is not None else []
        except OSError:
            names = []
        for name in names:
            try:
                got = at.open_checked_stat(name)
            except OSError:
                continue
            if got is not None:
                data = os.pread(got[0], _SLOT.size, 0)
                os.close(got[0])
                if len(data) == _SLOT.size:
                    sums, found = [a + b for a, b in zip(sums, _SLOT.unpack(data))], True
        return dict(zip(self.fields, sums)) if found else self.local()

    def __reduce__(self) -> tuple:
        return Counters, (None, self.fields == FIELDS)


def count(counts: Counters, field: int) -> None:
    """An event of a store, counted in its ``counts`` and in those of the caller that this thread serves, if any."""
    counts.add(field)
    caller = getattr(_CALLER, "counts", None)
    if caller is not None:
        caller.add(field)


class on_behalf:  # noqa: N801 (a context manager, named as contextlib's are)
    """
    Count the events of the stores that this thread uses in the block also in ``of``: the counts of one dataset, which
    shares its store with others (a train and a validation dataset, say). A class, not a generator: a hit pays for it.
    """

    __slots__ = ("of", "outer")

    def __init__(self, of: Counters) -> None:
        self.of: Counters | None = of
        self.outer: Counters | None = None

    def __enter__(self) -> None:
        self.outer = getattr(_CALLER, "counts", None)
        _CALLER.counts = self.of

    def __exit__(self, *exc: object) -> None:
        _CALLER.counts = self.outer


def reset(at: Any) -> None:
    """Remove the slots of the store's directory of slots ``at`` that no live process holds: a new session's start."""
    for name in at.names():
        held = _flock.hold(at, name)
        if held is not None:
            try:
                at.unlink(name)
            except OSError:
                pass
            held.close()


def _after_fork_in_child() -> None:
    for counts in list(_ALL):
        counts._lock = threading.Lock()  # another thread may have held it at the fork


_ALL: weakref.WeakSet[Counters] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):  # a module of the store, imported at a store's first use: never by `import monai`
    os.register_at_fork(after_in_child=_after_fork_in_child)
