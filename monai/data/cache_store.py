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
"""A runtime cache that the processes of one machine share without a server: :py:class:`SharedCacheStore`."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch

from monai.data import _cache_format as fmt
from monai.data import _cache_locks as locks

__all__ = ["SharedCacheStore"]

_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
_TMP = ".tmp"
# errors after which a process stops writing to the store: they do not go away by themselves
_PERSISTENT = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", -1)}
_WARN_LOCK = threading.Lock()
_UNCACHED = "Items are computed without the cache from now on in this process."


def _attach(cls: type[SharedCacheStore], path: str, ident: tuple[int, int]) -> SharedCacheStore:
    """Unpickle a store without participating (in a DataLoader worker, say): open and check its directory anew."""
    store = cls.__new__(cls)
    try:
        d = locks.Dir(path, mark=True)
    except FileNotFoundError as err:
        store._setup(path, None)
        store._warn_once("the directory is gone", err)
        return store
    if (d.ident.st_dev, d.ident.st_ino) != ident:
        raise PermissionError(
            f"SharedCacheStore: refusing {path!r}, no longer the directory of the store that was pickled (it was "
            "renamed away and replaced): its items are unpickled when read. Make a new store."
        )
    store._setup(path, d)
    return store


class SharedCacheStore:
    """
    A cache of items that the processes of one machine share without a server: each item is a file in a private
    directory, by default on ``/dev/shm`` (in memory).

    An item is written once to a temporary file, published under its key by an atomic ``os.replace``; a read maps it
    privately and copy-on-write: arrays and tensors are views of the mapping, with no copy and no open descriptor. A
    store pickles as its path, so DataLoader workers receive it with what holds it; other processes of the same user
    join it with ``SharedCacheStore(path)``.
    It is removed when the last process that made or joined it closes it or exits.

    Args:
        path: the directory of an existing store to join; ``None`` to make a new store.
        root: where to make a new store: by default the directory named by the environment variable
            ``MONAI_CACHE_ROOT``, else ``/dev/shm`` if writable, else the temporary directory.

    Raises:
        NotImplementedError: on a platform without ``fcntl`` (Windows).
        FileNotFoundError: ``path`` does not exist, or ``MONAI_CACHE_ROOT`` names no directory.
        PermissionError: ``path`` is not a private directory of this user, or not one that a store made.
        ValueError: both ``path`` and ``root`` are given.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            item = store.get_or_compute(key, compute)  # computed once, then read back by every process
            other = SharedCacheStore(store.path)  # in another process of this user, on this machine
            store.close()  # the last one to close (or exit) removes the directory

    Note:
        A store never makes a job fail: a fault leads to one warning per process, and items computed without it.

    Warning:
        Items are unpickled when read, which can run code: a store joins only a directory of this user closed to
        others (mode ``0o700``, as made). It holds CPU tensors only, and is for the processes of one machine.
    """

    supported = locks.AVAILABLE  # whether stores can be made here (not without fcntl, as on Windows)
    durable = False  # whether an item is synced to its disk before it is published: for a subclass kept on a disk

    def __init__(self, path: str | os.PathLike | None = None, *, root: str | os.PathLike | None = None) -> None:
        if not self.supported:
            raise NotImplementedError(
                "SharedCacheStore needs fcntl file locks, which this platform lacks. Use "
                "CacheDataset(runtime_cache='process'), which keeps the cache in a multiprocessing Manager list here."
            )
        if path is not None:
            if root is not None:
                raise ValueError("root is where a new store is made: give path or root, not both.")
            path = os.path.abspath(os.fspath(path))
            self._setup(path, locks.Dir(path, mark=True))
            try:
                self._hold(locks.join(self._dir))
            except FileNotFoundError as err:  # removed by its last participant meanwhile
                self._gone = True
                self._warn_once("the directory is gone", err)
            return
        root = locks.default_root() if root is None else os.fspath(root)
        new = locks.Dir(os.path.abspath(tempfile.mkdtemp(prefix=locks.PREFIX, dir=root)))  # mode 0o700
        try:
            held = locks.create(new)
            os.mkdir(_TMP, 0o700, dir_fd=new.fd)
        except BaseException:
            new.remove()
            raise
        self._setup(new.path, new)
        self._hold(held)

    def _setup(self, path: str, d: locks.Dir | None) -> None:
        """Set the store up on its directory ``d``, opened and checked; ``None``: gone, or not to be used."""
        self._dir = cast(locks.Dir, d)  # None only for a store that is gone, which never uses it
        self._path, self._tmp = path, cast(locks.Dir, None if d is None else locks.Dir(path, _TMP, d))
        self._ident = (0, 0) if d is None else (d.ident.st_dev, d.ident.st_ino)  # what unpickling checks
        self._gone, self._writable = d is None, True
        self._warned: set[tuple[int, str]] = set()  # (pid, what): each process warns once per store
        self._finalizer: weakref.finalize | None = None

    def _hold(self, held: locks.Held) -> None:
        # at close(), garbage collection or exit; a forked child has closed the inherited lock already
        self._finalizer = weakref.finalize(self, locks.leave, self._dir, held)

    @property
    def path(self) -> str:
        """The directory of the store."""
        return self._path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def __reduce__(self) -> tuple:
        return _attach, (type(self), self._path, self._ident)

    def get(self, key: str, default: Any = None) -> Any:
        """The item stored under ``key`` (arrays and tensors: private copy-on-write views), or ``default``."""
        item = self._read(key)
        return default if item is fmt.MISS else item

    def put(self, key: str, item: Any) -> bool:
        """
        Store ``item`` under ``key``, atomically; whether it was stored: not after a fault, nor an item that pickle
        cannot store or that holds a tensor off the CPU (one warning says how to keep such items cached).
        """
        if self._gone or not self._writable:
            return False
        try:
            chunks, total = fmt.encode(key, item)
        except Exception as err:  # before any file is made; the item is computed without the cache
            self._warn_once("cannot store some items", err, fmt.UNSTORABLE)
            return False
        tmp = f"{self.file_stem(key)}-{secrets.token_hex(8)}"
        try:
            fd = self._tmp.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                fmt.write_item(fd, chunks)
                if self.durable:
                    os.fsync(fd)
                os.replace(tmp, self._file(key, ".item"), src_dir_fd=self._tmp.fd, dst_dir_fd=self._dir.fd)
            finally:
                os.close(fd)
        except OSError as err:
            locks.unlink_quiet(tmp, self._tmp)
            self._fault("cannot write items", err)
            return False
        except BaseException:
            locks.unlink_quiet(tmp, self._tmp)
            raise
        return True

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        """The item stored under ``key``, else ``compute()``, which is stored."""
        item = self._read(key)
        if item is fmt.MISS:
            item = compute()
            self.put(key, item)
        return item

    def close(self) -> None:
        """Stop using the store here; remove it if no other process uses it. A DataLoader worker's copy never does."""
        self._gone = True
        if self._finalizer is not None:
            self._finalizer()

    def map_item(self, fd: int, st: os.stat_result, name: str) -> memoryview:
        """A private copy-on-write mapping of the large item file ``name``, open at ``fd`` and checked (``st``)."""
        try:  # no descriptor kept: unmapped with the last view; a subclass may reuse an earlier mapping instead
            storage = torch.UntypedStorage.from_file(f"{fmt.FD_DIR}/{fd}", shared=False, nbytes=st.st_size)
        except RuntimeError as err:  # truncated meanwhile, or the mapping failed
            raise OSError(errno.EIO, str(err), name) from err
        return memoryview(cast(Any, torch.empty(0, dtype=torch.uint8).set_(cast(Any, storage)).numpy()))

    def file_stem(self, key: str) -> str:
        """The name of ``key``'s files (``<stem>.item``): ``key`` if a safe name, else its sha256; a subclass may add a
        version to it."""
        return key if _SAFE_KEY.fullmatch(key) else hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _file(self, key: str, suffix: str) -> str:
        return self.file_stem(key) + suffix  # in the store's directory

    def _read(self, key: str) -> Any:
        path, ino = self._file(key, ".item"), None
        try:
            if not self._gone:
                buf, ino = fmt.read_file(self._dir, path, self.map_item)
                return fmt.decode(buf, key)
        except FileNotFoundError:
            pass
        except OSError as err:
            self._warn_once("cannot read items", err)
        except fmt.CorruptItemError:
            try:
                if self._dir.stat(path).st_ino == ino:  # not one published since
                    self._dir.unlink(path)
            except OSError:
                pass
        except Exception as err:  # e.g. a class that this process cannot import
            self._warn_once("cannot unpickle items", err)
        return fmt.MISS

    def _fault(self, what: str, err: OSError) -> None:
        """Degrade after an error of the file system: warn once, and stop using the store or writing to it."""
        if self._dir.moved():
            self._gone, what = True, "the directory is gone or replaced"
        elif err.errno in _PERSISTENT:
            self._writable = False
        self._warn_once(what, err)

    def _warn_once(self, what: str, why: object, then: str = _UNCACHED) -> None:
        """Warn, once per process and store, that ``what`` (because of ``why``), and ``then``."""
        with _WARN_LOCK:
            if (os.getpid(), what) in self._warned:
                return
            self._warned.add((os.getpid(), what))
        why = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
        warnings.warn(f"SharedCacheStore {self._path}: {what} ({why}). {then}", RuntimeWarning, stacklevel=3)
