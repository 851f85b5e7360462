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
A runtime cache for MONAI's ``CacheDataset`` that the processes of a machine share, never proposed upstream.

Upstream MONAI gets the fix of issue #5633 and a small protocol: a *keyed* runtime cache, an object with ``get`` that
``CacheDataset`` hands the key it computes for each cached input (``hash_func`` of the input and ``hash_transform`` of
the cached transforms, as ``PersistentDataset`` names its files). This package is everything else, on MONAI's public
names and that protocol alone:

- :py:class:`SharedCacheStore` (:py:mod:`monai_sharedcache.store`): the store, items as files in a private
  directory that processes share without a server, with its Linux fast path, persistent stores kept across runs,
  budgets (a reserve, ``max_bytes``), checksums, statistics, and exact keys (``store.hash_func``,
  ``store.hash_transform``, from :py:mod:`monai_sharedcache.keys`);
- :py:func:`create_shared_cache` (:py:mod:`monai_sharedcache.distributed`): one store per node for the ranks of a
  job, the one collective call;
- :py:func:`fill`, :py:func:`refresh`, :py:func:`cache_stats` (:py:mod:`monai_sharedcache.dataset`): a dataset's
  items computed once per node, dropped, counted.

The fork's wheel (MONAI 1.6.1, the upstream series, this package and a few patches) keeps today's names working:
``from monai.data import SharedCacheStore`` and ``CacheDataset.fill()`` give these. Each name is imported at its first
use, so that ``import monai_sharedcache`` loads neither the store nor MONAI.

Example:
    .. code-block:: python

        import monai_sharedcache

        store = monai_sharedcache.create_shared_cache()  # every rank; one store per node
        ds = CacheDataset(
            data, transform, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform
        )
        monai_sharedcache.fill(ds)
"""

from __future__ import annotations

from typing import Any

__all__ = ["SharedCacheStore", "create_shared_cache", "fill", "refresh", "cache_stats", "nbytes", "transforms_hashing"]

_WHERE = {
    "SharedCacheStore": "store",
    "create_shared_cache": "distributed",
    "fill": "dataset",
    "refresh": "dataset",
    "cache_stats": "dataset",
    "nbytes": "dataset",
    "transforms_hashing": "keys",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
