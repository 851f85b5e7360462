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
The slot interface between :py:class:`monai.data.CacheDataset` and the container that holds its runtime cache.

A runtime cache is a sequence of ``cache_num`` slots. Every slot is addressed by its position ``index`` and by the
*content key* of the input item it caches (``hash_func(data[index])``, as text). A backend may serve an item only if
it was stored under the very same key, so that an item computed for other data is never returned.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
import types
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.managers import ListProxy
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from monai.data.dataset import CacheDataset

__all__ = ["MISS", "CacheSlots", "CacheEntry", "ListSlots", "CacheView", "resolve_runtime_cache", "sync_runtime_cache"]

THREAD_MODES = ("thread", "threads")
PROCESS_MODES = ("process", "processes")
ACCEPTED = (
    "False or None (fill the cache in the constructor), True/'thread'/'threads' (a private list), "
    "'process'/'processes' (a shared-memory store shared with DataLoader workers), a list, a "
    "multiprocessing ListProxy or another list-like container (len, item and slice assignment), or a store from "
    "monai.data.create_shared_cache()"
)


class _Miss:
    """Type of :py:data:`MISS`, the value :py:meth:`CacheSlots.get` returns for an empty or stale slot."""

    _instance: _Miss | None = None

    def __new__(cls) -> _Miss:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple:
        return (_Miss, ())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "MISS"


MISS = _Miss()


class CacheSlots(ABC):
    """
    Abstract runtime-cache backend: ``get``, ``put``, ``resize`` and ``invalidate`` over ``len(self)`` slots.

    Backends never raise for a cache that has gone away (a dead server, a removed directory, a full disk):
    they warn once per process and behave as an always-missing cache, so that training goes on.

    Attributes:
        reads_are_private: ``True`` if every :py:meth:`get` returns an object graph that no other reader shares
            (for example a fresh unpickled copy with copy-on-write buffers). ``CacheDataset`` then skips its
            ``copy_cache`` deepcopy, which would only copy a private object a second time.
    """

    reads_are_private: bool = False

    @abstractmethod
    def __len__(self) -> int:
        """The number of slots."""

    @abstractmethod
    def get(self, index: int, key: str) -> Any:
        """
        Return the item cached in slot ``index`` under ``key``.

        Returns:
            the item, or :py:data:`MISS` if the slot is empty, holds another key, or cannot be read.
        """

    @abstractmethod
    def put(self, index: int, key: str, item: Any) -> bool:
        """
        Store ``item`` in slot ``index`` under ``key``.

        Returns:
            whether the item was stored.
        """

    @abstractmethod
    def resize(self, n: int) -> None:
        """Make the cache exactly ``n`` slots long, in place."""

    @abstractmethod
    def invalidate(self, old_keys: Sequence[str], new_keys: Sequence[str]) -> None:
        """
        Drop what the dataset no longer needs after its keys changed from ``old_keys`` to ``new_keys``.

        Correctness never depends on this call (a slot with another key is a miss); it frees memory early.
        """

    def get_or_compute(self, index: int, key: str, compute: Callable[[], Any]) -> Any:
        """Return the cached item for ``(index, key)``, computing and storing it on a miss."""
        item = self.get(index, key)
        if item is MISS:
            item = compute()
            self.put(index, key, item)
        return item

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release what this process holds of the cache. The default does nothing."""

    # -- fault handling shared by the backends ------------------------------------------------------------------
    _warned_lock = threading.Lock()
    _warned: set[tuple[int, str]] = set()

    def _first_time(self, what: str) -> bool:
        """Whether ``what`` happens for the first time in this process and backend instance (for one-time warnings)."""
        token = (os.getpid(), f"{id(self)}:{what}")
        with CacheSlots._warned_lock:
            if token in CacheSlots._warned:
                return False
            CacheSlots._warned.add(token)
        return True

    def _warn_once(self, what: str, err: BaseException) -> None:
        """Warn once per process and backend instance that the cache is unusable, and why."""
        if not self._first_time(what):
            return
        warnings.warn(
            f"CacheDataset runtime cache ({type(self).__name__}): {what} ({type(err).__name__}: {err}). "
            "Items are computed without the cache from now on in this process.",
            RuntimeWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------------------------------------
# List-like containers: list, ListProxy, or anything with len, item and slice assignment


class CacheEntry(NamedTuple):
    """
    What a list-like runtime cache holds in a filled slot: the slot key and the cached item.

    The key is the content key of the input item (``hash_func(data[i])``) and a fingerprint of the cached transforms.
    """

    key: str
    item: Any


# what a container whose server or backing store went away raises: BrokenPipeError, ConnectionRefusedError,
# ConnectionResetError, FileNotFoundError (all OSError) and EOFError
_FAULTS: tuple[type[BaseException], ...] = (OSError, EOFError)


def _in_dataloader_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class ListSlots(CacheSlots):
    """
    Slots kept in a list-like ``container``; slot ``i`` holds ``None`` or a :py:class:`CacheEntry`.

    Anything else found in a slot (a pre-filled container, an entry of other data) is a miss and gets overwritten.

    Args:
        container: a ``list``, a ``multiprocessing`` ``ListProxy``, or any container that supports ``len``, item
            and slice assignment and ``del container[n:]``.
        private: ``True`` if the container was made by ``CacheDataset`` for ``runtime_cache=True``/``"thread"``.
            Such a list is private to each process, so filling it in a DataLoader worker is warned about once.
    """

    def __init__(self, container: Any, private: bool = False) -> None:
        self.container = container
        self.private = private
        self._dead = False

    def _fault(self, what: str, err: BaseException) -> None:
        self._dead = True
        self._warn_once(f"the runtime_cache container is unreachable while trying to {what}", err)

    def __len__(self) -> int:
        if self._dead:
            return 0
        try:
            return len(self.container)
        except _FAULTS as e:
            self._fault("get its length", e)
            return 0

    def get(self, index: int, key: str) -> Any:
        if self._dead:
            return MISS
        try:
            entry = self.container[index]
        except IndexError:  # resized by another process with other data
            return MISS
        except _FAULTS as e:
            self._fault("read", e)
            return MISS
        if isinstance(entry, CacheEntry) and entry.key == key:
            return entry.item
        return MISS

    def put(self, index: int, key: str, item: Any) -> bool:
        if self._dead:
            return False
        if self.private and _in_dataloader_worker():
            self._warn_worker()
        try:
            self.container[index] = CacheEntry(key, item)
        except IndexError:
            return False
        except _FAULTS as e:
            self._fault("write", e)
            return False
        return True

    def _warn_worker(self) -> None:
        if not self._first_time("filled in a DataLoader worker"):
            return
        warnings.warn(
            "CacheDataset(runtime_cache=True/'thread') is being filled inside a DataLoader worker process: the list "
            "is private to this worker, so its items are lost when the worker exits at the end of the epoch and the "
            "cache never speeds anything up. Use runtime_cache='process' to share one cache between the workers.",
            UserWarning,
            stacklevel=3,
        )

    def resize(self, n: int) -> None:
        """
        Grow (with empty slots) or trim the container in place to exactly ``n`` slots.

        Slice assignment makes this idempotent when several processes resize one container at once: the length is
        ``n`` whatever the interleaving, and at worst an item just written is dropped again (lost work, never a wrong
        item).

        Raises:
            ValueError: if the container cannot be resized in place.
        """
        if self._dead:
            return
        try:
            cur = len(self.container)
            if cur < n:
                self.container[cur:] = [None] * (n - cur)
            elif cur > n:
                del self.container[n:]
            final = len(self.container)
        except _FAULTS as e:
            self._fault("resize", e)
            return
        except (TypeError, AttributeError, NotImplementedError, ValueError) as e:
            raise ValueError(
                f"runtime_cache container of type {type(self.container).__name__} has length {cur} and cannot be "
                f"resized in place to cache_num={n} ({type(e).__name__}: {e}); it must support slice assignment "
                "and `del container[n:]`, as list and ListProxy do."
            ) from e
        if final != n:
            raise ValueError(
                f"runtime_cache container of type {type(self.container).__name__} has length {final} after resizing "
                f"it in place from {cur} to cache_num={n}; it must support slice assignment as list and ListProxy do."
            )

    def invalidate(self, old_keys: Sequence[str], new_keys: Sequence[str]) -> None:
        """Empty the slots whose key changed, in as few container calls as possible (one per run of slots)."""
        if self._dead:
            return
        changed = [i for i in range(min(len(old_keys), len(new_keys))) if old_keys[i] != new_keys[i]]
        try:
            start = 0
            while start < len(changed):
                end = start
                while end + 1 < len(changed) and changed[end + 1] == changed[end] + 1:
                    end += 1
                a, b = changed[start], changed[end] + 1
                self.container[a:b] = [None] * (b - a)
                start = end + 1
        except _FAULTS as e:
            self._fault("invalidate", e)


class CacheView(Sequence):
    """
    A read-only sequence view of a runtime cache: item ``i`` is the cached item of slot ``i``, or ``None``.

    ``CacheDataset._cache`` is such a view in the runtime modes, so that code iterating ``dataset._cache`` still
    gets the cached items themselves, whatever the backend and slot layout.
    """

    def __init__(self, slots: CacheSlots, keys: Sequence[str]) -> None:
        self.slots = slots
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # raises IndexError, supports negative indices
        item = self.slots.get(index, self.keys[index])
        return None if item is MISS else item


# ---------------------------------------------------------------------------------------------------------------------
# The glue used by CacheDataset.set_data


def resolve_runtime_cache(value: Any, current: CacheSlots | None = None) -> CacheSlots:
    """
    Turn the ``runtime_cache`` argument of ``CacheDataset`` into a slot backend.

    Args:
        value: the ``runtime_cache`` argument (not ``False``/``None``, which mean "no runtime cache").
        current: the backend this dataset already uses; reused for the modes where the dataset owns the container,
            so that ``set_data`` resyncs the same container instead of starting a new one.

    Raises:
        ValueError: for an unknown mode string.
        TypeError: for any other unsupported value.
    """
    if value is True or (isinstance(value, str) and value in THREAD_MODES):
        if isinstance(current, ListSlots) and current.private:
            return current
        return ListSlots([], private=True)
    if isinstance(value, str):
        if value in PROCESS_MODES:
            from monai.data.cache_store import SharedCacheStore

            if isinstance(current, SharedCacheStore):
                return current
            return SharedCacheStore()
        raise ValueError(f"runtime_cache={value!r} is not a known mode; accepted values: {ACCEPTED}.")
    if isinstance(value, CacheSlots):
        return value
    if isinstance(current, ListSlots) and current.container is value:
        return current
    if isinstance(value, (list, ListProxy)):
        return ListSlots(value)
    is_list_like = all(hasattr(type(value), m) for m in ("__len__", "__getitem__", "__setitem__", "__delitem__"))
    if is_list_like and not isinstance(value, (Mapping, bool, int, float, bytes, bytearray, str)):
        return ListSlots(value)
    raise TypeError(
        f"runtime_cache={value!r} (type {type(value).__name__}) is not supported; accepted values: {ACCEPTED}."
    )


def content_key(hash_func: Callable[..., Any], item: Any) -> str:
    """The content key of an input item: ``hash_func(item)`` as text."""
    return _as_text(hash_func(item))


def _as_text(key: Any) -> str:
    """A hash value (``bytes`` from ``pickle_hashing``, or anything else) as text."""
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).decode("utf-8", "backslashreplace")
    return str(key)


def _function_identity(*parts: Any) -> tuple:
    """Stands in for a function in a fingerprint (never called: fingerprints are only hashed, never unpickled)."""
    return parts


def _code_identity(code: types.CodeType) -> tuple:
    consts = tuple(_code_identity(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.co_code, consts, code.co_names


class _FingerprintPickler(pickle.Pickler):
    """Pickles lambdas and local functions by their code, constants, defaults and closure values, for hashing."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and ("<lambda>" in obj.__qualname__ or "<locals>" in obj.__qualname__):
            cells = tuple(cell.cell_contents for cell in obj.__closure__ or ())
            parts = (obj.__module__, obj.__qualname__, _code_identity(obj.__code__), obj.__defaults__, cells)
            return _function_identity, parts
        return NotImplemented


def transform_fingerprint(ds: CacheDataset) -> str:
    """
    A digest of the deterministic transforms whose result ``ds`` caches (those before the first random one).

    It is part of every slot key, so that datasets sharing one cache with other cached transforms (a training and a
    validation dataset, say) never read each other's items. It is computed from the pickled transforms, so every
    process that builds the same transforms gets the same fingerprint and shares the items. Transforms that cannot
    be pickled get a fingerprint unique to this dataset object: still correct, only not shared with other processes
    that build their own dataset (forked DataLoader workers inherit it and do share). Lambdas and local functions
    (as in ``Lambdad``) count by their code, constants, defaults and closure values, so they do not prevent sharing.
    """
    from monai.transforms import RandomizableTrait, Transform

    transform = ds.transform
    first_random = transform.get_index_of_first(
        lambda t: isinstance(t, RandomizableTrait) or not isinstance(t, Transform)
    )
    cached = transform.transforms[:first_random]
    buffer = io.BytesIO()
    try:
        _FingerprintPickler(buffer, protocol=4).dump([type(t) for t in cached] + list(cached))
    except Exception as e:
        warnings.warn(
            f"CacheDataset: the cached transforms cannot be pickled ({type(e).__name__}: {e}); the runtime cache is "
            "used by this dataset (and its forked DataLoader workers) only, not shared with other processes.",
            RuntimeWarning,
            stacklevel=3,
        )
        return uuid.uuid4().hex[:16]
    return hashlib.sha256(buffer.getvalue()).hexdigest()[:16]


def sync_runtime_cache(ds: CacheDataset, indices: Sequence[int], keys: Sequence[Any] | None = None) -> None:
    """
    Size, key and resync the runtime cache of ``ds`` for its current data; called by ``CacheDataset.set_data``.

    Slot ``s`` caches ``ds.data[indices[s]]`` under the key ``hash_func(ds.data[indices[s]])`` plus a fingerprint of
    the cached transforms (:py:func:`transform_fingerprint`). The same container is
    resized in place to ``len(indices)`` and the slots whose key changed are emptied, so that every process sharing
    the container sees the change. No other process is contacted beyond the container itself.

    Args:
        ds: the dataset.
        indices: the data index cached by each slot.
        keys: ``hash_func`` of those items, if already computed (``hash_as_key``).
    """
    slots = resolve_runtime_cache(ds.runtime_cache, getattr(ds, "_slots", None))
    if keys is not None:
        keys = [_as_text(k) for k in keys]
    else:
        try:
            keys = [content_key(ds.hash_func, ds.data[i]) for i in indices]
        except Exception as e:  # unpicklable input items: keys that no other process or data can match
            warnings.warn(
                f"CacheDataset: cannot compute content keys of the input items with hash_func "
                f"({type(e).__name__}: {e}); the runtime cache will not be shared with other processes.",
                RuntimeWarning,
                stacklevel=3,
            )
            token = uuid.uuid4().hex
            keys = [f"nokey-{token}-{i}" for i in range(len(indices))]
    tag = transform_fingerprint(ds)
    keys = [f"{k}-{tag}" for k in keys]
    old_keys: Sequence[str] = getattr(ds, "_slot_keys", None) or []
    if slots is not getattr(ds, "_slots", None):
        old_keys = []
    slots.resize(len(keys))
    slots.invalidate(old_keys, keys)
    ds._slots = slots
    ds._slot_keys = list(keys)
    ds._cache = CacheView(slots, ds._slot_keys)  # type: ignore[assignment]
