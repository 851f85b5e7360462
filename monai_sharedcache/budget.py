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
A cap on a store's size (``max_bytes``), and the budget that a store's creator records for all its users.

A store keeps a reserve free on its file system, each process by itself. The cap holds for the store, not
per process: the bytes and the number of its items are counted in the store (``.used``, read and written under
``flock``), and a writer reserves an item's bytes (and the item, if new) there before it writes, so what one process
writes every other one sees before its next write, and no operation lists the store's directory: the store's
statistics read the count too. What a process killed between its reservation and its item leaves counted can only
make the count too high, never too low. When the count would refuse an item, the store first frees the removed items
that no reader maps any more (a listing of ``.aside``, which holds only those), and counts its items again only if a
writer died since (its file in ``.writes`` is unlocked: the kernel's locks tell) or the last recount is older than
``RECOUNT_SECONDS``: never at every put, however many processes write at the cap.
"""

from __future__ import annotations

import errno
import json
import numbers
import os
import secrets
import struct
import time
from typing import Any, Callable

from monai_sharedcache import _flock

ENV_MAX_BYTES = "MONAI_CACHE_MAX_BYTES"  # the cap of new stores, in bytes
BUDGET_FILE = ".budget"  # {"reserve": ..., "max_bytes": ...}, as the creator recorded them
USED_FILE = ".used"
RECORDS_DIR = ".records"  # budget records being written, each locked by its writer
WRITES_DIR = ".writes"  # a file per write under way, locked by its writer, named with what it counted
_USED = struct.Struct("<qqqd")  # bytes, items, the number of changes, and the time of the last recount
RECOUNT_SECONDS = 30.0  # at the cap, the items are counted anew at most this often, unless a writer died
_LIMIT = 4096  # bytes of a budget record read at most: it is small


def check_bytes(name: str, value: Any) -> int | None:
    """``value`` as a number of bytes (numpy's integers too), or ``None``.

    Raises:
        ValueError: ``value`` is not ``None`` nor a non-negative integer.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be None or a non-negative integer number of bytes, got {value!r}.")
    return int(value)


def env_bytes(name: str) -> int | None:
    """The number of bytes in the environment variable ``name``, if set.

    Raises:
        ValueError: it is set and is not a number of bytes.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()):  # int() would take other digits, such as superscripts
        raise ValueError(f"{name}={value!r} must be a non-negative number of bytes.")
    return int(value)


def record(tmp: Any, at: Any, reserve: int | None, max_bytes: int | None) -> None:
    """
    Record the budget of the store whose directory is ``at``, in place of what was recorded: written in ``tmp``
    (the store's ``.records``), held while written, synced, then renamed. A file that a killed writer left there is
    unlocked: the store removes it when it starts a session.
    """
    new = f"{BUDGET_FILE}-{os.getpid()}-{secrets.token_hex(8)}"
    while True:
        held = _flock.hold(tmp, new)
        if held is None:
            raise OSError(errno.EEXIST, "a budget record of that name is held", new)
        if os.fstat(held.fd).st_nlink:
            break
        held.close()  # a run that started meanwhile took it for a killed run's, before it was locked: made anew
    try:
        os.write(held.fd, json.dumps({"reserve": reserve, "max_bytes": max_bytes}).encode())
        os.fsync(held.fd)
        os.replace(new, BUDGET_FILE, src_dir_fd=tmp.fd, dst_dir_fd=at.fd)
    except BaseException:
        try:
            tmp.unlink(new)
        except OSError:
            pass
        raise
    finally:
        held.close()


def recorded(at: Any) -> tuple[int | None, int | None]:
    """The ``(reserve, max_bytes)`` recorded in the store ``at``; ``None`` for what cannot be read or is not a number."""
    try:
        found = at.open_checked_stat(BUDGET_FILE)
        if found is None:
            return None, None
        with os.fdopen(found[0], "rb") as f:
            data = json.loads(f.read(_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    values = []
    for name in ("reserve", "max_bytes"):
        try:
            values.append(check_bytes(name, data.get(name)))
        except ValueError:
            values.append(None)
    return values[0], values[1]


class Used:
    """The count of a store's bytes (its writes under way included) and items, for all its processes."""

    def __init__(
        self,
        at: Callable[[], Any],
        recount: Callable[[], tuple[int, int]],
        dead: Callable[[], bool],
        free: Callable[[], int],
    ) -> None:
        self.at, self.recount = at, recount  # the store's directory; its items and writes under way, counted in it
        self.dead = dead  # whether a writer died since its reservation: what it reserved is counted still
        self.free = free  # frees the removed items that nothing maps any more: their bytes

    def _lock(self) -> _flock.Held:
        held = _flock.hold(self.at(), USED_FILE, wait=60.0)  # per call: threads too are kept apart by flock
        if held is None:
            raise OSError(errno.EAGAIN, "the count of the store's bytes stays locked", USED_FILE)
        return held

    def _read(self, fd: int) -> tuple[int, int, int, float] | None:
        data = os.pread(fd, _USED.size, 0)
        return _USED.unpack(data) if len(data) == _USED.size else None

    def read(self, dead: Callable[[], bool]) -> tuple[int, int]:
        """
        The bytes and the number of items counted, read from the count: no item is listed or stat'ed. The store is
        counted anew (once: a recount removes what the dead left) only if the count is off: without a count yet, whose
        items no write ever counted, or if ``dead()``, a writer killed since its reservation.

        Raises:
            OSError: the count cannot be locked, read or written.
        """
        held = self._lock()
        try:
            found = self._read(held.fd)
            if found is not None and not dead():
                return found[0], found[1]
            used, n = self.recount()
            os.pwrite(held.fd, _USED.pack(used, n, (found[2] if found else -2) + 1, time.time()), 0)
            return used, n
        finally:
            held.close()

    def remove(self, remove: Callable[[], tuple[int, int]]) -> None:
        """
        ``remove()`` the items it removes, and the bytes and number that it returns, under the count's lock: a recount
        made meanwhile by another process never sees them gone before they are subtracted (which would count them out
        twice, and let the store pass its cap).

        Raises:
            OSError: the count cannot be locked (``remove`` is not called).
        """
        held = self._lock()
        try:
            nbytes, items = remove()
            found = self._read(held.fd)
            if found is not None and (nbytes or items):
                used, n, changes, recounted = found
                os.pwrite(held.fd, _USED.pack(max(0, used - nbytes), max(0, n - items), changes + 1, recounted), 0)
        finally:
            held.close()

    def add(
        self, nbytes: int, items: int = 0, cap: int | None = None, made: Callable[[], object] | None = None
    ) -> tuple[bool, int]:
        """
        Add ``nbytes`` (negative: removed) and ``items`` unless the bytes would pass ``cap``, then ``made()`` under the
        lock: whether they were added, and the bytes counted before. Past ``cap``, the removed items that nothing
        maps are freed first, and the items are counted anew if a writer died or the last recount is old.

        Raises:
            OSError: the count cannot be opened, read or written.
        """
        held = self._lock()
        try:
            found = self._read(held.fd)
            if found is None:
                used, n, changes, recounted = (*self.recount(), -1, time.time())
            else:
                used, n, changes, recounted = found
            if cap is not None and used + nbytes > cap:
                used = max(0, used - self.free())
                if self.dead() or time.time() - recounted > RECOUNT_SECONDS:
                    (used, n), changes, recounted = self.recount(), changes + 1, time.time()
            fits = cap is None or used + nbytes <= cap
            if fits and (nbytes or items):
                changes += 1
            new = _USED.pack(max(0, used + nbytes * fits), max(0, n + items * fits), changes, recounted)
            os.pwrite(held.fd, new, 0)
            if fits and made is not None:
                try:
                    made()
                except BaseException:
                    os.pwrite(held.fd, _USED.pack(used, n, changes, recounted), 0)  # not made: not counted
                    raise
            return fits, used
        finally:
            held.close()
