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
:py:class:`SharedCacheStore`: a runtime cache that the processes of one machine share without a server, a keyed
cache of ``CacheDataset`` (it keeps items by key: ``get(key)``, ``store[key] = item``). Each item is a file of
:py:mod:`monai_sharedcache._format` in a private directory (:py:mod:`monai_sharedcache._locks`), with

- the Linux fast path of :py:mod:`monai_sharedcache._pool`, which reuses the private mapping of an unchanged item file
  with its page tables, so that a hit of a large item takes no page fault; where it is off (not Linux, no libc,
  ``MONAI_CACHE_FAST_PATH=0``), each read maps the file afresh;
- on a memory-backed file system, the room that the memory limit of this process's cgroup leaves
  (:py:mod:`monai_sharedcache._memory`), which the reserve is kept of when it is less than the file system's;
- a cap on the store's size, ``max_bytes``, and a budget that the creator records for all users
  (:py:mod:`monai_sharedcache.budget`);
- ``persistent=True``: a store kept in a directory across runs (:py:mod:`monai_sharedcache.persist`), its items
  checksummed on a disk (:py:mod:`monai_sharedcache.checksum`);
- statistics of hits, misses, computed and refused items, for all the processes of a store
  (:py:mod:`monai_sharedcache.counters`);
- exact keys through ``CacheDataset``'s own arguments: ``hash_func=store.hash_func`` and
  ``hash_transform=store.hash_transform`` (:py:mod:`monai_sharedcache.keys`);
- small notes that its processes keep for each other, and records kept across the runs of a persistent store (the
  digests of input files): JSON files in its own directories ``.notes`` and ``.kept``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import numbers
import os
import pickle
import re
import secrets
import stat
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

from monai_sharedcache import _flock
from monai_sharedcache import _format as fmt
from monai_sharedcache import _locks as locks
from monai_sharedcache import _memory as memory
from monai_sharedcache import _pool as pool
from monai_sharedcache import budget, checksum, counters, persist

__all__ = ["SharedCacheStore", "ENV_RESERVE", "NEEDS_KEYED"]

ENV_RESERVE = "MONAI_CACHE_RESERVE_BYTES"
NEEDS_KEYED = (
    "needs MONAI with CacheDataset keyed runtime caches (CacheDataset.cache_key), which MONAI {version} lacks: install "
    "a MONAI release with the keyed runtime cache protocol, or use the fork's wheel (monai 1.6.1+sharedcache)."
)
_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
_SUBDIR = re.compile(r"\.[0-9A-Za-z_-]{1,64}")  # never the name of an item, nor a path
_TMP = ".tmp"
_NOTES = ".notes"  # the store's own directories: of the notes of its processes (add_note), and of
_KEPT = ".kept"  # the records that a persistent store keeps across runs (keep)
_TURNS = ".turns"  # a lock per stripe of item files: their writers and removers take turns
_STRIPES = 128  # few enough that a removal of many items holds them all at once, under `ulimit -n 1024`
_CLAIMS = ".claims"  # a file per item being computed, locked by the process that computes it
_ASIDE = ".aside"  # removed items that a mapping kept by some process still pins: counted until it is released
_NAME = re.compile(r"[0-9A-Za-z_-]{1,128}")
_TAG = re.compile(r"[0-9a-f]{64}")
_PLAIN_KEY = re.compile(
    r"[0-9a-f]{32}(?:[0-9a-f]{32})?"
)  # CacheDataset's default keys: md5 of pickle, and of JSON  # the hex digest that hash_transform gives, at the end of a key
# errors that do not go away by themselves: the process stops writing
_PERSISTENT = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", -1)}
_NO_ROOM = {errno.ENOSPC, errno.EROFS, getattr(errno, "EDQUOT", -1)}  # a file system without room, or a quota
_UNCACHED = "Items are computed without the cache from now on in this process."
_UNSAFE = "Such items are computed without being stored."
_ROOT = "A root must be an existing directory where this user can make directories."
_MORE = (
    "Such items are computed without being stored. To cache more: give the container more shared memory (docker run "
    f"--shm-size=..., or --ipc=host), put the cache on a local disk or another tmpfs ({locks.ENV_ROOT}=/path, or "
    "SharedCacheStore(root=...)), or set the store's reserve."
)
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
_MISS = fmt.MISS


def _attach(
    cls: Any,
    path: str,
    claim_timeout: float,
    ident: tuple[int, int],
    reserve: int | None,
    safe: bool,
    max_bytes: int | None,
    session: int | None,
) -> SharedCacheStore:
    """Unpickle a store without using it (in a DataLoader worker): its directory is opened and checked anew."""
    store: SharedCacheStore = cls.__new__(cls)
    store.reserve, store.weights_only = reserve, safe
    if ident == (0, 0):  # never made (no room): it stays so
        store._setup(path, None, claim_timeout)
    else:
        try:
            d = locks.Dir(path, mark=True)
            if (d.ident.st_dev, d.ident.st_ino) != ident:
                raise PermissionError(
                    f"SharedCacheStore: refusing {path!r}, no longer the directory of the store that was pickled (it "
                    "was renamed away and replaced): its items are unpickled when read. Make a new store."
                )
            store._setup(path, d, claim_timeout)
        except FileNotFoundError as err:  # removed by its last user, maybe while this process opened it
            store._setup(path, None, claim_timeout)
            store._warn_once("the directory is gone", err)
    store._setup_books(max_bytes, session)
    return store


def _reserve(value: Any) -> int | None:
    if value is None:
        text = os.environ.get(ENV_RESERVE, "").strip()
        if text and not (text.isascii() and text.isdigit()):  # int() would take superscripts too
            raise ValueError(f"{ENV_RESERVE}={text!r} must be a non-negative number of bytes.")
        return int(text) if text else None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"reserve must be None or a non-negative number of bytes, got {value!r}.")
    return int(value)


def _keys() -> Any:
    """:py:mod:`monai_sharedcache.keys`, imported at the first use of a key function: a store alone never loads it."""
    from monai_sharedcache import keys

    return keys


class SharedCacheStore:
    """
    A cache that the processes of one machine share without a server, to pass as the ``runtime_cache`` of
    :py:class:`monai.data.CacheDataset`: each item is a file in a private directory, by default on ``/dev/shm``,
    published by an atomic rename and read as private copy-on-write views of its mapping. DataLoader workers receive
    the store pickled as its path; other processes of the user join it with ``SharedCacheStore(path)``. Processes and
    threads that miss an item at once compute it once (:py:meth:`get_or_compute`, :py:meth:`fill`). The last process
    that uses the store removes it, and a new store removes those of crashed runs in its root. An item that would leave
    less than ``reserve`` bytes free on the file system, which the DataLoader's batches need, or that would take the
    store past ``max_bytes``, is computed without being stored. A fault never fails the job: it gives one warning per
    process, and items computed without the store.

    It is a keyed cache of ``CacheDataset`` (``get(key)`` and ``store[key] = item``), keyed exactly when the dataset
    takes the store's key functions: ``hash_func=store.hash_func`` (files by their stat data, or for a persistent store
    by a digest of their content; tensors by their bytes) and ``hash_transform=store.hash_transform`` (the code and
    state of the cached transforms).

    With ``persistent=True``, the store is kept in the directory ``path`` across runs (see "Keeping the cache across
    runs" in the caching guide): a later run that opens the same path reuses every item whose key matches (the key
    that ``CacheDataset`` gives, the item format and the MONAI version). Items are written to disk (``fsync``) before
    they are published, so whatever a killed run had finished is reused whole. Past ``reserve`` or ``max_bytes``, the
    items that earlier runs used least recently are removed to make room; those of the current run are kept, and new
    ones refused.

    Args:
        path: the directory of an existing store to join; ``None`` to make a new store. With ``persistent=True``, the
            directory to keep the store in, on this machine, made (mode ``0o700``) if missing; ``~`` is expanded.
        root: where to make a new store; by default ``$MONAI_CACHE_ROOT``, else ``/dev/shm``, else the temporary
            directory.
        claim_timeout: seconds to wait for an item that another process or thread computes, before computing it too.
        reserve: bytes to keep free on the store's file system; a new store records it for all its users, who keep
            to it unless they give one. By default ``MONAI_CACHE_RESERVE_BYTES`` if set, else half the file system,
            at most 4 GiB (for a new persistent store, at least a tenth of its file system: a disk holds checkpoints
            and logs too). On a memory-backed file system, the room that this process's cgroup leaves counts too.
        max_bytes: a cap on the total size of the store's items, recorded by a new store for all its users; by
            default ``MONAI_CACHE_MAX_BYTES`` if set, else none.
        persistent: keep the store in ``path`` when its last user leaves, for later runs. With it, ``reserve`` and
            ``max_bytes``, if given, each replace the value that the store recorded, when no other run uses it. A
            store that was made persistent is joined as such without it.
        weights_only: as ``PersistentDataset``'s: items are read with an allow-list of types (tensors, arrays and
            scalars, MONAI's tensors and enums, plain builtins, pydicom's ``UID``, and those of
            ``torch.serialization.add_safe_globals`` where the store is read, where it was made, and where it was
            pickled for a DataLoader worker), so reading imports no module and calls nothing else, and an item of
            another type (an object array, an instance of a class of yours) is computed without being stored, with
            one warning per type; ``False`` unpickles any type, which can run code: only for a store whose directory
            no one else could have written.

    Raises:
        NotImplementedError: on a platform without ``fcntl`` (Windows).
        FileNotFoundError: ``path`` does not exist.
        NotADirectoryError: ``path`` is a file.
        PermissionError: ``path`` is not a private directory of this user that a store made; with
            ``persistent=True``, ``path`` or a file of the store's own in it is another user's or writable by others,
            a file of the store's own is a symbolic link, or ``path`` goes through a link that another user made or
            could replace.
        OSError: ``root`` cannot hold a store (with ``MONAI_CACHE_ROOT`` instead: a warning, and no cache).
        ValueError: both ``path`` and ``root`` are given; a bad ``claim_timeout``, ``reserve`` or ``max_bytes``;
            ``max_bytes`` with ``path`` (without ``persistent``); ``persistent=True`` without ``path`` or with
            ``root``; ``path`` is not empty and holds no persistent store, is named like a temporary store
            (``monai-cache-*``), or is on a network file system.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            ds = CacheDataset(
                data, transform, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform
            )
            other = SharedCacheStore(store.path)  # in another process of this user, on this machine
            kept = SharedCacheStore("/local/cache/brats", persistent=True)  # kept for the next run, made if missing

    Warning:
        A store joins only a directory of this user closed to others, as made. It holds CPU tensors only.
    """

    supported = locks.AVAILABLE  # not without fcntl (Windows)
    node_cpus: int | None = None  # this process's share of its node's CPUs, set by create_shared_cache
    reserve: int | None
    weights_only: bool = True
    _allowed: dict[str, Any] = {}  # the types of add_safe_globals where the store was made, and where it was pickled
    _memory: bool | None = None  # whether its items are memory of this process's cgroup (tmpfs)
    _keyed = False  # whether the key functions were used, here or where the store was pickled

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
        _opt_in()
        if not self.supported:
            raise NotImplementedError(
                "SharedCacheStore needs fcntl file locks, which this platform lacks. Use "
                "CacheDataset(runtime_cache='process'), which keeps the cache in a multiprocessing Manager list here."
            )
        timeout: Any = claim_timeout  # numpy's numbers too, which typing's float leaves out
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not float(timeout) >= 0:
            raise ValueError(f"claim_timeout must be a non-negative number of seconds, got {claim_timeout!r}.")
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
        self.reserve, self.weights_only = _reserve(reserve), bool(weights_only)
        self._allowed = fmt.named_types(torch.serialization.get_safe_globals())
        try:
            if persistent:
                path, ident = persist.prepare(cast(str, path))
            self._open(None if path is None else os.fspath(path), root, claim_timeout)
            if persistent and (self._directory.ident.st_dev, self._directory.ident.st_ino) != ident:
                self.close()  # a component was replaced since it was resolved
                raise PermissionError(f"SharedCacheStore: refusing {path!r}: it changed while it was opened.")
        except OSError as err:  # a full or read-only file system: the job goes on without the cache
            if path is None or isinstance(err, PermissionError) or err.errno not in _NO_ROOM:
                raise
            self._setup(os.path.abspath(os.fspath(path)), None, claim_timeout)
            self._setup_books(None, None)
            self._warn_once("cannot make or open the store", err, _MORE)
            return
        self._setup_books(max_bytes, None)
        at = self._at()
        if at is None:  # no room to make it, or gone: no books to open
            return
        if persistent or _exists(at, persist.USERS) or _exists(at, persist.SESSION):  # joined without the flag too
            self._open_persistent(reserve, max_bytes, env_max)
        elif path is None:
            self.max_bytes = max_bytes = env_max if max_bytes is None else max_bytes
            try:
                budget.record(self._subdir(budget.RECORDS_DIR), at, self.reserve, max_bytes)
            except OSError as err:
                self._fault_books("cannot record the budget", err)
        else:
            recorded = budget.recorded(at)
            self.reserve = recorded[0] if reserve is None else self.reserve
            self.max_bytes = recorded[1]
        if path is not None and self._at() is not None:  # joined: dead processes may have left files
            self._clean_dead()

    def _open(self, path: str | None, root: str | os.PathLike | None, claim_timeout: float) -> None:
        """Join the store ``path``, or make a new one in ``root``; without room there, a store that stores nothing."""
        if path is not None:
            if root is not None:
                raise ValueError("root is where a new store is made: give path or root, not both.")
            path = os.path.abspath(os.path.expanduser(os.fsdecode(path)))
            self._setup(path, locks.Dir(path, mark=True), claim_timeout)
            try:
                self._hold(locks.join(self._dir))
            except FileNotFoundError as err:  # removed by its last user meanwhile
                self._gone = True
                self._warn_once("the directory is gone", err)
            return
        given = root is not None
        root = locks.default_root() if root is None else os.path.expanduser(os.fsdecode(root))
        where = f"root={root!r}" if given else f"{locks.ENV_ROOT}={root!r}" if os.environ.get(locks.ENV_ROOT) else root
        locks.cleanup_leftovers(root)
        new, held = cast(locks.Dir, None), cast(locks.Held, None)
        try:
            new = locks.Dir(os.path.abspath(tempfile.mkdtemp(prefix=locks.PREFIX, dir=root)))  # mode 0o700
            held = locks.create(new)
            os.mkdir(_TMP, 0o700, dir_fd=new.fd)
        except BaseException as err:
            if held is not None:
                held.close()
            if new is not None:
                new.remove()
            if not isinstance(err, OSError):
                raise
            if err.errno is None:  # refused: the new directory was replaced, in a root that others can write
                raise PermissionError(f"{err} It was made in {where}: use a directory of your own.") from None
            if given and err.errno not in _NO_ROOM:
                raise type(err)(
                    err.errno, f"SharedCacheStore: {where} cannot hold a store ({err.strerror}). {_ROOT}"
                ) from err
            self._setup(root if new is None else new.path, None, claim_timeout)
            then = _MORE if err.errno in _NO_ROOM else f"{_ROOT} {_UNCACHED}"
            self._warn_once(f"cannot make a store in {where}", f"{type(err).__name__}: {err.strerror}", then)
            return
        self._setup(new.path, new, claim_timeout)
        self._hold(held)

    def _setup(self, path: str, d: locks.Dir | None, claim_timeout: float = 600.0) -> None:
        """Use the opened and checked directory ``d``; ``None``: gone, or not to be used."""
        self._dir = cast(locks.Dir, d)
        self._path, self._tmp = path, cast(locks.Dir, None if d is None else locks.Dir(path, _TMP, d))
        self._ident = (0, 0) if d is None else (d.ident.st_dev, d.ident.st_ino)
        self._claim_timeout, self._claims = float(claim_timeout), threading.local()
        self._gone, self._writable = d is None, True
        self._warned: dict[tuple[int, str, str], object] = {}
        self._finalizer: weakref.finalize | None = None
        self._tags: dict[str, Any] = {}  # per hash_transform digest: the ids of its transforms, its counts here

    def _hold(self, held: locks.Held) -> None:
        self._finalizer = weakref.finalize(self, locks.leave, self._dir, held)  # at close(), collection or exit

    def _at(self) -> Any:
        """The store's checked directory, or ``None`` if the store is closed or gone."""
        try:
            return self._directory
        except OSError:
            return None

    def _setup_books(self, max_bytes: int | None, session: int | None) -> None:
        """The state beside the items: budget, counts, and a persistent store's session (its start) and checksums."""
        self.max_bytes, self._session = max_bytes, session
        self.durable = self._evictable = session is not None  # on a disk: items synced before they are published
        self._room = threading.local()  # per thread: the bytes that its put reserved in the count, the file it reads
        self._writes_dir: Any = None
        self._turns_dir: Any = None  # opened once per store object
        self._claims_dir: Any = None
        self._sums = checksum.enabled()  # checksums of a persistent store on a disk, and the files this process checked
        self._checked: set[tuple[int, int, int, int]] = set()
        self._used = budget.Used(
            lambda: self._directory, self._recount, self._dead_writes, lambda: self._free_aside()[0]
        )
        ref = weakref.ref(self)  # not the store itself: its counts would keep it alive
        slots = lambda: cast(SharedCacheStore, ref())._subdir(counters.SLOTS_DIR)  # noqa: E731
        self._counters = counters.Counters(slots, persistent=session is not None)

    def _open_persistent(self, reserve: int | None, max_bytes: int | None, env_max: int | None) -> None:
        """Use the persistent store whose directory was joined: check it, and start or join its session."""
        at = self._directory
        try:
            persist.check_local(self.path)
            persist.check_files(at, _OWN)
            held, first = persist.join(at)
        except BaseException as err:
            self.close()
            if not isinstance(err, OSError) or isinstance(err, PermissionError) or err.errno not in _NO_ROOM:
                raise
            self._fault_books("cannot open the persistent store", err)
            self._setup_books(None, None)
            return
        self._users = weakref.finalize(self, held.close)  # at close(), garbage collection or exit
        try:
            if first:  # no other run uses the store: a new session, with the budget given
                self._clean_own_temps()
                self._used.read(lambda: True)  # counted anew once per run: a crash or power loss can leave it stale
                old = budget.recorded(at) if _exists(at, budget.BUDGET_FILE) else None
                if old is None:
                    max_bytes = env_max if max_bytes is None else max_bytes
                    if reserve is None:
                        total = (self.free_space() or (0, 0))[1]
                        reserve = (
                            self.reserve if self.reserve is not None else max(min(total // 2, 4 << 30), total // 10)
                        )
                    budget.record(self._subdir(budget.RECORDS_DIR), at, reserve, max_bytes)
                elif reserve is not None or max_bytes is not None:
                    reserve, max_bytes = old[0] if reserve is None else reserve, (
                        old[1] if max_bytes is None else max_bytes
                    )
                    budget.record(self._subdir(budget.RECORDS_DIR), at, reserve, max_bytes)
                counters.reset(self._subdir(counters.SLOTS_DIR))
                persist.start_session(at)
            else:
                self._tell_other_budget(reserve, max_bytes)
        except OSError as err:  # a full file system: the store is read as it is
            self._fault_books("cannot start a session of the persistent store", err)
        finally:
            if first:  # the other users wait for the session to start
                persist.joined(held)
        self.reserve, self.max_bytes = budget.recorded(at)
        self._setup_books(self.max_bytes, persist.session_start(at))

    def _tell_other_budget(self, reserve: int | None, max_bytes: int | None) -> None:
        """Warn if the budget asked for differs from the one that the store's current session keeps to."""
        old = budget.recorded(self._directory)
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
        """Remove the budget records that killed runs left half written: unlocked files of the store's own directory."""
        tmp = self._subdir(budget.RECORDS_DIR)
        for name in tmp.names():
            if name.startswith(budget.BUDGET_FILE + "-"):
                held = _flock.hold(tmp, name)
                if held is not None:
                    _unlink(tmp, name)
                    held.close()

    def _fault_books(self, what: str, err: OSError) -> None:
        self._warn_books(what, f"{what} ({type(err).__name__}: {err}).")

    def _warn_books(self, what: str, message: str) -> None:
        token = object()  # once per store, process and fault (a removal of many items may fail for each)
        if self.__dict__.setdefault("_books_warned", {}).setdefault((os.getpid(), what), token) is not token:
            return
        warnings.warn(f"SharedCacheStore {self.path}: {message}", RuntimeWarning, stacklevel=4)

    @property
    def path(self) -> str:
        """The directory of the store."""
        return self._path

    @property
    def persistent(self) -> bool:
        """Whether the store is kept across runs."""
        return self._session is not None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def __reduce__(self) -> tuple:
        args = (type(self), self._path, self._claim_timeout, self._ident, self.reserve, self.weights_only)
        state = (fmt.carry_types(self._allowed), self._keyed, _carry_tags(self._tags))
        return _attach, (*args, self.max_bytes, self._session), state

    def __setstate__(self, state: tuple) -> None:
        allowed, self._keyed, tags = state
        self._allowed = fmt.carried_types(allowed)
        self._tags = _carried_tags(tags, self._session is not None)

    # the keyed cache of CacheDataset: get(key), store[key] = item

    def get(self, key: str, default: Any = None) -> Any:
        """
        The item stored under ``key``, or ``default``; an item's transforms ids are those of this process where the
        key comes from :py:meth:`hash_transform` (so that ``Invertd`` inverts an item that another process computed).
        """
        tag = self._tag(key)
        with _on_behalf(tag):
            item = self._get(key)
            if tag is not None:
                counters.count(self._counters, counters.MISSES if item is _MISS else counters.HITS)
            if item is _MISS and tag is not None:  # a dataset's miss: it computes the item and stores it next
                item = self._lease(key)
        return default if item is _MISS else _local(tag, item, default)

    def _lease(self, key: str) -> Any:
        """
        A miss of a ``CacheDataset`` (a key of :py:meth:`hash_transform`): its claim, held until this thread stores
        the item (or asks for another), so that processes that miss it at once compute it once. Another holder's item,
        waited for, else ``_MISS``: compute it. A holder that dies releases its claim with its locks.
        """
        self._release_lease()
        name = self._stem(key) + ".claim"
        if self._gone or not self._writable or name in self._claims.__dict__.setdefault("held", set()):
            return _MISS
        deadline, delay = time.monotonic() + self._claim_timeout, 0.001
        while True:
            try:
                held = locks.try_hold(name, os.O_CREAT, at=self._claims_at())
            except OSError as err:
                self._fault("cannot create claim files", err)
                return _MISS
            item = self._get(key)  # published between the miss and the claim, or by the holder
            if held is not None:
                if item is _MISS:
                    self._claims.lease = (key, name, held)
                    return _MISS
                locks.unlink_quiet(name, self._claims_at())
                held.close()
            if item is not _MISS:
                return item
            if time.monotonic() > deadline:
                why = f"claim_timeout={self._claim_timeout} s"
                self._warn_once("waited too long for an item that another process computes", why, "It computed it too.")
                return _MISS
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    def _release_lease(self, key: str | None = None) -> None:
        """Release this thread's lease (of ``key`` only, if given): its item is stored, or will not be."""
        lease = getattr(self._claims, "lease", None)
        if lease is not None and (key is None or lease[0] == key):
            self._claims.lease = None
            locks.unlink_quiet(lease[1], self._claims_at())  # while held: a waiter that opened it sees it removed
            lease[2].close()

    def __getitem__(self, key: str) -> Any:
        """
        The item stored under ``key``.

        Raises:
            KeyError: no item is stored under ``key``.
            TypeError: ``key`` is an index, as a ``CacheDataset`` without keyed runtime caches gives it.
        """
        if not isinstance(key, str):
            _need_keyed()
        item = self.get(key, _MISS)
        if item is _MISS:
            raise KeyError(key)
        return item

    def __setitem__(self, key: str, item: Any) -> None:
        """Store ``item`` under ``key`` as :py:meth:`put` does; an item that cannot be stored is not, after a warning."""
        self.put(key, item)

    def put(self, key: str, item: Any) -> bool:
        """
        Store ``item`` under ``key``: the ``put`` of MONAI's ``KeyedCache`` protocol, by which a ``CacheDataset``
        stores an item that it computed after a miss of :py:meth:`get`.

        Returns:
            whether it was stored: not past the reserve or ``max_bytes``, after a fault, or an item that cannot be
            stored (unpicklable, a type that the allow-list leaves out, a tensor off the CPU), each after one warning.

        Raises:
            TypeError: ``key`` is an index, as a ``CacheDataset`` without keyed runtime caches gives it.
        """
        if not isinstance(key, str):
            _need_keyed()
        tag = self._tag(key)
        if tag is None and not self._keyed and _PLAIN_KEY.fullmatch(key):
            self._warn_once(
                "stores items under keys that its key functions did not make",
                "CacheDataset keys by pickle and the transforms' names alone then: an edited file or function keeps "
                "its key",
                "For exact keys: CacheDataset(..., runtime_cache=store, hash_func=store.hash_func, "
                "hash_transform=store.hash_transform).",
            )
        try:
            with _on_behalf(tag):
                if tag is not None:
                    counters.count(self._counters, counters.COMPUTED)
                return self._put_keyed(tag, key, item)
        finally:
            self._release_lease(key)

    def _put_keyed(self, tag: _Tag | None, key: str, item: Any) -> bool:
        """:py:meth:`_store`, with the ids of the transforms of ``tag`` stored as their places, and left as ids here."""
        if tag is None or tag.operations is None:
            return self._store(key, item)
        stored = self._store(key, tag.operations.portable(item))
        tag.operations.local(item, item)
        return stored

    def __contains__(self, key: object) -> bool:
        """Whether an item is stored under ``key`` now (one ``stat``; it may be removed before it is read)."""
        return isinstance(key, str) and self._at() is not None and self._has(self._stem(key) + ".item")

    def hash_func(self, entry: Any) -> bytes:
        """
        The ``hash_func`` of a ``CacheDataset`` on this store: ``pickle_hashing`` of ``entry`` with each name of an
        existing file stamped by its stat data (by a digest of its content, kept across runs, for a persistent store),
        each directory by its entries, each tensor and array by its dtype, shape and bytes
        (:py:func:`monai_sharedcache.keys.stamp_files`). A file is stat'ed at each call, and read only by a persistent
        store, only where its stat data changed since it was last read.

        Args:
            entry: an input of the dataset, e.g. ``{"image": "img.nii.gz", "label": "seg.nii.gz"}``.

        Returns:
            the hash, as bytes.
        """
        from monai.data.utils import pickle_hashing

        self._keyed = True
        keys = _keys()
        content = keys.kept_digests(self) if self.persistent else None
        return cast(bytes, pickle_hashing(keys.stamp_files(entry, {}, content)))

    def hash_transform(self, transforms: Any) -> bytes:
        """
        The ``hash_transform`` of a ``CacheDataset`` on this store: the fingerprint of the cached ``transforms`` by
        their code and state (:py:func:`monai_sharedcache.keys.transforms_fingerprint`), the same in every process
        that builds them from the same code. Items keyed by it invert in every process that reads them.

        Args:
            transforms: the cached transforms (a sequence, or a ``Compose``, whose options count too).

        Returns:
            the hash (64 hex digits), as bytes; private to this process, after one warning, where a member of the
            transforms cannot be pickled.
        """
        self._keyed = True
        cached = list(transforms) if isinstance(transforms, Sequence) else [transforms]
        if hasattr(transforms, "transforms") and hasattr(transforms, "map_items"):  # a Compose: its options count
            options = {k: getattr(transforms, k, None) for k in ("lazy", "map_items", "unpack_items", "overrides")}
            cached = [options, *transforms.transforms]
        digest = _keys().fingerprint_of(cached, stacklevel=2).digest
        if digest not in self._tags:
            self._tags[digest] = _Tag(_operation_ids(cached), self.persistent)
        return cast(str, digest).encode()

    def _tag(self, key: str) -> _Tag | None:
        """What this process knows of the transforms that ``key`` ends with (their hash_transform digest)."""
        return self._tags.get(key[-64:]) if self._tags and isinstance(key, str) else None

    # the store's own operations

    def _store(self, key: str, item: Any) -> bool:
        """Store ``item`` under ``key``; whether it was stored (see :py:meth:`put`)."""
        name = self._stem(key) + ".item"
        turns = self._turns([name])  # whether this write replaces a copy is known only if writers take turns
        self._room.stripe = _stripe(name) if turns else None  # its turn: this put may evict in its own stripe
        try:
            return self._put_counted(key, item, name)
        finally:
            self._room.stripe = None
            for turn in turns:
                turn.close()

    def _put_counted(self, key: str, item: Any, name: str) -> bool:
        room = self._room
        room.reserved, room.active, room.held, room.uncounted = 0, True, None, False
        before = self._size(name)  # another process's copy of the item, if any: this write replaces it
        room.new = 0 if before else 1  # a new item, counted with its bytes before it is published
        room.replaces, room.freed = before, before  # the bytes that replacing it frees (0: pinned, counted aside)
        try:
            stored = self._write(key, item, name)
        finally:
            room.active = False
            if room.held is not None:  # published or not: no longer a write under way
                at, held_name, held = room.held
                _unlink(at, held_name)
                held.close()
        if stored:  # its bytes and itself were counted when they were reserved, unless the count failed then
            self._count((self._size(name) if room.uncounted else 0) - room.freed, room.new if room.uncounted else 0)
        else:
            self._count(-room.reserved, -room.new if room.reserved else 0)
            counters.count(self._counters, counters.REFUSED)
        return stored

    def _write(self, key: str, item: Any, name: str) -> bool:
        """Write ``item`` to a temporary file, and publish it as ``name`` by a rename, unless past the budget."""
        if self._gone or not self._writable:
            return False
        try:
            chunks, total = fmt.encode(key, item, self.weights_only, self._allowed)
        except Exception as err:
            then = _UNSAFE if isinstance(err, fmt.UnsafeTypeError) else fmt.UNSTORABLE
            refused = str(err) if isinstance(err, (fmt.UnsafeTypeError, fmt.OffCpuError)) else ""  # each type once
            self._warn_once("cannot store some items", err, then, refused)
            return False
        why = self._room_for(total)
        if why is not None:
            self._warn_once("not storing items past the budget", f"an item of {total / 2**20:.1f} MiB: {why}", _MORE)
            return False
        tmp = f"{name[:-5]}-{secrets.token_hex(8)}"
        try:
            held = locks.open_temp(tmp, self._tmp)  # locked while written: cleaners remove dead writers' files only
            try:
                fmt.write_item(held.fd, chunks)
                self._seal(held.fd)
                if self.durable:
                    os.fsync(held.fd)
                # again once written, as others may have written meanwhile; the reserve alone, which counts nothing
                why = self._reserve_room(0)
                if why is not None:
                    self._warn_once("not storing items past the budget", why, _MORE)
                    locks.unlink_quiet(tmp, self._tmp)
                    return False
                # a copy that a reader maps stays counted, in .aside, once replaced: else memory passes max_bytes
                kept = _flock.keep_aside(self._dir, name, lambda: self._subdir(_ASIDE)) if self._room.replaces else None
                os.replace(tmp, name, src_dir_fd=self._tmp.fd, dst_dir_fd=self._dir.fd)
                if kept is not None:
                    self._room.freed = _flock.release_aside(kept)
            finally:
                held.close()
        except OSError as err:
            locks.unlink_quiet(tmp, self._tmp)
            self._fault("cannot write items", err)
            return False
        except BaseException:
            locks.unlink_quiet(tmp, self._tmp)
            raise
        locks.clean_dead_files(self._tmp)
        return True

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        """The item stored under ``key``, else ``compute()``, stored: called once by the processes that miss it."""
        tag = self._tag(key)
        with _on_behalf(tag):
            item = self._get(key)
            if item is not _MISS:
                counters.count(self._counters, counters.HITS)
            else:
                counters.count(self._counters, counters.MISSES)
                item = self._compute_once(key, self._counted(compute), lambda: self._get(key), tag=tag)
        item = _local(tag, item, _MISS)
        return compute() if item is _MISS else item  # an item whose transforms this process cannot place

    def fill(self, key: str, compute: Callable[[], Any], wait: bool = True) -> bool:
        """
        Make sure that an item is stored under ``key``, without reading it: ``compute()`` and store it, unless it is
        stored already.

        Returns:
            ``False`` if another process or thread is computing it and ``wait`` is ``False``; else ``True`` (stored,
            or computed and refused, or not computed where it could not be stored).
        """
        name, tag = self._stem(key) + ".item", self._tag(key)
        if self._session is not None and self._at() is not None:
            try:  # used by this run: never evicted for its other items; reused by the dataset of its key too
                if persist.touch(self._directory, name, self._directory.stat(name), self._session):
                    with _on_behalf(tag):
                        counters.count(self._counters, counters.REUSED)
            except OSError:
                pass

        def stored() -> Any:
            return True if self._has(name) else _MISS

        if self._gone or not self._writable or stored() is True or self._full():
            return True  # an item that cannot be stored would be computed for nothing
        with _on_behalf(tag):
            return self._compute_once(key, self._counted(compute), stored, wait, tag) is not _MISS

    def _counted(self, compute: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            counters.count(self._counters, counters.COMPUTED)
            return compute()

        return counted

    def _compute_once(
        self, key: str, compute: Callable[[], Any], find: Callable[[], Any], wait: bool = True, tag: _Tag | None = None
    ) -> Any:
        """
        ``find()``, else ``compute()``, stored, once across processes and threads: by the holder of an exclusive lock
        on the key's claim file. The others poll for the item or the claim (a dead holder's goes with it), and past
        ``claim_timeout`` compute it too, unstored; with ``wait=False`` they return the miss at once.
        """
        name, mine = self._stem(key) + ".claim", self._claims.__dict__.setdefault("held", set())
        if self._gone or not self._writable or name in mine or self._full():  # mine: a transform asks for its own item
            return compute()
        deadline, delay = time.monotonic() + self._claim_timeout, 0.001
        while True:
            try:
                held = locks.try_hold(name, os.O_CREAT, at=self._claims_at())
            except OSError as err:
                self._fault("cannot create claim files", err)
                return compute()
            if held is not None:
                mine.add(name)
                try:
                    item = find()  # published between the miss and the claim?
                    if item is _MISS:
                        item = compute()
                        self._put_keyed(tag, key, item)
                    return item
                finally:
                    mine.discard(name)
                    locks.unlink_quiet(name, self._claims_at())  # while held: a waiter that opened it sees it removed
                    held.close()
            item = find()
            if item is not _MISS or not wait:
                return item
            if time.monotonic() > deadline:
                why = f"claim_timeout={self._claim_timeout} s"
                self._warn_once("waited too long for an item that another process computes", why, "It computed it too.")
                return compute()
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    def _get(self, key: str) -> Any:
        """The item stored under ``key``, or ``_MISS``; an item of a persistent store is marked as used by this run."""
        if self._session is None or self._at() is None:
            return self._read(key)
        name = self._stem(key) + ".item"
        try:
            before = self._directory.stat(name)  # its use before this read, which may set its access time
        except OSError:
            return _MISS
        self._room.reading = name  # a damaged item is counted out as it is removed (_verified)
        try:
            item = self._read(key)
        finally:
            self._room.reading = None
        if item is not _MISS and persist.touch(self._directory, name, before, self._session):
            counters.count(self._counters, counters.REUSED)
        return item

    def _read(self, key: str) -> Any:
        name, ino = self._stem(key) + ".item", None
        try:
            if not self._gone:
                buf, ino = fmt.read_file(self._dir, name, self._map, self._verified)
                return fmt.decode(buf, key, self.weights_only, self._allowed)
        except FileNotFoundError:
            pass
        except fmt.UnsafeTypeError as err:  # planted, or written by a store that allows more
            self._warn_once("refused items of a type not allowed", err, "Such items are computed anew.", str(err))
        except OSError as err:
            self._warn_once("cannot read items", err)
        except fmt.CorruptItemError as err:
            try:
                if self._dir.stat(name).st_ino == (ino if err.ino is None else err.ino):  # not one published since
                    self._dir.unlink(name)
            except OSError:
                pass
        except Exception as err:  # e.g. a class that this process cannot import
            self._warn_once("cannot unpickle items", err)
        return _MISS

    def _map(self, fd: int, st: os.stat_result, name: str) -> memoryview:
        """A private copy-on-write mapping of the checked item file ``name``, open at ``fd``."""
        if pool.ENABLED:  # an earlier mapping of the unchanged file, with its page tables
            ident = (os.path.join(self.path, name), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            return pool.map_private(fd, st.st_size, ident)
        try:  # unmapped with the last view
            storage = torch.UntypedStorage.from_file(f"{fmt.FD_DIR}/{fd}", shared=False, nbytes=st.st_size)
        except RuntimeError as err:
            raise OSError(errno.EIO, str(err), name) from err
        return memoryview(cast(Any, torch.empty(0, dtype=torch.uint8).set_(cast(Any, storage)).numpy()))

    def _stem(self, key: str) -> str:
        """
        The name of ``key``'s files: ``key`` if safe, else its sha256; a persistent store's names hold the MONAI
        version, as its items outlive the run.
        """
        key = key + "|" + persist.version_tag() if self._session is not None else key
        return key if _SAFE_KEY.fullmatch(key) else hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _has(self, name: str) -> bool:
        try:
            return stat.S_ISREG(self._dir.stat(name).st_mode)
        except OSError:
            return False

    def _full(self) -> bool:  # no room left past the reserve: no claims (nothing to wait for), no fill
        why = self._room_for(0)
        if why is not None:
            self._warn_once("not storing items past the budget", why, _MORE)
        return why is not None

    def free_space(self) -> tuple[int, int] | None:
        """
        The bytes free and in all where the store's items count, ``None`` if unknown: its file system's, or on a
        memory-backed one, what this process's cgroup leaves if less.
        """
        try:
            st = os.statvfs(self._dir.fd)
            space: tuple[int, int] | None = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        except (OSError, AttributeError):
            space = None
        room = memory.cgroup_room() if self._dir is not None and self._in_memory() else None
        if room is not None and (space is None or room[1] < space[0]):  # the container's memory is the shorter
            return room[1], room[0]
        return space

    def _reserve_room(self, nbytes: int) -> str | None:
        """Why an item of ``nbytes`` bytes would leave less than the reserve free, or ``None``."""
        space = self.free_space()
        if space is None:  # the write itself will tell what is wrong
            return None
        free, total = space
        reserve = min(total // 2, 4 << 30) if self.reserve is None else self.reserve
        if free - nbytes >= reserve:
            return None
        return (
            f"{free / 2**20:.0f} MiB are free of {total / 2**20:.0f} MiB where its items count, and "
            f"{reserve / 2**20:.0f} MiB are kept free for the DataLoader's shared memory (reserve)"
        )

    @property
    def _directory(self) -> locks.Dir:
        """The store's directory as opened and checked, for its own files; ``FileNotFoundError`` if gone."""
        if self._gone:
            raise FileNotFoundError(errno.ENOENT, "the store is closed or gone", self._path)
        return self._dir

    def _subdir(self, name: str) -> locks.Dir:
        """The store's own directory ``name`` (a dot, then 1 to 64 of ``[0-9A-Za-z_-]``), made if missing, checked."""
        if not _SUBDIR.fullmatch(name):
            raise ValueError(
                f"a directory of the store is a dot, then 1 to 64 letters, digits, '_' or '-', got {name!r}."
            )
        at = self._directory
        try:
            os.mkdir(name, 0o700, dir_fd=at.fd)
        except FileExistsError:
            pass
        return locks.Dir(self._path, name, at)

    def _fault(self, what: str, err: OSError) -> None:
        if self._dir.moved():
            self._gone, what = True, "the directory is gone or replaced"
        elif err.errno in _PERSISTENT:
            self._writable = False
        self._warn_once(what, err)

    def _warn_once(self, what: str, why: object, then: str = _UNCACHED, refused: str = "") -> None:
        token = object()  # setdefault is atomic: no lock, which a fork could leave held in the child
        if self._warned.setdefault((os.getpid(), what, refused), token) is not token:  # once per fault and type
            return
        why = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
        warnings.warn(f"SharedCacheStore {self._path}: {what} ({why}). {then}", RuntimeWarning, stacklevel=3)

    def _in_memory(self) -> bool:
        if self._memory is None:  # decided once per process and store: a store does not move
            self._memory = memory.fs_type(self.path) in memory.MEMORY_FS
        return self._memory

    def _seal(self, fd: int) -> None:
        """A persistent store on a disk records the checksum of an item file before it is published."""
        if self._session is None or not self._sums or self._in_memory():
            return
        try:
            checksum.seal(fd)
        except OSError as err:
            if err.errno not in checksum.UNSUPPORTED:
                raise  # the item is not stored, as after any fault of a write
            self._sums = False
            self._fault_books("cannot keep checksums with items on this file system: they are read unchecked", err)

    def _verified(self, fd: int, st: os.stat_result, view: memoryview) -> bool:
        """
        A persistent store on a disk checks the bytes of an item written by an earlier run at its first read in this
        run; not those that this run wrote, nor those of a store in memory.
        """
        session = self._session
        if session is None or not self._sums or st.st_mtime_ns >= session or self._in_memory():
            return True
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if ident in self._checked:
            return True
        if checksum.check(fd, view, session) is False:
            self._remove_damaged(st)
            what = "found items whose bytes are not those written"
            self._warn_books(
                what, f"{what} (a damaged disk or file, or not written whole). They are removed, and computed anew."
            )
            return False
        self._checked.add(ident)  # unknown (no attributes here): not asked again either
        return True

    def _remove_damaged(self, st: os.stat_result) -> None:
        """
        Remove the item file that this thread's :py:meth:`get` reads, found damaged, if it is still the file ``st``,
        and count it out: ``_read`` would remove it uncounted, and :py:meth:`stats` reads the count.
        """
        name = getattr(self._room, "reading", None)
        if name is None:
            return

        def remove() -> tuple[int, int]:
            try:
                now = self._directory.stat(name)
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

    def _turns(self, names: Iterable[str], wait: float = 60.0) -> list[_flock.Held]:
        """
        The turns of the item files ``names`` (the locks of their stripes, taken in order, before the count's lock):
        each writer and remover of an item counts what it found there. Those not had in ``wait`` seconds, or at all
        (the store is gone, no descriptor is left), are left: the count may then be off until it is made again.
        """
        held: list[_flock.Held] = []
        try:
            if self._turns_dir is None:
                self._turns_dir = self._subdir(_TURNS)
            for stripe in sorted({_stripe(name) for name in names}):
                turn = _flock.hold(self._turns_dir, str(stripe), wait=wait)
                if turn is not None:
                    held.append(turn)
        except OSError:
            pass
        return held

    def _room_for(self, nbytes: int) -> str | None:
        """
        Why an item of ``nbytes`` bytes is not to be stored: past the reserve, or past ``max_bytes``; called by
        :py:meth:`put`, it counts the item's bytes in the store when
        they fit. A persistent store first makes room by removing the items of earlier runs that were used least
        recently.
        """
        why = self._room_in_budget(nbytes)
        if why is not None and self._evictable and self._session is not None:
            evicted: list = []

            def evict() -> tuple[int, int]:
                freed = self._free_aside()[0]
                found = persist.evict(
                    self._directory, cast(int, self._session), lambda f: self._excess(f, nbytes), self._evict_one
                )
                evicted.append(found)
                removed, gone = found or (0, 0)
                return freed + removed, gone

            self._locked(evict)
            self._evictable = bool(evicted) and evicted[0] is not None
            if evicted and evicted[0]:
                why = self._room_in_budget(nbytes)
        return why

    def _room_in_budget(self, nbytes: int) -> str | None:
        why = self._reserve_room(nbytes)
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

    def _claims_at(self) -> Any:
        """The directory of the claims, each an exclusive lock held while an item is computed (opened once)."""
        if self._claims_dir is None:
            self._claims_dir = self._subdir(_CLAIMS)
        return self._claims_dir

    def _clean_dead(self) -> None:
        """
        Remove what dead processes left: their temporary files and claims, unlocked since the kernel released their
        locks, and count out what their writes reserved. At every open: it lists two small directories.
        """
        try:
            locks.clean_dead_files(self._tmp)
            locks.clean_dead_files(self._claims_at())
            if self._dead_writes():
                self._used.read(lambda: True)  # a recount, which removes their files in .writes
        except OSError:  # a store that cannot be cleaned now is cleaned by the next open
            pass

    def _writes(self) -> Any:
        if self._writes_dir is None:  # opened once per store object: a write pays no check of it
            self._writes_dir = self._subdir(budget.WRITES_DIR)
        return self._writes_dir

    def _excess(self, found: list, nbytes: int) -> int:
        """The bytes to remove for an item of ``nbytes`` to fit, of the items ``found`` in the store."""
        excess = 0 if self.max_bytes is None else sum(f[2] for f in found) + nbytes - self.max_bytes
        space = self.free_space()
        if space is not None:  # the default reserve, where none was recorded
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
            return self._directory.stat(name).st_size
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
        locks.clean_dead_files(self._tmp)  # what dead writers wrote: counted by no one, once removed
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
        found = persist.items(self._directory)
        return nbytes + sum(f[2] for f in found) + self._free_aside()[1], items + len(found)

    def _free_aside(self) -> tuple[int, int]:
        """The bytes of removed items freed now that no mapping pins them, and those still pinned."""
        try:
            return _flock.free_aside(self._subdir(_ASIDE)) if _exists(self._directory, _ASIDE) else (0, 0)
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
            freed, lost = _flock.retire(self._directory, name, lambda: self._subdir(_ASIDE))
        except FileNotFoundError:
            return None
        except OSError as err:
            self._fault_books("cannot remove items", err)
            return None
        if lost:
            what = "cannot keep removed items that readers still map counted"
            self._warn_books(
                what,
                f"{what} (the directory {_ASIDE} cannot take them: a full disk?). They are removed and never served "
                f"again, but {lost / 2**20:.1f} MiB of one stay in use, uncounted, until its readers let go.",
            )
        return freed

    def discard(self, keys: Iterable[str]) -> None:
        names = [self._stem(key) + ".item" for key in keys]
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
            self._remove([name for _, _, _, name in persist.items(self._directory)])

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
        return sum(_exists(self._directory, self._stem(key) + ".item") for key in keys)

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

    def process_stats(self, key: str | None = None) -> dict[str, int]:
        """
        Args:
            key: a key that the store's :py:meth:`hash_transform` made: the counts of the items of its transforms
                alone (one dataset's, as a rule).

        Returns:
            the counts of :py:meth:`stats` for this process alone (each DataLoader worker counts for itself).
        """
        tag = None if key is None else self._tag(key)
        return (self._counters if tag is None else tag.counts).local()

    def close(self) -> None:
        """Stop using the store here; remove it if no other process uses it."""
        self._gone = True
        if self._finalizer is not None:
            self._finalizer()
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
            at = self._subdir(_NOTES)
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
            at = self._subdir(_NOTES)
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
                _unlink(self._subdir(_NOTES), name)
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
            at = self._subdir(_KEPT)
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
            read = _read(self._subdir(_KEPT), name)
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


class _Tag:
    """What this process knows of the cached transforms of one ``hash_transform`` digest: their ids, its counts."""

    def __init__(self, operations: Any, persistent: bool) -> None:
        self.operations = operations
        self.counts = counters.Counters(persistent=persistent)


class _NoCaller:
    """A block that counts for no dataset (a key that no :py:meth:`SharedCacheStore.hash_transform` made)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_CALLER = _NoCaller()


def _on_behalf(tag: _Tag | None) -> Any:
    """Count the store's events of the block for the transforms of ``tag`` too (one dataset's, as a rule)."""
    return _NO_CALLER if tag is None else counters.on_behalf(tag.counts)


def _local(tag: _Tag | None, item: Any, default: Any) -> Any:
    """``item`` with the ids of this process's transforms of ``tag`` (``default`` where a place leads nowhere)."""
    return item if tag is None or tag.operations is None else tag.operations.local(item, default)


def _operation_ids(cached: list) -> Any:
    """The ids of ``cached`` in the operations of the items that they compute (``monai_sharedcache.operations``)."""
    from monai_sharedcache.operations import OperationIds

    return OperationIds(cached)


def _carry_tags(tags: dict[str, _Tag]) -> dict[str, bytes]:
    """
    The transforms of each tag, pickled for a store pickled to a DataLoader worker (their items invert there too);
    transforms that pickle cannot store are left out (the dataset that holds them would not pickle either).
    """
    carried = {}
    for tag, known in tags.items():
        try:
            carried[tag] = pickle.dumps(known.operations)
        except Exception:
            pass
    return carried


def _carried_tags(carried: dict[str, bytes], persistent: bool) -> dict[str, _Tag]:
    """The tags of :py:func:`_carry_tags`, from the store's own pickle, each with counts of this process."""
    tags = {}
    for tag, data in carried.items():
        try:
            tags[tag] = _Tag(pickle.loads(data), persistent)
        except Exception:  # a transform that this process cannot import: its items keep their places
            pass
    return tags


def _need_keyed() -> None:
    """Raise for an index where a key was due: a ``CacheDataset`` of a MONAI without keyed runtime caches."""
    import monai

    raise TypeError("SharedCacheStore as a runtime_cache " + NEEDS_KEYED.format(version=monai.__version__))


def _opt_in() -> None:
    """Register the store as a keyed cache of MONAI's ``CacheDataset``, where MONAI has the protocol (the series)."""
    from monai import data

    keyed = getattr(data, "KeyedCache", None)
    if keyed is not None and not issubclass(SharedCacheStore, keyed):
        keyed.register(SharedCacheStore)
