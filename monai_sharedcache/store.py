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
The fork's :py:class:`SharedCacheStore`: the core's store (:py:class:`monai.data.cache_store.SharedCacheStore`) with

- the Linux fast path of :py:mod:`monai_sharedcache._pool`, which reuses the private mapping of an unchanged item file
  with its page tables, so that a hit of a large item takes no page fault; where it is off (not Linux, no libc,
  ``MONAI_CACHE_FAST_PATH=0``), it reads as the core's store does;
- on a memory-backed file system, the room that the memory limit of this process's cgroup leaves
  (:py:mod:`monai_sharedcache._memory`), which the reserve is kept of when it is less than the file system's;
- a cap on the store's size, ``max_bytes``, and a budget that the creator records for all users
  (:py:mod:`monai_sharedcache.budget`);
- ``persistent=True``: a store kept in a directory across runs (:py:mod:`monai_sharedcache.persist`);
- statistics of hits, misses, computed and refused items, for all the processes of a store
  (:py:mod:`monai_sharedcache.counters`);
- small notes that its processes keep for each other (which cached transforms cache which inputs), and records kept
  across the runs of a persistent store (the digests of input files), which the fork's keys
  (:py:mod:`monai_sharedcache.keys`) keep there: JSON files in its own directories ``.notes`` and ``.kept``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable
from typing import Any, cast

from monai.data import cache_store, shared_cache
from monai_sharedcache import _flock
from monai_sharedcache import _memory as memory
from monai_sharedcache import _pool as pool
from monai_sharedcache import budget, checksum, counters, persist

__all__ = ["SharedCacheStore", "create_shared_cache"]

_NOTES = ".notes"  # the store's own directories: of the notes of its processes (add_note), and of
_KEPT = ".kept"  # the records that a persistent store keeps across runs (keep)
_TURNS = ".turns"  # a lock per stripe of item files: their writers and removers take turns
_STRIPES = 128  # few enough that a removal of many items holds them all at once, under `ulimit -n 1024`
_ASIDE = ".aside"  # removed items that a mapping kept by some process still pins: counted until it is released
_NAME = re.compile(r"[0-9A-Za-z_-]{1,128}")
_NO_ROOM = {errno.ENOSPC, errno.EROFS, getattr(errno, "EDQUOT", -1)}  # a file system without room, or a quota
_OWN = (
    budget.BUDGET_FILE,
    budget.USED_FILE,
    budget.WRITES_DIR,
    budget.RECORDS_DIR,
    persist.SESSION,
    persist.USERS,
    ".evict",
    counters.SLOTS_DIR,
    _NOTES,
    _KEPT,
    _TURNS,
    _ASIDE,
)
_MISS = object()


def _attach(core: Callable[..., Any], args: tuple, max_bytes: int | None, session: int | None) -> SharedCacheStore:
    """Unpickle a store as the core does (without participating), then set the layer's part up."""
    store = cast(SharedCacheStore, core(*args))
    store._setup_layer(max_bytes, session)
    return store


class SharedCacheStore(cache_store.SharedCacheStore):
    """
    :py:class:`monai.data.cache_store.SharedCacheStore`, whose reads of large items reuse their mappings on Linux,
    whose reserve counts the cgroup's memory limit on a memory-backed file system, with a cap on its size, statistics,
    and stores kept across runs.

    ``from monai.data import SharedCacheStore`` gives this class in the fork's wheel. Its other arguments, pickling and
    guarantees are the core store's: see there.

    With ``persistent=True``, the store is kept in the directory ``path`` across runs (see "Keeping the cache across
    runs" in the caching guide): a later run that opens the same path reuses every item whose key matches (the key
    that ``CacheDataset`` gives and the MONAI version). Items are written to disk (``fsync``) before they are published,
    so whatever a killed run had finished is reused whole. Past ``reserve`` or ``max_bytes``, the items that earlier
    runs used least recently are removed to make room; those of the current run are kept, and new ones refused.

    Args:
        path: the directory of an existing store to join; ``None`` to make a new store. With ``persistent=True``, the
            directory to keep the store in, on this machine, made (mode ``0o700``) if missing; ``~`` is expanded.
        root: where to make a new store (see the core's store).
        claim_timeout: see the core's store.
        reserve: bytes to keep free on the store's file system; a new store records it for all its users, who keep
            to it unless they give one. By default ``MONAI_CACHE_RESERVE_BYTES`` if set, else half the file system,
            at most 4 GiB (for a new persistent store, at least a tenth of its file system: a disk holds checkpoints
            and logs too).
        max_bytes: a cap on the total size of the store's items, recorded by a new store for all its users; by
            default ``MONAI_CACHE_MAX_BYTES`` if set, else none.
        persistent: keep the store in ``path`` when its last user leaves, for later runs. With it, ``reserve`` and
            ``max_bytes``, if given, each replace the value that the store recorded, when no other run uses it. A
            store that was made persistent is joined as such without it.
        weights_only: the allow-list of the items' types, as the core's (``False`` reads any type, which can run code):
            the types of ``torch.serialization.add_safe_globals`` allowed where the store is made, or by the time that
            it is pickled, are allowed in its DataLoader workers too.

    Raises:
        ValueError: ``max_bytes`` is not a non-negative integer, or is given with ``path`` (without ``persistent``);
            ``persistent=True`` without ``path`` or with ``root``; ``path`` is not empty and holds no persistent
            store, is named like a temporary store (``monai-cache-*``), or is on a network file system.
        PermissionError: with ``persistent=True``, ``path`` or a file of the store's own in it is another user's or
            writable by others, a file of the store's own is a symbolic link, or ``path`` goes through a link that
            another user made or could replace.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            ds = CacheDataset(data, transform, runtime_cache=store)
            kept = SharedCacheStore("/local/cache/brats", persistent=True)  # kept for the next run, made if missing
    """

    _memory: bool | None = None  # whether its items are memory of this process's cgroup (tmpfs)

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        root: str | os.PathLike | None = None,
        claim_timeout: float = 600.0,
        reserve: int | None = None,
        max_bytes: int | None = None,
        persistent: bool = False,
        weights_only: bool = True,
    ) -> None:
        max_bytes = budget.check_bytes("max_bytes", max_bytes)
        env_max = budget.env_bytes(budget.ENV_MAX_BYTES) if persistent or path is None else None  # before any file
        if persistent:
            if path is None or root is not None:
                raise ValueError(
                    "persistent=True needs path, the directory to keep the store in (made if missing), and no root; "
                    f"got path={path!r}, root={root!r}."
                )
            path = os.path.abspath(os.path.expanduser(os.fsdecode(path)))
        elif path is not None and max_bytes is not None:
            raise ValueError(
                f"max_bytes is recorded by a new store for all its users: give it without path, got {path!r}."
            )
        try:
            if persistent:
                path, ident = persist.prepare(cast(str, path))
            super().__init__(path, root=root, claim_timeout=claim_timeout, reserve=reserve, weights_only=weights_only)
            if persistent and (self.directory.ident.st_dev, self.directory.ident.st_ino) != ident:
                self.close()  # a component was replaced since it was resolved
                raise PermissionError(f"SharedCacheStore: refusing {path!r}: it changed while it was opened.")
        except OSError as err:  # a full or read-only file system: the job goes on without the cache
            if path is None or isinstance(err, PermissionError) or err.errno not in _NO_ROOM:
                raise
            vars(self).update(vars(self.uncached(os.path.abspath(os.fspath(path)), err)))  # __init__ returns no object
            self._setup_layer(None, None)
            return
        self._setup_layer(max_bytes, None)
        at = self._at()
        if at is None:  # no room to make it, or gone: nothing of the layer's to open
            return
        if persistent or _exists(at, persist.USERS) or _exists(at, persist.SESSION):  # joined without the flag too
            self._open_persistent(reserve, max_bytes, env_max)
        elif path is None:
            self.max_bytes = max_bytes = env_max if max_bytes is None else max_bytes
            try:
                budget.record(self.subdir(budget.RECORDS_DIR), at, self.reserve, max_bytes)
            except OSError as err:
                self._fault_layer("cannot record the budget", err)
        else:
            recorded = budget.recorded(at)
            self.reserve = recorded[0] if reserve is None else self.reserve
            self.max_bytes = recorded[1]

    def _at(self) -> Any:
        """The store's checked directory, or ``None`` if the store is closed or gone."""
        try:
            return self.directory
        except OSError:
            return None

    def _setup_layer(self, max_bytes: int | None, session: int | None) -> None:
        self.max_bytes, self._session = max_bytes, session  # session: the start of a persistent store's current one
        self.durable = self._evictable = session is not None
        self._room = threading.local()  # per thread: the bytes that its put reserved in the count, the file it reads
        self._writes_dir: Any = None
        self._turns_dir: Any = None  # opened once per store object
        self._sums = True  # checksums of a persistent store on a disk, and the files that this process checked
        self._checked: set[tuple[int, int, int, int]] = set()
        self._used = budget.Used(lambda: self.directory, self._recount, lambda: bool(self._writes().names()))
        ref = weakref.ref(self)  # not the store itself: its counts would keep it alive
        slots = lambda: cast(SharedCacheStore, ref()).subdir(counters.SLOTS_DIR)  # noqa: E731
        self._counters = counters.Counters(slots, persistent=session is not None)

    def _open_persistent(self, reserve: int | None, max_bytes: int | None, env_max: int | None) -> None:
        """Use the persistent store whose directory the core has joined: check it, and start or join its session."""
        at = self.directory
        try:
            persist.check_local(self.path)
            persist.check_files(at, _OWN)
            held, first = persist.join(at)
        except BaseException as err:
            self.close()
            if not isinstance(err, OSError) or isinstance(err, PermissionError) or err.errno not in _NO_ROOM:
                raise
            self._fault_layer("cannot open the persistent store", err)
            self._setup_layer(None, None)
            return
        self._users = weakref.finalize(self, held.close)  # at close(), garbage collection or exit
        try:
            if first:  # no other run uses the store: a new session, with the budget given
                self._clean_own_temps()
                self._locked(lambda: (self._free_aside()[0], 0))  # what the mappings of processes gone pinned
                old = budget.recorded(at) if _exists(at, budget.BUDGET_FILE) else None
                if old is None:
                    max_bytes = env_max if max_bytes is None else max_bytes
                    if reserve is None:
                        total = (self.free_space() or (0, 0))[1]
                        reserve = (
                            self.reserve if self.reserve is not None else max(min(total // 2, 4 << 30), total // 10)
                        )
                    budget.record(self.subdir(budget.RECORDS_DIR), at, reserve, max_bytes)
                elif reserve is not None or max_bytes is not None:
                    reserve, max_bytes = old[0] if reserve is None else reserve, (
                        old[1] if max_bytes is None else max_bytes
                    )
                    budget.record(self.subdir(budget.RECORDS_DIR), at, reserve, max_bytes)
                counters.reset(self.subdir(counters.SLOTS_DIR))
                persist.start_session(at)
            else:
                self._tell_other_budget(reserve, max_bytes)
        except OSError as err:  # a full file system: the store is read as it is
            self._fault_layer("cannot start a session of the persistent store", err)
        finally:
            if first:  # the other users wait for the session to start
                persist.joined(held)
        self.reserve, self.max_bytes = budget.recorded(at)
        self._setup_layer(self.max_bytes, persist.session_start(at))

    def _tell_other_budget(self, reserve: int | None, max_bytes: int | None) -> None:
        """Warn if the budget asked for differs from the one that the store's current session keeps to."""
        old = budget.recorded(self.directory)
        asked = {"reserve": (reserve, old[0]), "max_bytes": (max_bytes, old[1])}
        other = [f"{name}={was} (asked: {new})" for name, (new, was) in asked.items() if new is not None and new != was]
        if other:
            warnings.warn(
                f"SharedCacheStore {self.path}: another run uses this persistent store, and its budget holds for this "
                f"run too: {', '.join(other)}. A budget given is recorded when a run opens the store that no other run "
                "uses.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _clean_own_temps(self) -> None:
        """Remove the budget records that killed runs left half written: unlocked files of the layer's own directory."""
        tmp = self.subdir(budget.RECORDS_DIR)
        for name in tmp.names():
            if name.startswith(budget.BUDGET_FILE + "-"):
                held = _flock.hold(tmp, name)
                if held is not None:
                    _unlink(tmp, name)
                    held.close()

    def _fault_layer(self, what: str, err: OSError) -> None:
        self._warn_layer(what, f"{what} ({type(err).__name__}: {err}).")

    def _warn_layer(self, what: str, message: str) -> None:
        token = object()  # once per store, process and fault (a removal of many items may fail for each)
        if self.__dict__.setdefault("_layer_warned", {}).setdefault((os.getpid(), what), token) is not token:
            return
        warnings.warn(f"SharedCacheStore {self.path}: {message}", RuntimeWarning, stacklevel=4)

    @property
    def persistent(self) -> bool:
        """Whether the store is kept across runs."""
        return self._session is not None

    def __reduce__(self) -> tuple:
        core = super().__reduce__()  # with the core's state: the types allowed here
        return _attach, (core[0], core[1], self.max_bytes, self._session), *core[2:]

    def file_stem(self, key: str) -> str:
        return super().file_stem(key + "|" + persist.version_tag() if self._session is not None else key)

    def map_item(self, fd: int, st: os.stat_result, name: str) -> memoryview:
        if not pool.ENABLED:
            return super().map_item(fd, st, name)
        ident = (os.path.join(self.path, name), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return pool.map_private(fd, st.st_size, ident)

    def _in_memory(self) -> bool:
        if self._memory is None:  # decided once per process and store: a store does not move
            self._memory = memory.fs_type(self.path) in memory.MEMORY_FS
        return self._memory

    def sealed(self, fd: int) -> None:
        """A persistent store on a disk records the checksum of an item file before it is published."""
        if self._session is None or not self._sums or self._in_memory():
            return
        try:
            checksum.seal(fd)
        except OSError as err:
            if err.errno not in checksum.UNSUPPORTED:
                raise  # the item is not stored, as after any fault of a write
            self._sums = False
            self._fault_layer("cannot keep checksums with items on this file system: they are read unchecked", err)

    def verified(self, fd: int, st: os.stat_result, view: memoryview) -> bool:
        """
        A persistent store on a disk checks the bytes of an item written by an earlier run at its first read in this
        run; not those that this run wrote, nor those of a store in memory.
        """
        session = self._session
        if session is None or st.st_mtime_ns >= session or self._in_memory():
            return True
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if ident in self._checked:
            return True
        if checksum.check(fd, view, session) is False:
            self._remove_damaged(st)
            what = "found items whose bytes are not those written"
            self._warn_layer(
                what, f"{what} (a damaged disk or file, or not written whole). They are removed, and computed anew."
            )
            return False
        self._checked.add(ident)  # unknown (no attributes here): not asked again either
        return True

    def _remove_damaged(self, st: os.stat_result) -> None:
        """
        Remove the item file that this thread's :py:meth:`get` reads, found damaged, if it is still the file ``st``,
        and count it out: the core would remove it uncounted, and :py:meth:`stats` reads the count.
        """
        name = getattr(self._room, "reading", None)
        if name is None:
            return

        def remove() -> tuple[int, int]:
            try:
                now = self.directory.stat(name)
            except OSError:
                return 0, 0
            size = self._retire(name) if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) else None
            return (0, 0) if size is None else (size, 1)

        turns = self._turns([name])
        try:
            self._locked(remove)
        finally:
            for turn in turns:
                turn.close()

    def free_space(self) -> tuple[int, int] | None:
        space = super().free_space()
        room = memory.cgroup_room() if self._in_memory() else None
        if room is not None and (space is None or room[1] < space[0]):  # the container's memory is the shorter
            return room[1], room[0]
        return space

    def get(self, key: str, default: Any = None) -> Any:
        if self._session is None or self._at() is None:
            return super().get(key, default)
        name = self.file_stem(key) + ".item"
        try:
            before = self.directory.stat(name)  # its use before this read, which may set its access time
        except OSError:
            return default
        self._room.reading = name  # a damaged item is counted out as it is removed (verified)
        try:
            item = super().get(key, _MISS)
        finally:
            self._room.reading = None
        if item is _MISS:
            return default
        if persist.touch(self.directory, name, before, self._session):
            counters.count(self._counters, counters.REUSED)
        return item

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        item = self.get(key, _MISS)
        if item is not _MISS:
            counters.count(self._counters, counters.HITS)
            return item
        counters.count(self._counters, counters.MISSES)
        return super().get_or_compute(key, self._counted(compute))

    def fill(self, key: str, compute: Callable[[], Any], wait: bool = True) -> bool:
        if self._session is not None and self._at() is not None:
            name = self.file_stem(key) + ".item"
            try:  # used by this run: never evicted for its other items
                if persist.touch(self.directory, name, self.directory.stat(name), self._session):
                    counters.count(self._counters, counters.REUSED)
            except OSError:
                pass
        return super().fill(key, self._counted(compute), wait)

    def _counted(self, compute: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            counters.count(self._counters, counters.COMPUTED)
            return compute()

        return counted

    def put(self, key: str, item: Any) -> bool:
        name = self.file_stem(key) + ".item"
        turns = self._turns([name])  # whether this write replaces a copy is known only if writers take turns
        self._room.stripe = _stripe(name) if turns else None  # its turn: this put may evict in its own stripe
        try:
            return self._put(key, item, name)
        finally:
            self._room.stripe = None
            for turn in turns:
                turn.close()

    def _turns(self, names: Iterable[str], wait: float = 60.0) -> list[_flock.Held]:
        """
        The turns of the item files ``names`` (the locks of their stripes, taken in order, before the count's lock):
        each writer and remover of an item counts what it found there. Those not had in ``wait`` seconds, or at all
        (the store is gone, no descriptor is left), are left: the count may then be off until it is made again.
        """
        held: list[_flock.Held] = []
        try:
            if self._turns_dir is None:
                self._turns_dir = self.subdir(_TURNS)
            for stripe in sorted({_stripe(name) for name in names}):
                turn = _flock.hold(self._turns_dir, str(stripe), wait=wait)
                if turn is not None:
                    held.append(turn)
        except OSError:
            pass
        return held

    def _put(self, key: str, item: Any, name: str) -> bool:
        room = self._room
        room.reserved, room.active, room.held, room.uncounted = 0, True, None, False
        before = self._size(name)  # another process's copy of the item, if any: this write replaces it
        room.new = 0 if before else 1  # a new item, counted with its bytes before it is published
        try:
            stored = super().put(key, item)
        finally:
            room.active = False
            if room.held is not None:  # published or not: no longer a write under way
                at, held_name, held = room.held
                _unlink(at, held_name)
                held.close()
        if stored:  # its bytes and itself were counted when they were reserved, unless the count failed then
            self._count((self._size(name) if room.uncounted else 0) - before, room.new if room.uncounted else 0)
        else:
            self._count(-room.reserved, -room.new if room.reserved else 0)
            counters.count(self._counters, counters.REFUSED)
        return stored

    def room_for(self, nbytes: int) -> str | None:
        """
        As the core's, and past ``max_bytes``; called by :py:meth:`put`, it counts the item's bytes in the store when
        they fit. A persistent store first makes room by removing the items of earlier runs that were used least
        recently.
        """
        why = self._room_for(nbytes)
        if why is not None and self._evictable and self._session is not None:
            evicted: list = []

            def evict() -> tuple[int, int]:
                freed = self._free_aside()[0]
                found = persist.evict(
                    self.directory, cast(int, self._session), lambda f: self._excess(f, nbytes), self._evict_one
                )
                evicted.append(found)
                removed, gone = found or (0, 0)
                return freed + removed, gone

            self._locked(evict)
            self._evictable = bool(evicted) and evicted[0] is not None
            if evicted and evicted[0]:
                why = self._room_for(nbytes)
        return why

    def _room_for(self, nbytes: int) -> str | None:
        why = super().room_for(nbytes)
        if why is not None or not getattr(self._room, "active", False):
            return why
        try:
            new = self._room.new
            fits, used = self._used.add(nbytes, new, cap=self.max_bytes, made=lambda: self._under_way(nbytes, new))
        except OSError as err:  # without a count, a cap cannot hold; else the item is counted once written
            self._room.uncounted = True
            return None if self.max_bytes is None else f"the count of its bytes cannot be updated ({err})"
        if not fits:
            return f"the store holds {used / 2**20:.0f} MiB and its cap is max_bytes={self.max_bytes}"
        self._room.reserved = nbytes
        return None

    def _under_way(self, nbytes: int, new: int) -> None:
        """
        Under the count's lock, once the bytes of this thread's write (and the item, if ``new``) are counted: a file
        that holds them in its name, locked until the write is done, so that a recount counts the writes under way,
        and no other.
        """
        at, name = self._writes(), f"{secrets.token_hex(8)}-{new}-{nbytes}"
        held = _flock.hold(at, name)
        if held is None:
            raise OSError(errno.EEXIST, "a write of that name is under way", name)
        self._room.held = (at, name, held)

    def _writes(self) -> Any:
        if self._writes_dir is None:  # opened once per store object: a write pays no check of it
            self._writes_dir = self.subdir(budget.WRITES_DIR)
        return self._writes_dir

    def _excess(self, found: list, nbytes: int) -> int:
        """The bytes to remove for an item of ``nbytes`` to fit, of the items ``found`` in the store."""
        excess = 0 if self.max_bytes is None else sum(f[2] for f in found) + nbytes - self.max_bytes
        space = self.free_space()
        if space is not None:  # the core's default reserve, where none was recorded
            reserve = min(space[1] // 2, 4 << 30) if self.reserve is None else self.reserve
            excess = max(excess, reserve - (space[0] - nbytes))
        return excess

    def _count(self, nbytes: int, items: int = 0) -> None:
        try:
            if (nbytes or items) and self._at() is not None:
                self._used.add(nbytes, items)
        except OSError:  # the next write finds out what is wrong
            pass

    def _size(self, name: str) -> int:
        try:
            return self.directory.stat(name).st_size
        except OSError:
            return 0

    def _dead_writes(self) -> bool:
        """
        Whether a writer was killed between its reservation and the end of its write (its file in ``.writes`` is not
        locked): what it reserved is counted still. Under the count's lock, where no write file is made.
        """
        try:
            at = self._writes()
            names = at.names()
        except OSError:
            return False
        for name in names:
            try:
                fd = at.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # never made here: gone, it is done
            except OSError:
                continue
            try:
                if _flock.take(fd):
                    return True
            finally:
                os.close(fd)
        return False

    def _recount(self) -> tuple[int, int]:
        """
        The bytes and the number of the store's items, counted in its directory, and those of the writes under way
        (``<token>-<new item: 0 or 1>-<bytes>``); the files of dead writers are removed (they wrote nothing).
        """
        nbytes = items = 0
        try:
            at = self._writes()
            names = at.names()
        except OSError:
            names = []
        for name in names:
            try:
                held = _flock.hold(at, name)
            except OSError:  # counted, as if alive: never too low
                held = None
            if held is None:  # its writer is alive
                parts = name.split("-")
                nbytes += int(parts[-1]) if parts[-1].isdigit() else 0
                items += len(parts) == 3 and parts[1] == "1"
            else:
                _unlink(at, name)
                held.close()
        # the items after the writes: a write that ends in between (published, then its file unlinked) is counted
        # twice, never missed
        found = persist.items(self.directory)
        return nbytes + sum(f[2] for f in found) + self._free_aside()[1], items + len(found)

    def _free_aside(self) -> tuple[int, int]:
        """The bytes of removed items freed now that no mapping pins them, and those still pinned."""
        try:
            return _flock.free_aside(self.subdir(_ASIDE)) if _exists(self.directory, _ASIDE) else (0, 0)
        except OSError:
            return 0, 0

    def _evict_one(self, name: str) -> int | None:
        """Remove the item file ``name`` for room, unless another writer of its stripe is at work."""
        if _stripe(name) == getattr(self._room, "stripe", None):  # this put's turn, which is this thread's
            return self._retire(name)
        turns = self._turns([name], wait=0.0)  # without waiting: this thread holds the count's lock
        if not turns:
            return None
        try:
            return self._retire(name)
        finally:
            turns[0].close()

    def _retire(self, name: str) -> int | None:
        """Remove the item file ``name``: the bytes freed (0 while a mapping pins it), ``None`` if it was not there."""
        try:
            return _flock.retire(self.directory, name, lambda: self.subdir(_ASIDE))
        except FileNotFoundError:
            return None
        except OSError as err:
            self._fault_layer("cannot remove items", err)
            return None

    def discard(self, keys: Iterable[str]) -> None:
        names = [self.file_stem(key) + ".item" for key in keys]
        if names and self._at() is not None:
            self._purge()  # this process's kept mappings first: they would pin the items' pages
            self._remove(names)

    def _remove(self, names: list[str]) -> None:
        """Remove the item files ``names``, in their turns, and count them out."""

        def remove() -> tuple[int, int]:
            freed, gone = self._free_aside()[0], 0
            for name in names:
                size = self._retire(name)
                if size is not None:
                    freed, gone = freed + size, gone + 1
            return freed, gone

        turns = self._turns(names)
        try:
            self._locked(remove)
        finally:
            for turn in turns:
                turn.close()

    def clear(self) -> None:
        """Remove every item of the store, of any dataset or run; processes that use it go on, and miss."""

        self._purge()
        if self._at() is not None:
            self._remove([name for _, _, _, name in persist.items(self.directory)])

    def _locked(self, remove: Callable[[], tuple[int, int]]) -> None:
        """``remove()`` items under the count's lock, and count them out; without a count, remove them all the same."""
        try:
            self._used.remove(remove)
        except OSError:
            remove()

    def count(self, keys: Iterable[str]) -> int:
        """The number of ``keys`` whose item is stored now (one ``stat`` each): a dataset's share of the store."""
        if self._at() is None:
            return 0
        return sum(_exists(self.directory, self.file_stem(key) + ".item") for key in keys)

    def stats(self) -> dict[str, int | None]:
        """
        The store's numbers, read from its counts: whatever the store's size, no item is listed or stat'ed, except by
        the one recount that follows a writer killed in the middle of a write (what it had reserved is counted still).

        Returns:
            ``{"filled": the number of items stored (with the new ones being written), "nbytes": the bytes that
            they occupy (with those of the writes under way, and of removed items that a mapping still pins), "hits",
            "misses": reads by get_or_compute that found or missed their item, "computed": items computed by
            get_or_compute and fill, "refused": items computed but not stored (budget or fault)}``; the counts are
            those of all the processes that used the store, gone ones included. A persistent store counts since its
            current run began (its first user after none), and adds ``"reused"``: the items written by an earlier
            run that this run used. ``filled`` and ``nbytes`` are ``None`` if the count cannot be read.
        """
        filled: int | None = 0
        nbytes: int | None = 0
        if self._at() is not None:
            try:
                nbytes, filled = self._used.read(self._dead_writes)
            except OSError:
                nbytes = filled = None
        return {"filled": filled, "nbytes": nbytes, **self._counters.total()}

    def process_stats(self) -> dict[str, int]:
        """
        Returns:
            the counts of :py:meth:`stats` for this process alone (each DataLoader worker counts for itself).
        """
        return self._counters.local()

    def close(self) -> None:
        super().close()
        self._counters.close()
        if getattr(self, "_users", None) is not None:
            self._users()
        self._purge()

    def _purge(self) -> None:
        pool.POOL.purge(os.path.join(self.path, ""))

    def add_note(self, name: str, note: Any) -> bool:
        """
        Keep ``note`` (JSON) under ``name`` for the other processes of the store, unless a note of that name is kept
        already; whether this call kept it. A note is advice: a store that is gone keeps none, and a persistent store
        none either (its notes would outlive the run). The fork's ``CacheDataset`` notes with which cached transforms
        each process caches its inputs.

        Raises:
            ValueError: ``name`` is not 1 to 128 letters, digits, ``_`` or ``-``.
            TypeError: JSON cannot store ``note``.
        """
        _check(name)
        data = json.dumps(note).encode()  # before the file is made: no note is left half written by a TypeError
        if self.persistent:
            return False
        try:
            at = self.subdir(_NOTES)
            fd = at.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError:  # kept already, or the store is gone
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError:  # a full file system: no half note left to block the name
            _unlink(at, name)
            return False
        return True

    def notes(self, prefix: str = "") -> dict[str, Any]:
        """The notes kept by :py:meth:`add_note` under names that start with ``prefix`` (none that is being written)."""
        found: dict[str, Any] = {}
        try:
            at = self.subdir(_NOTES)
            names = [name for name in at.names() if name.startswith(prefix) and _NAME.fullmatch(name)]
        except OSError:
            return found
        for name in names:
            try:
                read = _read(at, name)
                if read is not None:
                    found[name] = json.loads(read[0])
            except (OSError, ValueError, RecursionError):  # gone, being written, or damaged: no note
                pass
        return found

    def discard_note(self, name: str) -> None:
        """Remove the note ``name`` of :py:meth:`add_note`, if kept."""
        if _NAME.fullmatch(name) and not self.persistent:
            try:
                _unlink(self.subdir(_NOTES), name)
            except OSError:
                pass

    def keep(self, name: str, value: Any) -> None:
        """
        Keep ``value`` (JSON) under ``name`` across the runs of a persistent store, in place of what was kept under
        it, whole (a new file renamed over the old one); a store that is not persistent keeps nothing. The fork's
        ``CacheDataset`` keeps the digests of its input files there, so that a new run reads no unchanged file again.

        Raises:
            ValueError: ``name`` is not 1 to 128 letters, digits, ``_`` or ``-``.
            TypeError: JSON cannot store ``value``.
        """
        _check(name)
        data = json.dumps(value).encode()
        if not self.persistent:
            return
        new = f".new-{name}-{secrets.token_hex(8)}"  # never a record's name: a dot
        try:
            at = self.subdir(_KEPT)
            try:
                with os.fdopen(at.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                    f.write(data)
                os.replace(new, name, src_dir_fd=at.fd, dst_dir_fd=at.fd)  # replaces a link, never writes through it
            finally:
                _unlink(at, new)
        except OSError:  # a record is advice: the store goes on without it
            pass

    def kept(self, name: str) -> Any:
        """What :py:meth:`keep` kept under ``name``, in this run or an earlier one; ``None`` if nothing (or unreadable,
        or a name that :py:meth:`keep` refuses)."""
        if not self.persistent or not _NAME.fullmatch(name):
            return None
        try:
            read = _read(self.subdir(_KEPT), name)
            return None if read is None else json.loads(read[0])
        except (OSError, ValueError, RecursionError):  # a damaged record is none
            return None


def _check(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"a note's or record's name is 1 to 128 letters, digits, '_' or '-', got {name!r}.")


def _stripe(name: str) -> int:
    return zlib.crc32(name.encode()) % _STRIPES


def _unlink(at: Any, name: str) -> None:
    try:
        at.unlink(name)
    except OSError:
        pass


def _exists(at: Any, name: str) -> bool:
    try:
        at.stat(name)
        return True
    except FileNotFoundError:
        return False


def _read(at: Any, name: str, limit: int = 1 << 20) -> tuple[bytes, os.stat_result] | None:
    """The first ``limit`` bytes of the file ``name`` of ``at`` and its status, if a private file of this user."""
    found = at.open_checked_stat(name)
    if found is None:
        return None
    with os.fdopen(found[0], "rb") as f:
        return f.read(limit), found[1]


def create_shared_cache(
    group: Any = None,
    *,
    max_bytes: int | None = None,
    path: str | os.PathLike | None = None,
    persistent: bool = False,
    **kwargs: Any,
) -> SharedCacheStore:
    """
    :py:func:`monai.data.shared_cache.create_shared_cache`, whose stores are this module's :py:class:`SharedCacheStore`
    (``from monai.data import create_shared_cache`` gives this function in the fork's wheel).

    Args:
        group: the process group whose ranks share one store per node; ``None`` for the default group.
        max_bytes: a cap on the total size of each node's store (the value of the lowest rank of each node counts).
        path: with ``persistent=True``, the directory of each node's store, kept across runs (the value of the lowest
            rank of each node counts). It must be on the node: on a file system that several nodes share, give each
            node a path of its own, such as ``f"/shared/cache/{socket.gethostname()}"``.
        persistent: keep each node's store in ``path`` for later runs, see :py:class:`SharedCacheStore`.
        kwargs: the other arguments of the core's ``create_shared_cache``.

    Returns:
        this rank's handle of its node's store.

    Raises:
        ValueError: ``path`` and ``persistent=True`` are not given together, or with ``root``; ``max_bytes`` is not
            a non-negative integer; and as the core's function raises.
    """
    max_bytes = budget.check_bytes("max_bytes", max_bytes)  # on every rank, before any collective
    if (path is None) == bool(persistent) or (persistent and kwargs.get("root") is not None):
        raise ValueError(
            "create_shared_cache: path (the directory of a store kept across runs) goes with persistent=True, and "
            f"root (where temporary stores are made) without it; got path={path!r}, persistent={persistent!r}, "
            f"root={kwargs.get('root')!r}."
        )

    def make(joined: str | None = None, *, root: Any = None, reserve: int | None = None) -> SharedCacheStore:
        if joined is not None:  # the other ranks of the node join the store of its lowest rank
            return SharedCacheStore(joined, reserve=reserve)
        if persistent:
            return SharedCacheStore(path, persistent=True, reserve=reserve, max_bytes=max_bytes)
        return SharedCacheStore(root=root, reserve=reserve, max_bytes=max_bytes)

    make.supported = SharedCacheStore.supported  # type: ignore[attr-defined]
    return cast(SharedCacheStore, shared_cache.create_shared_cache(group, store_type=make, **kwargs))
