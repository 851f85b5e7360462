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
The item files of a :py:class:`monai.data.SharedCacheStore` directory: reading, writing and removing them, and what
happens when the file system fails.

Every fault of the file system (a removed directory, a full ``/dev/shm``, a permission error) turns the store into a
cache that misses, with one warning per process, so that training goes on: a cache must never be the reason a job
dies. The store itself (``cache_store``) adds what concerns several processes: lifetime, claims and the capacity.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from monai.data import cache_coord as coord
from monai.data.cache_budget import ENV_ROOT, Budget
from monai.data.cache_counters import REFUSED, Counters
from monai.data.cache_format import MISS, _CorruptItem, _decode, _encode, _write_item
from monai.data.cache_mapping import _POOL, _read_file

_WARN_LOCK = threading.Lock()
_ITEM_SUFFIX = ".item"
_TMP_DIR = ".tmp"
_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
# errors after which this process stops writing to the store (they will not go away by themselves)
_PERSISTENT_WRITE_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", -1)}


def _remove_if_same(path: str, ino: int) -> None:
    """Remove ``path`` if it is still the file with inode ``ino`` (not one published since)."""
    try:
        if os.lstat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass


class ItemFiles:
    """
    The items of one store directory, addressed by key; the base of :py:class:`monai.data.SharedCacheStore`.

    Attributes set by the store: ``_path`` (the directory), ``_tmp_dir``, ``_gone`` (the directory was removed or
    the store closed: always miss), ``_writable`` (``False`` after a persistent write error), ``_budget``,
    ``_counters`` and ``_warned``.
    """

    _path: str
    _tmp_dir: str
    _gone: bool
    _writable: bool
    _budget: Budget
    _counters: Counters
    _warned: set[tuple[int, str]]  # (pid, what) of the warnings this store gave: once per process

    def get(self, index: int, key: str, default: Any = MISS) -> Any:
        """
        Read the item stored under ``key``.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            default: what to return if there is no readable item for ``key``.

        Returns:
            a new object graph of the item (arrays and tensors are views of a private copy-on-write mapping),
            or ``default``.
        """
        if self._gone:
            return default
        path = self._item_path(key)
        try:
            buf, ino = _read_file(path)
        except FileNotFoundError:
            return default
        except OSError as err:
            self._warn_once("cannot read items", err)
            return default
        try:
            item = _decode(buf, key)
        except _CorruptItem:
            _remove_if_same(path, ino)
            return default
        except Exception as err:  # e.g. a class that this process cannot import
            self._warn_once("cannot unpickle items", err)
            return default
        return default if item is MISS else item

    def put(self, index: int, key: str, item: Any) -> bool:
        """
        Store ``item`` under ``key``, replacing what is stored under it, atomically.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            item: any picklable object; tensors must be on the CPU.

        Returns:
            whether the item was stored (``False`` after a file system fault, see the class documentation).

        Raises:
            TypeError: the item holds a tensor that is not on the CPU.
            Exception: whatever pickling the item raises (e.g. for an unpicklable object).
        """
        if self._gone or not self._writable:
            self._counters.add(REFUSED)
            return False
        chunks, total = _encode(key, item)  # raises before any file is created
        why = self._budget.room_for(total)
        if why is not None:
            self._counters.add(REFUSED)
            self._warn_budget(total, why)
            return False
        if not self._publish(self._stem(key), self._item_path(key), lambda fd: _write_item(fd, chunks, total)):
            self._counters.add(REFUSED)
            return False
        self._budget.written(total)
        coord.clean_dead_temps(self._tmp_dir)
        return True

    def invalidate(self, old_keys: Sequence[str], new_keys: Sequence[str]) -> None:
        """
        Remove the items of the keys in ``old_keys`` but not in ``new_keys``, and nothing else: other datasets or
        processes may keep other items in the same store.

        Args:
            old_keys: the keys before the change.
            new_keys: the keys after the change.
        """
        if self._gone:
            return
        removed = set(old_keys) - set(new_keys)
        if removed:
            _POOL.purge(os.path.join(self._path, ""))  # kept mappings of removed items would pin their pages
        for key in removed:
            try:
                os.unlink(self._item_path(key))
            except FileNotFoundError:
                if not os.path.isdir(self._path):
                    self._fault("cannot remove items", FileNotFoundError(errno.ENOENT, "no such directory", self._path))
                    return
            except OSError as err:
                self._fault("cannot remove items", err)
                return

    @staticmethod
    def _stem(key: str) -> str:
        return key if _SAFE_KEY.fullmatch(key) else hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _item_path(self, key: str) -> str:
        return os.path.join(self._path, self._stem(key) + _ITEM_SUFFIX)

    def _publish(self, stem: str, dest: str, write: Callable[[int], None], what: str = "cannot write items") -> bool:
        """
        Write a file with ``write(fd)`` into a temporary file named after ``stem``, locked until it is published at
        ``dest`` with an atomic ``os.replace`` (a temporary file without a lock is a dead writer's). Whether it was
        published: ``False`` after a file system fault, which is handled as ``what``.
        """
        tmp = self._tmp_name(stem)
        try:
            held = coord.open_temp(tmp)
            try:
                write(held.fd)
                os.replace(tmp, dest)
            finally:
                held.close()
        except OSError as err:
            coord.unlink_quiet(tmp)
            self._fault(what, err)
            return False
        except BaseException:
            coord.unlink_quiet(tmp)
            raise
        return True

    def _tmp_name(self, stem: str) -> str:
        return os.path.join(self._tmp_dir, f"{stem}-{secrets.token_hex(8)}")

    def _fault(self, what: str, err: OSError) -> None:
        """Degrade after a file system error: warn once, and stop using the store or writing to it."""
        if not os.path.isdir(self._path):
            self._gone = True
            _POOL.purge(os.path.join(self._path, ""))
            self._warn_once(f"the cache directory {self._path} is gone", err)
            return
        if isinstance(err, FileNotFoundError) and not os.path.isdir(self._tmp_dir):
            try:  # only the store's own subdirectory, never the store itself
                os.mkdir(self._tmp_dir, 0o700)
            except OSError:
                pass
        elif err.errno in _PERSISTENT_WRITE_ERRORS:
            self._writable = False
        self._warn_once(f"{what} in {self._path}", err)

    def _first_time(self, what: str) -> bool:
        """Whether ``what`` happens for the first time in this process and store (for warnings given once)."""
        token = (os.getpid(), what)  # the pid: a forked child warns for itself
        with _WARN_LOCK:
            if token in self._warned:
                return False
            self._warned.add(token)
        return True

    def _warn_once(self, what: str, err: BaseException) -> None:
        """Warn once per process and store that the cache cannot be used as it should, and why."""
        if not self._first_time(what):
            return
        warnings.warn(
            f"CacheDataset runtime cache ({type(self).__name__}): {what} ({type(err).__name__}: {err}). "
            "Items are computed without the cache from now on in this process.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _warn_budget(self, nbytes: int, why: str) -> None:
        """Warn once per process and store that items past the budget are not stored, why, and what to do."""
        if not self._first_time("budget"):
            return
        warnings.warn(
            f"SharedCacheStore {self._path}: not storing an item of {nbytes / 2**20:.1f} MiB because {why}. Items "
            "past the budget are computed without being stored (stats()['refused'] counts them). To cache more: "
            "give the container more shared memory (docker run --shm-size=..., or --ipc=host), put the cache on a "
            f"local disk or another tmpfs ({ENV_ROOT}=/path, or create_shared_cache(root=...)), or set the "
            "store's reserve / max_bytes.",
            RuntimeWarning,
            stacklevel=3,
        )
