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
there, using only the core's public names; the core never imports it. The fork's ``monai.data`` gives its names:
``from monai.data import SharedCacheStore`` is ``monai_sharedcache.SharedCacheStore``, and
``create_shared_cache`` makes stores of that class.

- :py:mod:`monai_sharedcache.store`: the store with the Linux fast path (``_pool``, ``_pages``) and the cgroup's
  memory limit (``_memory``).
"""

from __future__ import annotations

from monai_sharedcache.store import SharedCacheStore, create_shared_cache

__all__ = ["SharedCacheStore", "create_shared_cache"]
