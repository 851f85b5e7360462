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
import numbers
import os
import re
import secrets
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from monai.data import _cache_format as fmt
from monai.data import _cache_locks as locks

__all__ = ["SharedCacheStore"]

_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
_TMP = ".tmp"
# errors that do not go away by themselves: the process stops writing
_PERSISTENT = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", -1)}
_NO_ROOM = {errno.ENOSPC, errno.EROFS, getattr(errno, "EDQUOT", -1)}
_UNCACHED = "Items are computed without the cache from now on in this process."
_UNSAFE = "Such items are computed without being stored."
ENV_RESERVE = "MONAI_CACHE_RESERVE_BYTES"
_ROOT = "A root must be an existing directory where this user can make directories."
_MORE = (
    "Such items are computed without being stored. To cache more: give the container more shared memory (docker run "
    f"--shm-size=..., or --ipc=host), put the cache on a local disk or another tmpfs ({locks.ENV_ROOT}=/path, or "
    "SharedCacheStore(root=...)), or set the store's reserve."
)


def _attach(
    cls: Any, path: str, ident: tuple[int, int], reserve: int | None = None, safe: bool = True
) -> SharedCacheStore:
    """Unpickle a store without using it (in a DataLoader worker): its directory is opened and checked anew."""
    store: SharedCacheStore = cls.__new__(cls)
    store.reserve, store.weights_only = reserve, safe
    if ident == (0, 0):  # never made (no room): it stays so
        store._setup(path, None)
        return store
    try:
        d = locks.Dir(path, mark=True)
        if (d.ident.st_dev, d.ident.st_ino) != ident:
            raise PermissionError(
                f"SharedCacheStore: refusing {path!r}, no longer the directory of the store that was pickled (it was "
                "renamed away and replaced): its items are unpickled when read. Make a new store."
            )
        store._setup(path, d)
    except FileNotFoundError as err:  # removed by its last user, maybe while this process opened it
        store._setup(path, None)
        store._warn_once("the directory is gone", err)
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


class SharedCacheStore:
    """
    A cache that the processes of one machine share without a server, to pass as the ``runtime_cache`` of
    :py:class:`monai.data.CacheDataset`: each item is a file in a private directory, by default on ``/dev/shm``,
    published by an atomic rename and read as private copy-on-write views of its mapping. DataLoader workers receive
    the store pickled as its path; other processes of the user join it with ``SharedCacheStore(path)``. The last
    process that uses the store removes it, and a new store removes those of crashed runs in its root. An item that
    would leave less than ``reserve`` bytes free on the file system, which the DataLoader's batches need, is computed
    without being stored. A fault never fails the job: it gives one warning per process, and items computed without
    the store.

    Args:
        path: the directory of an existing store to join; ``None`` to make a new store.
        root: where to make a new store; by default ``$MONAI_CACHE_ROOT``, else ``/dev/shm``, else the temporary
            directory.
        reserve: bytes that this process keeps free on the store's file system; by default
            ``$MONAI_CACHE_RESERVE_BYTES``, else half the file system, at most 4 GiB.
        weights_only: as ``PersistentDataset``'s: items are read with an allow-list of types (tensors, arrays and
            scalars, MONAI's tensors and enums, plain builtins, pydicom's ``UID``, and those of
            ``torch.serialization.add_safe_globals``), so reading imports no module and calls nothing else, and an item
            of another type (an object array, an instance of a class of yours) is computed without being stored, with
            one warning per type; ``False`` unpickles any type, which can run code: only for a store whose directory no
            one else could have written.

    Raises:
        NotImplementedError: on a platform without ``fcntl`` (Windows).
        FileNotFoundError: ``path`` does not exist.
        NotADirectoryError: ``path`` is a file.
        PermissionError: ``path`` is not a private directory of this user that a store made.
        OSError: ``root`` cannot hold a store (with ``MONAI_CACHE_ROOT`` instead: a warning, and no cache).
        ValueError: both ``path`` and ``root`` are given, or a bad ``reserve``.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            ds = CacheDataset(data, transform, runtime_cache=store)
            other = SharedCacheStore(store.path)  # in another process of this user, on this machine

    Warning:
        A store joins only a directory of this user closed to others, as made. It holds CPU tensors only.
    """

    supported = locks.AVAILABLE  # not without fcntl (Windows)
    reserve: int | None
    weights_only: bool = True

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        root: str | os.PathLike | None = None,
        reserve: int | None = None,
        weights_only: bool = True,
    ) -> None:
        if not self.supported:
            raise NotImplementedError(
                "SharedCacheStore needs fcntl file locks, which this platform lacks. Use "
                "CacheDataset(runtime_cache='process'), which keeps the cache in a multiprocessing Manager list here."
            )
        self.reserve, self.weights_only = _reserve(reserve), bool(weights_only)
        if path is not None:
            if root is not None:
                raise ValueError("root is where a new store is made: give path or root, not both.")
            path = os.path.abspath(os.path.expanduser(os.fsdecode(path)))
            self._setup(path, locks.Dir(path, mark=True))
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
            self._setup(root if new is None else new.path, None)
            then = _MORE if err.errno in _NO_ROOM else f"{_ROOT} {_UNCACHED}"
            self._warn_once(f"cannot make a store in {where}", f"{type(err).__name__}: {err.strerror}", then)
            return
        self._setup(new.path, new)
        self._hold(held)

    def _setup(self, path: str, d: locks.Dir | None) -> None:
        """Use the opened and checked directory ``d``; ``None``: gone, or not to be used."""
        self._dir = cast(locks.Dir, d)
        self._path, self._tmp = path, cast(locks.Dir, None if d is None else locks.Dir(path, _TMP, d))
        self._ident = (0, 0) if d is None else (d.ident.st_dev, d.ident.st_ino)
        self._gone, self._writable = d is None, True
        self._warned: dict[tuple[int, str, str], object] = {}
        self._finalizer: weakref.finalize | None = None

    def _hold(self, held: locks.Held) -> None:
        self._finalizer = weakref.finalize(self, locks.leave, self._dir, held)  # at close(), collection or exit

    @property
    def path(self) -> str:
        """The directory of the store."""
        return self._path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def __reduce__(self) -> tuple:
        return _attach, (type(self), self._path, self._ident, self.reserve, self.weights_only)

    def get(self, key: str, default: Any = None) -> Any:
        """The item stored under ``key``, or ``default``."""
        item = self._read(key)
        return default if item is fmt.MISS else item

    def put(self, key: str, item: Any) -> bool:
        """Store ``item`` under ``key``; whether it was stored (not past the reserve, after a fault, or unpicklable)."""
        if self._gone or not self._writable:
            return False
        try:
            chunks, total = fmt.encode(key, item, self.weights_only)
        except Exception as err:
            then = _UNSAFE if isinstance(err, fmt.UnsafeTypeError) else fmt.UNSTORABLE
            refused = str(err) if isinstance(err, (fmt.UnsafeTypeError, fmt.OffCpuError)) else ""  # each type once
            self._warn_once("cannot store some items", err, then, refused)
            return False
        why = self.room_for(total)
        if why is not None:
            self._warn_once("not storing items past the budget", f"an item of {total / 2**20:.1f} MiB: {why}", _MORE)
            return False
        tmp = f"{self.file_stem(key)}-{secrets.token_hex(8)}"
        try:
            held = locks.open_temp(tmp, self._tmp)  # locked while written: cleaners remove dead writers' files only
            try:
                fmt.write_item(held.fd, chunks)
                # again once written, as others may have written meanwhile; the reserve alone, which counts nothing
                why = SharedCacheStore.room_for(self, 0)
                if why is not None:
                    self._warn_once("not storing items past the budget", why, _MORE)
                    locks.unlink_quiet(tmp, self._tmp)
                    return False
                os.replace(tmp, self._file(key, ".item"), src_dir_fd=self._tmp.fd, dst_dir_fd=self._dir.fd)
            finally:
                held.close()
        except OSError as err:
            locks.unlink_quiet(tmp, self._tmp)
            self._fault("cannot write items", err)
            return False
        except BaseException:
            locks.unlink_quiet(tmp, self._tmp)
            raise
        locks.clean_dead_temps(self._tmp)
        return True

    def get_or_compute(self, key: str, compute: Callable[[], Any]) -> Any:
        """The item stored under ``key``, else ``compute()``, which is stored."""
        item = self._read(key)
        if item is fmt.MISS:
            item = compute()
            self.put(key, item)
        return item

    def discard(self, keys: Iterable[str]) -> None:
        """Remove the items stored under ``keys``."""
        for key in keys:
            try:
                if not self._gone:
                    self._dir.unlink(self._file(key, ".item"))
            except FileNotFoundError:
                pass
            except OSError as err:
                self._fault("cannot remove items", err)

    def free_space(self) -> tuple[int, int] | None:
        """The bytes free and in all on the store's file system, ``None`` if unknown; a subclass may count less."""
        try:
            st = os.statvfs(self._dir.fd)
        except (OSError, AttributeError):
            return None
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def room_for(self, nbytes: int) -> str | None:
        """Why an item of ``nbytes`` bytes is not to be stored (past the reserve), or ``None``; a subclass may add."""
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

    def close(self) -> None:
        """Stop using the store here; remove it if no other process uses it."""
        self._gone = True
        if self._finalizer is not None:
            self._finalizer()

    def map_item(self, fd: int, st: os.stat_result, name: str) -> memoryview:
        """A private copy-on-write mapping of the checked item file ``name``, open at ``fd``."""
        try:  # unmapped with the last view; a subclass may reuse an earlier mapping instead
            storage = torch.UntypedStorage.from_file(f"{fmt.FD_DIR}/{fd}", shared=False, nbytes=st.st_size)
        except RuntimeError as err:
            raise OSError(errno.EIO, str(err), name) from err
        return memoryview(cast(Any, torch.empty(0, dtype=torch.uint8).set_(cast(Any, storage)).numpy()))

    def file_stem(self, key: str) -> str:
        """The name of ``key``'s files: ``key`` if safe, else its sha256; a subclass may add a version."""
        return key if _SAFE_KEY.fullmatch(key) else hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _file(self, key: str, suffix: str) -> str:
        return self.file_stem(key) + suffix

    def _read(self, key: str) -> Any:
        path, ino = self._file(key, ".item"), None
        try:
            if not self._gone:
                buf, ino = fmt.read_file(self._dir, path, self.map_item)
                return fmt.decode(buf, key, self.weights_only)
        except FileNotFoundError:
            pass
        except fmt.UnsafeTypeError as err:  # planted, or written by a store that allows more
            self._warn_once("refused items of a type not allowed", err, "Such items are computed anew.", str(err))
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
