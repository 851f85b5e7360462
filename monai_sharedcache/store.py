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
- small notes that its processes keep for each other (which cached transforms cache which inputs), and records kept
  across the runs of a persistent store (the digests of input files), which the fork's keys
  (:py:mod:`monai_sharedcache.keys`) keep there: JSON files in its own directories ``.notes`` and ``.kept``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable
from typing import Any, cast

from monai.data import cache_store, shared_cache
from monai_sharedcache import _memory as memory
from monai_sharedcache import _pool as pool

__all__ = ["SharedCacheStore", "create_shared_cache"]

_NOTES = ".notes"  # the store's own directories: of the notes of its processes (add_note), and of
_KEPT = ".kept"  # the records that a persistent store keeps across runs (keep)
_NAME = re.compile(r"[0-9A-Za-z_-]{1,128}")


class SharedCacheStore(cache_store.SharedCacheStore):
    """
    :py:class:`monai.data.cache_store.SharedCacheStore`, whose reads of large items reuse their mappings on Linux,
    and whose reserve counts the cgroup's memory limit on a memory-backed file system.

    Its arguments, pickling and guarantees are the core store's: see there. ``from monai.data import
    SharedCacheStore`` gives this class in the fork's wheel.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            ds = CacheDataset(data, transform, runtime_cache=store)
    """

    _memory: bool | None = None  # whether its items are memory of this process's cgroup (tmpfs)

    def map_item(self, fd: int, st: os.stat_result, name: str) -> memoryview:
        if not pool.ENABLED:
            return super().map_item(fd, st, name)
        ident = (os.path.join(self.path, name), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return pool.map_private(fd, st.st_size, ident)

    def free_space(self) -> tuple[int, int] | None:
        space = super().free_space()
        if self._memory is None:  # decided once per process and store: a store does not move
            self._memory = memory.fs_type(self.path) in memory.MEMORY_FS
        room = memory.cgroup_room() if self._memory else None
        if room is not None and (space is None or room[1] < space[0]):  # the container's memory is the shorter
            return room[1], room[0]
        return space

    def discard(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        super().discard(keys)
        if keys:  # kept mappings of removed items would pin their pages
            self._purge()

    def clear(self) -> None:
        super().clear()
        self._purge()

    def close(self) -> None:
        super().close()
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
                read = at.read_checked(name)
                if read is not None:
                    found[name] = json.loads(read[0])
            except (OSError, ValueError):  # gone, or being written: no note
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
            read = self.subdir(_KEPT).read_checked(name)
            return None if read is None else json.loads(read[0])
        except (OSError, ValueError):
            return None


def _check(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"a note's or record's name is 1 to 128 letters, digits, '_' or '-', got {name!r}.")


def _unlink(at: Any, name: str) -> None:
    try:
        at.unlink(name)
    except OSError:
        pass


def create_shared_cache(group: Any = None, **kwargs: Any) -> SharedCacheStore:
    """
    :py:func:`monai.data.shared_cache.create_shared_cache`, whose stores are this module's :py:class:`SharedCacheStore`
    (``from monai.data import create_shared_cache`` gives this function in the fork's wheel).

    Args:
        group: the process group whose ranks share one store per node; ``None`` for the default group.
        kwargs: the other arguments of the core's ``create_shared_cache``.

    Returns:
        this rank's handle of its node's store.
    """
    return cast(SharedCacheStore, shared_cache.create_shared_cache(group, store_type=SharedCacheStore, **kwargs))
