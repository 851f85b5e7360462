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
A serverless runtime cache shared by processes on one machine: every item is a file in a private directory
(on ``/dev/shm`` by default), written atomically and read through a private copy-on-write memory mapping.

See :py:class:`SharedCacheStore`. The item file format is in :py:mod:`monai.data.cache_format`, reading and the
reuse of mappings in :py:mod:`monai.data.cache_mapping`, the item files of a directory and its faults in
:py:mod:`monai.data.cache_items`, the coordination of processes (participation, claims, leftovers) in
:py:mod:`monai.data.cache_coord`, the budget in :py:mod:`monai.data.cache_budget`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import Any

from monai.data import cache_coord as coord
from monai.data.cache_budget import Budget, scan_items
from monai.data.cache_counters import COMPUTED, HITS, MISSES, REFUSED, Counters
from monai.data.cache_format import _VERSION, MISS, _write_all
from monai.data.cache_items import _TMP_DIR, ItemFiles
from monai.data.cache_mapping import _POOL

__all__ = ["MISS", "SharedCacheStore"]

_CLAIM_SUFFIX = ".claim"
_META_FILE = ".meta"


def _leave(path: str, held: coord.Held | None) -> None:
    """Finalizer of a participating store: leave, and forget the mappings of the store if it was removed."""
    if coord.leave_participation(path, held):
        _POOL.purge(path + os.sep)


def _attach_pickled(cls: type[SharedCacheStore], path: str, claim_timeout: float) -> SharedCacheStore:
    """Unpickle a store: attach to its directory without participating; a store whose directory is gone misses."""
    try:
        return cls(path, participate=False, claim_timeout=claim_timeout)
    except FileNotFoundError as err:
        store = cls.__new__(cls)
        store._setup(path, claim_timeout)
        store._gone = True
        store._warn_once(f"the cache directory {path} is gone", err)
        return store


class SharedCacheStore(ItemFiles):
    """
    A runtime cache shared by all the processes of one machine, without a server: every item is a file in a private
    directory, by default on ``/dev/shm`` (a RAM-backed file system), named after the item's content key.

    Processes share a store by its :py:attr:`path`: the DataLoader workers of a process receive it with the dataset
    (a store pickles as its path, so this works under ``fork``, ``spawn`` and ``forkserver``); other processes, such
    as the DDP ranks of one node, attach with ``SharedCacheStore(path)``.

    How it works, in the modules that do it: the item file format and what can be stored in
    :py:mod:`monai.data.cache_format` (CPU tensors of any dtype, ``MetaTensor`` with its metadata, numpy arrays, any
    picklable object; a tensor on another device is a ``TypeError``), copy-on-write reads in
    :py:mod:`monai.data.cache_mapping`, claims and lifetime in :py:mod:`monai.data.cache_coord`, the budget in
    :py:mod:`monai.data.cache_budget`. In short: an item is written to a temporary file and published with an atomic
    ``os.replace``; every :py:meth:`get` returns a new object graph whose arrays and tensors are views of a private
    copy-on-write mapping, so a caller may modify it in place (``reads_are_private`` is ``True`` and
    ``CacheDataset`` skips its deepcopy); :py:meth:`get_or_compute` computes each missing item once across processes
    and threads; the store is removed when its last participant closes (or dies), in any PID namespace.

    Faults:
        A removed directory, a full file system or a permission error never raises: this process warns once and
        carries on as with a cache that misses (after a persistent write error such as ``ENOSPC`` it stops writing,
        but still reads what is there). A removed directory is never created again. A malformed item file counts
        as a miss and is removed.

    Budget:
        The DataLoader moves batches from its workers through shared memory, on the same ``/dev/shm`` by default,
        so a store that filled it would make the DataLoader fail (Docker's default ``/dev/shm`` is 64 MB). An item
        that would leave less than ``reserve`` bytes free, or take the store past ``max_bytes``, is computed and
        returned without being stored; each process warns once, and ``stats()["refused"]`` counts such items.
        See :py:mod:`monai.data.cache_budget` for the default.

    Security:
        Items are unpickled when read, which can run arbitrary code, so a store attaches only to a real directory
        (not a symbolic link) owned by the current user and inaccessible to others (mode ``0o700``, as created).

    Args:
        path: the directory of an existing store to attach to; ``None`` creates a new store.
        root: where to create a new store: the directory named by the environment variable ``MONAI_CACHE_ROOT``
            if set, else ``/dev/shm`` if it is a writable directory, else the system's temporary directory (macOS,
            Windows). Only used when ``path`` is ``None``.
        participate: whether this process keeps the store alive until it closes it (see
            :py:mod:`monai.data.cache_coord`).
        claim_timeout: how long, in seconds, :py:meth:`get_or_compute` waits for an item another process or thread
            is computing before it computes the item itself without storing it.
        reserve: bytes that the store keeps free on its file system, for the DataLoader's own shared memory (see
            :py:mod:`monai.data.cache_budget`); ``None`` for ``MONAI_CACHE_RESERVE_BYTES`` if set, else half the file
            system, at most 4 GiB. Only used when ``path`` is ``None``: the store's creator sets the budget for all its
            users.
        max_bytes: a cap on the total size of the store's items; ``None`` for ``MONAI_CACHE_MAX_BYTES`` if set,
            else no cap. Only used when ``path`` is ``None``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        PermissionError: ``path`` is not a private directory of the current user (see Security).
        ValueError: ``claim_timeout``, ``reserve`` or ``max_bytes`` is negative, or ``root``, ``reserve`` or
            ``max_bytes`` is given with ``path``.
        FileNotFoundError: ``MONAI_CACHE_ROOT`` names no directory.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            store.resize(2)
            store.put(0, "3f2a", {"image": torch.zeros(1, 8, 8)})
            item = store.get(0, "3f2a")  # {"image": tensor(...)}, a private copy-on-write view
            other = SharedCacheStore(store.path)  # e.g. in another process of the same user
            other.get(0, "3f2a")
            other.close()
            store.close()  # the last participant to close removes the directory

    Limitations:
        Keys map to file names: a key that is not ``[0-9A-Za-z_-]{1,128}`` is stored under its SHA-256 digest.
        The key is also recorded in the file and checked on read, so a file for another key is a miss (which also
        covers case-insensitive file systems). Windows is supported on a best-effort basis only: without ``fcntl``
        nothing is removed (a store must be removed by hand), claims exclude no one (an item may be computed more
        than once), there is no ownership or mode check, and an item that is being read cannot be replaced. A store
        is for the processes of one machine: ``flock`` does not coordinate machines on a network file system.
    """

    reads_are_private = True

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        root: str | os.PathLike | None = None,
        participate: bool = True,
        claim_timeout: float = 600.0,
        reserve: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if claim_timeout < 0:
            raise ValueError(f"claim_timeout must be non-negative, got {claim_timeout}.")
        Budget("", reserve, max_bytes)  # checks the values before anything is created
        if path is None:
            root_dir = coord.default_root() if root is None else os.fspath(root)
            coord.cleanup_leftovers(root_dir)
            new_path = os.path.abspath(tempfile.mkdtemp(prefix=coord._PREFIX_DIR, dir=root_dir))
            held = None
            try:
                held = coord.create_participation(new_path)  # first: cleaners never see the store unheld
                os.mkdir(os.path.join(new_path, _TMP_DIR), 0o700)
                Budget.create(new_path, reserve, max_bytes)
                self._setup(new_path, claim_timeout)
            except BaseException:
                shutil.rmtree(new_path, ignore_errors=True)
                if held is not None:
                    held.close()
                raise
            if participate:
                self._hold(held)
            elif held is not None:
                held.close()  # a store that no one participates in: a leftover for the next cleanup
            return
        if root is not None or reserve is not None or max_bytes is not None:
            raise ValueError("root, reserve and max_bytes are only used to create a new store (path=None).")
        dir_path = os.path.abspath(os.fspath(path))
        coord.check_private_dir(dir_path)
        self._setup(dir_path, claim_timeout)
        if participate:
            try:
                self._hold(coord.join_participation(dir_path))
            except FileNotFoundError as err:  # removed by its last participant, or as a leftover, meanwhile
                self._gone = True
                self._warn_once(f"the cache directory {dir_path} is gone", err)
                return
        try:  # never os.makedirs: a store that has just been removed must not be created again
            os.mkdir(self._tmp_dir, 0o700)
        except FileExistsError:
            pass

    def _setup(self, path: str, claim_timeout: float) -> None:
        self._path = path
        self._tmp_dir = os.path.join(path, _TMP_DIR)
        self._claim_timeout = float(claim_timeout)
        self._gone = False  # the directory was removed (or this store closed): always miss
        self._writable = True  # False after a persistent write error
        self._local = threading.local()  # per thread: the claims it holds
        self._finalizer: weakref.finalize | None = None
        self._budget = Budget.load(path)  # as recorded by the process that created the store
        self._counters = Counters(path)
        self._warned: set[tuple[int, str]] = set()  # (pid, what): not keyed by id(), which a later store may reuse

    def _hold(self, held: coord.Held | None) -> None:
        # runs at close(), at garbage collection and at interpreter exit; a forked child no longer holds anything
        if held is not None:
            self._finalizer = weakref.finalize(self, _leave, self._path, held)

    @property
    def path(self) -> str:
        """The directory of the store."""
        return self._path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def __reduce__(self) -> tuple:
        """Pickle as the path: unpickling attaches to the same directory with ``participate=False``."""
        return _attach_pickled, (type(self), self._path, self._claim_timeout)

    # -- slots ----------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """
        The capacity last set by :py:meth:`resize` in any process.

        Returns:
            the number of slots, ``0`` if never set or unreadable.
        """
        try:
            with open(os.path.join(self._path, _META_FILE), "rb") as f:
                return int(json.loads(f.read())["capacity"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def resize(self, n: int) -> None:
        """
        Record the capacity ``n``, seen by every process. Items are addressed by key, so none is removed.

        Args:
            n: the number of slots.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"the capacity must be non-negative, got {n}.")
        if self._gone:
            return
        meta = memoryview(json.dumps({"capacity": int(n), "format": _VERSION}).encode())
        dest = os.path.join(self._path, _META_FILE)
        self._publish("meta", dest, lambda fd: _write_all(fd, meta), "cannot record the capacity")

    def get_or_compute(self, index: int, key: str, compute: Callable[[], Any]) -> Any:
        """
        Return the item stored under ``key``; on a miss compute and store it, once across processes and threads.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            compute: computes the item; called at most once per call, and not at all on a hit.

        Returns:
            the item.

        Raises:
            Exception: whatever ``compute`` raises (the claim is released first), or what :py:meth:`put` raises.
        """
        item = self.get(index, key)
        if item is not MISS:
            self._counters.add(HITS)
            return item
        self._counters.add(MISSES)
        item, _ = self._compute_once(index, key, compute, lambda: self.get(index, key), wait=True)
        return item

    def fill(self, index: int, key: str, compute: Callable[[], Any], wait: bool = True) -> bool:
        """
        Make sure that an item is stored under ``key``, without reading it: compute and store it unless it is
        stored already or (with ``wait=False``) another process or thread is computing it.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            compute: computes the item; called at most once, and only if no other process has stored it.
            wait: whether to wait for another process or thread computing the item (and to compute it if that one
                dies or does not publish it within ``claim_timeout``), rather than return ``False`` at once.

        Returns:
            ``False`` if the item is being computed elsewhere and ``wait`` is ``False``, else ``True`` (the item is
            stored, or was computed but refused by the budget, or the store is unusable).

        Raises:
            Exception: whatever ``compute`` raises (the claim is released first), or what :py:meth:`put` raises.
        """
        path = self._item_path(key)
        present = lambda: True if os.path.exists(path) else MISS  # noqa: E731
        if self._gone or not self._writable or present() is True:
            return True  # an item that could not be stored would be computed for nothing
        _, done = self._compute_once(index, key, compute, present, wait)
        return done

    def _compute_once(
        self, index: int, key: str, compute: Callable[[], Any], lookup: Callable[[], Any], wait: bool
    ) -> tuple[Any, bool]:
        def counted() -> Any:
            self._counters.add(COMPUTED)
            return compute()

        def publish(item: Any) -> None:
            self.put(index, key, item)  # counts the item as refused if it is not stored

        if self._gone or not self._writable:
            item = counted()
            self._counters.add(REFUSED)
            return item, True
        claim = self._claim_path(key)
        try:
            item, timed_out = coord.compute_once(
                claim, lookup, counted, publish, self._claim_timeout, self._held_claims(), MISS, wait
            )
        except coord.ClaimUnavailable as err:
            self._fault("cannot create claim files", err)
            item, timed_out = counted(), False
            self._counters.add(REFUSED)
        if timed_out:
            self._counters.add(REFUSED)
            timeout = TimeoutError(f"{claim} was held for more than claim_timeout={self._claim_timeout} s")
            self._warn_once("waited too long for another process to compute an item", timeout)
        return item, item is not MISS  # MISS only without waiting, for an item being computed elsewhere

    def _held_claims(self) -> set[str]:
        held = getattr(self._local, "claims", None)
        if held is None:
            held = self._local.claims = set()
        return held  # type: ignore[no-any-return]

    def stats(self) -> dict[str, int]:
        """
        Count the items of the store and the events of all its processes (one directory scan; any process can call
        it, including processes that only read).

        Returns:
            ``{"filled": number of items, "capacity": len(self), "nbytes": total size of the item files,
            "hits", "misses": reads by :py:meth:`get_or_compute` that found / did not find the item,
            "computed": items computed by :py:meth:`get_or_compute` and :py:meth:`fill`, "refused": items computed
            but not stored (budget, see Budget, or a file system fault)}``, the counts over all processes that
            used the store, including those that are gone.
        """
        filled, nbytes = scan_items(self._path)
        return {"filled": filled, "capacity": len(self), "nbytes": nbytes, **self._counters.total()}

    def process_stats(self) -> dict[str, int]:
        """
        The events of this process (``hits``, ``misses``, ``computed``, ``refused``, as in :py:meth:`stats`).

        Returns:
            the counts of this process, through this object and the copies it passed to its DataLoader workers
            before they started (each worker counts for itself).
        """
        return self._counters.local()

    # -- lifetime -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """
        Stop using the store in this object. If it participates, release its participation and, if no participant
        remains in any process, remove the whole directory. Idempotent; a forked child (e.g. a DataLoader worker)
        that inherited a participating store holds no participation, so it only disables its copy.
        """
        self._gone = True
        if self._finalizer is not None:
            self._finalizer()  # a weakref.finalize runs at most once
        _POOL.purge(os.path.join(self._path, ""))

    @staticmethod
    def cleanup_leftovers(root: str | os.PathLike | None = None) -> list[str]:
        """Remove the store directories left in ``root`` by processes that are gone: ``monai-cache-*`` directories of
        the current user in which no process participates (see :py:mod:`monai.data.cache_coord`). Directories without a
        lock file (being created, or of crashed creators) are removed only once they have not been modified for a few
        seconds.

        Args:
            root: the directory to clean; by default the default root of new stores.

        Returns:
            the removed directories.
        """
        return coord.cleanup_leftovers(coord.default_root() if root is None else os.fspath(root))

    # -- helpers --------------------------------------------------------------------------------------------------

    def _claim_path(self, key: str) -> str:
        return os.path.join(self._path, self._stem(key) + _CLAIM_SUFFIX)
