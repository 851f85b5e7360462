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
The Linux fast path of ``monai_sharedcache.SharedCacheStore`` reads: a per-process pool of private mappings of
item files, reused with their page tables.

A read through a fresh mapping pays a page fault for every page the reader touches, and an ``munmap`` at the end:
for a random crop of a large image, most of a hit's cost (`benchmarks/bench_hits.py` measures it
with the pool and without). When all the views of a mapping are gone and
none of its pages was written (checked in the page tables, :py:mod:`monai_sharedcache._pages`), this process keeps
the mapping for the next read of the same unchanged file; a mapping reused once is populated and write-watched, so
later hits take no fault. A written mapping is always unmapped, so every reader still gets a private, pristine copy.

It needs Linux (``/proc/self/pagemap``) and libc's ``mmap`` through ``ctypes``, and turns itself off elsewhere, or
with ``MONAI_CACHE_FAST_PATH=0``: reads then map each file afresh (the store's plain reads).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections import deque
from typing import Any, cast

import numpy as np

from monai_sharedcache import _flock, _locks
from monai_sharedcache import _pages as pages

_LIBC: Any = None
_LIBC_LOADED = False


def _libc() -> Any:
    """libc's mmap/munmap/madvise through ctypes (POSIX), or None (Windows)."""
    global _LIBC, _LIBC_LOADED
    if not _LIBC_LOADED:
        _LIBC_LOADED = True
        if os.name == "posix":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_long,
                ]
                libc.munmap.restype = ctypes.c_int
                libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                libc.madvise.restype = ctypes.c_int
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.syscall.restype = ctypes.c_long
                _LIBC = libc
            except (OSError, AttributeError):
                _LIBC = None
    return _LIBC


class _MappingPool:
    """
    Private mappings of item files that a later read in this process may take over, with their page tables.

    A fresh mapping costs a page fault for every page a reader touches, and an ``munmap`` at the end; for a random
    crop of a large image that is most of a hit's cost. A mapping whose views are all gone, and whose pages were
    never written (no copy-on-write page in its page tables), still holds exactly the file's content, so the
    next read of the same file (same path, device, inode, size and modification time) reuses it: no new faults, no
    unmap. A written mapping, or one that cannot be checked (no pagemap), is unmapped as before, so every reader
    still gets a private, pristine copy. The pool is per process and bounded. Kept mappings of files removed or
    replaced since are dropped at a release (checked at most once a second: a ``stat`` per kept mapping), and at
    once when their store is closed or invalidated in this process, so that they do not pin the removed files' pages.
    Until then, a pooled mapping pins its file with a shared ``flock``, which the mapping itself holds (see
    :py:func:`monai_sharedcache._flock.pin`): the store that removes a pinned item moves it aside and counts its bytes
    until no process pins it, as an idle process can keep a mapping for long.

    Releases come from ``__del__``, which the garbage collector may run anywhere, even inside this pool's own
    critical section: they are only queued (a thread-safe ``deque``), and whoever gets the lock without waiting
    processes the queue. Nothing here ever waits for the lock from a finalizer.
    """

    MAX_MAPPINGS = 32
    SWEEP_EVERY = 1.0  # seconds between two checks that the kept mappings' files are still there
    MIN_SIZE = 8 << 20  # smaller mappings are cheaper to make again than to check in the pagemap

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple, list[tuple[int, int, int]]] = {}  # (addr, size, state)
        self._order: list[tuple[tuple, int, int, int]] = []  # oldest first, for eviction
        self._queue: deque = deque()  # ("release", libc, ident, addr, size, state) or ("purge", path prefix)
        self._swept = 0.0
        self._libc: Any = None

    def take(self, ident: tuple) -> tuple[int, int] | None:
        """A kept mapping of the file ``ident`` and its state (see :py:func:`monai_sharedcache._pages.keep`), or None."""
        with self._lock:  # never called from a finalizer; a finalizer run in here only queues
            free = self._free.get(ident)
            found = None
            if free:
                addr, size, state = free.pop()
                if not free:
                    del self._free[ident]
                self._order.remove((ident, addr, size, state))
                found = addr, state
        self.drain()
        return found

    def release(self, libc: Any, ident: tuple | None, addr: int, size: int, state: int) -> None:
        """Keep an unwritten mapping of a file that still exists for reuse; unmap anything else. Never blocks."""
        self._libc = libc
        self._queue.append(("release", libc, ident, addr, size, state))
        self.drain()

    def purge(self, prefix: str) -> None:
        """Unmap the kept mappings of files under ``prefix`` (a closed or invalidated store). Never blocks."""
        self._queue.append(("purge", prefix))
        self.drain()

    def drain(self) -> None:
        while self._queue:
            if not self._lock.acquire(blocking=False):
                return  # the holder (this thread re-entered by the collector, or another thread) drains the queue
            try:
                while self._queue:
                    self._process(self._queue.popleft())
            finally:
                self._lock.release()

    def _process(self, job: tuple) -> None:
        unmap: list[tuple[int, int]] = []
        if job[0] == "release":
            _, libc, ident, addr, size, state = job
            state = pages.keep(libc, addr, size, state) if ident is not None and _is_current(ident) else pages.UNMAP
            if state == pages.UNMAP:
                unmap.append((addr, size))
            else:
                self._free.setdefault(ident, []).append((addr, size, state))
                self._order.append((ident, addr, size, state))
            stale = []
            if time.monotonic() - self._swept >= self.SWEEP_EVERY:  # a stat per kept mapping: not at every release
                self._swept = time.monotonic()
                stale = [entry for entry in self._order if not _is_current(entry[0])]
        else:
            prefix = job[1]
            stale = [entry for entry in self._order if entry[0][0].startswith(prefix)]
        keep = [entry for entry in self._order if entry not in stale]
        keep = keep[max(0, len(keep) - self.MAX_MAPPINGS) :]
        for entry in self._order:
            if entry not in keep:
                free = self._free[entry[0]]
                free.remove(entry[1:])
                if not free:
                    del self._free[entry[0]]
                unmap.append(entry[1:3])
        self._order = keep
        for addr, size in unmap:
            self._libc.munmap(addr, size)

    def after_fork_in_child(self) -> None:
        """
        Start afresh in a forked child (a DataLoader worker). Another thread of the parent may have held the lock,
        in the middle of an update, when the process forked: in the child that thread does not exist, so the lock
        would never be released and the lists may disagree. The child forgets the kept mappings (it still has its
        own private copies of them, which it leaves mapped: unmapping after a torn update could unmap a mapping
        in use) and takes a new lock.
        """
        self._lock = threading.Lock()
        self._free = {}
        self._order = []
        self._queue = deque()
        pages.WATCH.after_fork_in_child()


POOL = _MappingPool()


def __getattr__(name: str) -> Any:
    """``ENABLED``, decided at its first use (a store's first read), never at import: nothing loads libc before."""
    if name != "ENABLED":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # the one place that decides: Linux (page tables in /proc/self/pagemap), fcntl's ioctl (the store's platform
    # decision) and libc's mmap, unless turned off
    enabled = sys.platform.startswith("linux") and os.environ.get("MONAI_CACHE_FAST_PATH", "1") != "0"
    enabled = enabled and _locks.AVAILABLE
    globals()["ENABLED"] = enabled = enabled and _libc() is not None
    if enabled and hasattr(os, "register_at_fork"):  # the pool is used from now on
        os.register_at_fork(after_in_child=POOL.after_fork_in_child)
    return enabled


def _is_current(ident: tuple) -> bool:
    """Whether the file a mapping was made of, ``(path, device, inode, size, mtime)``, is still at its path."""
    path, dev, ino, size, mtime = ident
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (dev, ino, size, mtime)


class _PrivateMapping:
    """Owner of a ``MAP_PRIVATE`` file mapping made through libc; recycled or unmapped when its last view is gone."""

    def __init__(self, libc: Any, addr: int, size: int, ident: tuple | None, state: int) -> None:
        self._libc, self._addr, self._size, self._ident, self._state = libc, addr, size, ident, state
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (addr, False), "version": 3}

    def __del__(self) -> None:
        try:
            POOL.release(self._libc, self._ident, self._addr, self._size, self._state)
        except Exception:
            pass


def map_private(fd: int, size: int, ident: tuple | None = None) -> memoryview:
    """
    A writable, private, copy-on-write mapping of the whole file ``fd``; the caller may close ``fd`` at once.

    ``ident`` (path, device, inode, size, modification time) lets an unwritten mapping of the same file be reused.
    """
    libc = _libc()
    if size < POOL.MIN_SIZE:
        ident = None  # not pooled: unmapped with its last view
    found = POOL.take(ident) if ident is not None else None
    if found is None:
        if ident is not None and not _flock.pin(fd):
            ident = None  # being removed: not pooled
        prot = mmap.PROT_READ | mmap.PROT_WRITE  # type: ignore[attr-defined]
        addr = libc.mmap(None, size, prot, mmap.MAP_PRIVATE, fd, 0)  # type: ignore[attr-defined]
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        found = addr, 0
    return memoryview(cast(Any, np.asarray(_PrivateMapping(libc, found[0], size, ident, found[1]))))
