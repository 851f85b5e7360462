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
  (:py:mod:`monai_sharedcache._memory`), which the reserve is kept of when it is less than the file system's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, cast

from monai.data import cache_store, shared_cache
from monai_sharedcache import _memory as memory
from monai_sharedcache import _pool as pool

__all__ = ["SharedCacheStore", "create_shared_cache"]


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
