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
What the package does with a ``CacheDataset`` whose runtime cache is keyed (a :py:class:`SharedCacheStore`, or
another ``monai.data.KeyedCache``): :py:func:`fill`, :py:func:`refresh` and :py:func:`cache_stats`. They read the
dataset's public attributes only, and its keys from ``CacheDataset.cache_key``, so they work on any MONAI whose
``CacheDataset`` keys its runtime cache, with or without the fork's patches.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from multiprocessing.pool import ThreadPool
from typing import Any

import numpy as np
import torch

from monai_sharedcache.store import NEEDS_KEYED, SharedCacheStore

__all__ = ["fill", "refresh", "cache_stats", "nbytes"]


def _keyed_cache(dataset: Any, cache: Any = None) -> Any:
    """The keyed runtime cache ``cache``, by default the dataset's, or ``None`` without a runtime cache."""
    cache = getattr(dataset, "runtime_cache", None) if cache is None else cache
    if cache is None or cache is False:
        return None
    if not callable(getattr(dataset, "cache_key", None)):
        import monai

        raise TypeError("monai_sharedcache " + NEEDS_KEYED.format(version=monai.__version__))
    from monai.data import KeyedCache

    if not isinstance(cache, KeyedCache):
        raise TypeError(
            f"monai_sharedcache works on a keyed runtime cache (monai.data.KeyedCache: an object with get and put, "
            f"such as a SharedCacheStore), got runtime_cache={cache!r} of type {type(cache).__name__}."
        )
    return cache


def _cached(dataset: Any) -> list[tuple[int, str]]:
    """The cached indices of ``dataset`` and their keys, each key once (``hash_as_key`` caches each input once)."""
    n = len(dataset.data) if dataset.hash_as_key else min(dataset.cache_num, len(dataset.data))
    found: dict[str, int] = {}
    for index in range(n):
        key = dataset.cache_key(index)
        if key is not None:
            found.setdefault(key, index)
    return [(index, key) for key, index in found.items()]


def _computer(dataset: Any) -> Any:
    """What ``CacheDataset`` caches for an index: its transforms up to the first random one, as it computes them."""
    from monai.transforms import RandomizableTrait, Transform, convert_to_contiguous

    first = dataset.transform.get_index_of_first(
        lambda t: isinstance(t, RandomizableTrait) or not isinstance(t, Transform)
    )

    def compute(index: int) -> Any:
        item = dataset.transform(dataset.data[index], end=first, threading=True)
        if dataset.as_contiguous:
            item = convert_to_contiguous(item, memory_format=torch.contiguous_format)
        return item

    return compute


def fill(dataset: Any, num_threads: int | None = None, *, cache: Any = None) -> None:
    """
    Compute now, before training, the items of the dataset's keyed runtime cache that are not cached yet, in
    ``num_threads`` threads, with a progress bar if ``dataset.progress``. It returns when every item is cached (or
    refused by the cache's budget). Without a runtime cache it does nothing: the constructor fills that cache.

    With a :py:class:`SharedCacheStore` that other processes share (from :py:func:`create_shared_cache`, shared by the
    ranks of a node), the work is split by the store's claims: an item that another rank or thread is computing is
    skipped, and waited for after the others, so every item is computed once per node, and ranks that fill at once
    share the items evenly, under any launcher. A rank that dies leaves its unfinished items to the others (its claims
    go with it). It makes no collective call: each rank may call it or not. With another keyed cache, each caller
    computes what it does not find.

    Args:
        dataset: a ``CacheDataset`` with a keyed ``runtime_cache``.
        cache: the keyed cache of its items, by default its ``runtime_cache`` (the fork's ``runtime_cache="process"``
            gives the store that it made).
        num_threads: threads that compute items; by default the CPUs that this process may run on, or with a store
            from :py:func:`create_shared_cache`, this rank's share of its node's CPUs (its ``node_cpus``), so that
            ranks filling at once do not oversubscribe the node.

    Raises:
        ValueError: ``num_threads`` is not a positive integer.
        TypeError: the runtime cache is not keyed, or MONAI's ``CacheDataset`` has no keyed runtime caches.

    Example:
        .. code-block:: python

            store = create_shared_cache()  # every rank; one store per node
            ds = CacheDataset(
                data, transform, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform
            )
            monai_sharedcache.fill(ds)  # the ranks of each node split the items; returns when the cache is full
    """
    cache = _keyed_cache(dataset, cache)
    if num_threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        num_threads = getattr(cache, "node_cpus", None) or cpus
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer or None, got {num_threads!r}.")
    if cache is None:
        return
    cached, compute = _cached(dataset), _computer(dataset)
    if not cached:
        return
    store = isinstance(cache, SharedCacheStore)

    def fill_one(entry: tuple[int, str], wait: bool) -> bool:
        index, key = entry
        if store:
            return bool(cache.fill(key, lambda: compute(index), wait))
        try:
            if cache.get(key) is None:
                cache.put(key, compute(index))
        except (OSError, EOFError) as err:  # a dead container: computed in vain, as CacheDataset would serve them
            warnings.warn(f"monai_sharedcache.fill: the runtime cache is unreachable ({err!r}).", RuntimeWarning)
            return True
        return True

    progress = bool(getattr(dataset, "progress", False))
    bar: Any = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(cached), desc="Loading dataset")
        except ImportError:
            warnings.warn("tqdm is not installed, will not show the caching progress bar.")
    try:
        with ThreadPool(num_threads) as p:
            skipped = []  # being computed elsewhere: waited for once the rest is done
            for entry, done in zip(cached, p.imap(lambda e: fill_one(e, False), cached)):
                skipped += [] if done else [entry]
                if bar is not None and done:
                    bar.update()
            for _ in p.imap_unordered(lambda e: fill_one(e, True), skipped):
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()


def refresh(dataset: Any, *, cache: Any = None) -> None:
    """
    Drop the dataset's items from its keyed runtime cache, so that each is computed again on its next use: for
    changes that the keys cannot see (arrays of the data changed in place, inputs rewritten under a ``hash_func`` of
    your own). With a store that other processes share, the items are dropped for all of them: call it in one process
    per store, between epochs, while no DataLoader iterates the dataset. Without a runtime cache it does nothing
    (``dataset.set_data(dataset.data)`` computes that cache anew).

    Args:
        dataset: a ``CacheDataset`` with a keyed ``runtime_cache``.
        cache: the keyed cache of its items, by default its ``runtime_cache`` (the fork's ``runtime_cache="process"``
            gives the store that it made).

    Raises:
        TypeError: the runtime cache is not keyed, or has no ``discard(keys)`` if it is not a store; or MONAI's
            ``CacheDataset`` has no keyed runtime caches.
    """
    cache = _keyed_cache(dataset, cache)
    if cache is None:
        return
    keys = [key for _, key in _cached(dataset)]
    if isinstance(cache, SharedCacheStore):
        cache.discard(keys)
        return
    discard = getattr(cache, "discard", None)
    if not callable(discard):
        raise TypeError(
            f"refresh drops items with the cache's discard(keys), which {type(cache).__name__} lacks: give it one, "
            "or use a SharedCacheStore."
        )
    try:
        discard(keys)
    except (OSError, EOFError):  # a dead container holds nothing to drop
        pass


def nbytes(item: Any) -> int:
    """The bytes of the arrays and tensors in ``item`` (nested dicts, lists and tuples)."""
    if isinstance(item, torch.Tensor):
        return item.element_size() * item.nelement()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    if isinstance(item, Mapping):
        return sum(nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(nbytes(v) for v in item)
    return 0


def cache_stats(dataset: Any, *, cache: Any = None) -> dict[str, dict[str, Any]]:
    """
    Statistics of the dataset's keyed runtime cache, as far as the cache can tell: of this dataset in this process, of
    this dataset's items, and of the whole cache, which other datasets and processes may share.

    Args:
        dataset: a ``CacheDataset`` with a keyed ``runtime_cache``.
        cache: the keyed cache of its items, by default its ``runtime_cache`` (the fork's ``runtime_cache="process"``
            gives the store that it made).

    Returns:
        ``{"process": counts, "dataset": {"capacity", "filled"}, "cache": contents and counts}``. With a store,
        ``process`` has the events (``hits``, ``misses``, ``computed``, ``refused``, and ``reused`` for a persistent
        store) in this process of the items of the dataset's cached transforms, where its keys come from the store's
        ``hash_transform`` (else of the whole store in this process); ``dataset`` has ``capacity`` (its cached
        inputs) and ``filled`` (those whose item is stored now, one ``stat`` each); ``cache`` has the store's
        :py:meth:`~SharedCacheStore.stats`, the counts of all its processes. With another keyed cache, only
        ``capacity`` is known: the other numbers are ``None`` (its ``get`` alone would copy every item out).

    Raises:
        TypeError: the runtime cache is not keyed, or MONAI's ``CacheDataset`` has no keyed runtime caches.
    """
    cache = _keyed_cache(dataset, cache)
    if cache is None:
        raise TypeError("cache_stats counts a keyed runtime cache; this dataset has none (runtime_cache=False).")
    keys = [key for _, key in _cached(dataset)]
    if isinstance(cache, SharedCacheStore):
        dataset_stats = {"capacity": len(keys), "filled": cache.count(keys)}
        return {
            "process": cache.process_stats(keys[0] if keys else None),
            "dataset": dataset_stats,
            "cache": cache.stats(),
        }
    none: dict[str, Any] = {"hits": None, "misses": None, "computed": None, "refused": None}
    items = {"filled": None, "nbytes": None}  # get alone would copy out every item to count it
    return {"process": none, "dataset": {"capacity": len(keys), "filled": None}, "cache": {**items, **none}}
