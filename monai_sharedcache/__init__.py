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
The fork's own layer over MONAI's shared runtime cache, never proposed upstream.

The core (``monai/data/cache_store.py``, ``monai/data/shared_cache.py`` and the patched ``CacheDataset``) is what
the fork proposes to MONAI, as the pull requests of ``docs/pr/series.ini``. This package adds what does not belong
there, using only the core's public names; the core never imports it. The fork's own patches of upstream files
(``patches/fork/``) wire it in: ``from monai.data import SharedCacheStore`` is ``monai_sharedcache.SharedCacheStore``,
``create_shared_cache`` makes stores of that class, and ``CacheDataset`` keys its runtime cache by
:py:mod:`monai_sharedcache.keys`.

- :py:mod:`monai_sharedcache.store`: the store with the Linux fast path (``_pool``, ``_pages``), the cgroup's
  memory limit (``_memory``), and the notes and records that the keys keep in it.
- :py:mod:`monai_sharedcache.keys`: keys that see code, files and state; digests of files kept across runs.

Each name is imported at its first use, so that the keys do not load the store.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SharedCacheStore", "create_shared_cache", "transforms_hashing"]


def __getattr__(name: str) -> Any:
    if name in ("SharedCacheStore", "create_shared_cache"):
        from monai_sharedcache import store

        return getattr(store, name)
    if name == "transforms_hashing":
        from monai_sharedcache import keys

        return keys.transforms_hashing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
