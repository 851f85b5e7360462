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
Items that invert in any process. MONAI's invertible transforms record what they did in an item (its
``applied_operations``), and name themselves there by ``id(transform)``: an address in the process that computed the
item. ``Invertd`` refuses to invert an operation whose id is not that of the transform inverting it, so an item that
another rank, or an earlier run of a persistent store, computed could not be inverted (``RuntimeError: Error
SpatialResample getting the most recently applied invertible transform``), and DDP validation on a shared cache failed.

So a shared cache stores an item with each such id of one of the cached transforms (or of a transform that they hold)
replaced by its place among them, and replaces each place by the id of the transform at that place in the process
that reads it. The key of an item proves that its cached transforms are the same, so a place names the same transform
in every process. An id of any other object is kept as it is: ``Invertd`` still refuses a pipeline that differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from monai.data import MetaTensor
from monai.transforms import TraceableTransform, Transform
from monai.utils import TraceKeys

__all__ = ["OperationIds", "PLACE"]

PLACE = "monai_sharedcache.transform."  # an id in a stored item: this prefix and a place among the cached transforms
_DEPTH = 32  # nested containers of an item, or transforms held by transforms, walked at most this deep


class OperationIds:
    """
    The ids of the cached ``transforms`` in the operations recorded in an item, as this process has them
    (:py:meth:`local`) and as a store keeps them (:py:meth:`portable`). The transforms are walked once per process,
    when an item is first converted: each transform, and each transform that one holds (``Spacingd`` holds a
    ``Spacing``, which holds the ``SpatialResample`` that records the operation), in the order of their attributes.

    Args:
        transforms: the cached transforms (the Compose options, a mapping, may come first: it holds none).
    """

    def __init__(self, transforms: Sequence[Any]) -> None:
        self.transforms = list(transforms)
        self._walked: tuple[int, dict[int, int], list[int]] | None = None  # (pid, id -> place, place -> id)

    def __getstate__(self) -> dict:
        return {"transforms": self.transforms, "_walked": None}  # ids are those of the process that walked

    def _places(self) -> tuple[dict[int, int], list[int]]:
        if self._walked is None or self._walked[0] != os.getpid():
            found: list[int] = []
            _walk(self.transforms, found, set(), 0)
            self._walked = (os.getpid(), {ident: place for place, ident in enumerate(found)}, found)
        return self._walked[1], self._walked[2]

    def portable(self, item: Any) -> Any:
        """``item``, changed in place: the ids of the cached transforms become their places."""
        places, _ = self._places()
        _convert(item, lambda v: f"{PLACE}{places[v]}" if type(v) is int and v in places else v, 0)
        return item

    def local(self, item: Any) -> Any:
        """``item``, changed in place: the places of cached transforms become their ids in this process."""
        _, ids = self._places()
        _convert(item, lambda v: _local_id(v, ids), 0)
        return item

    def computing(self, compute: Callable[[], Any]) -> Callable[[], Any]:
        """``compute``, whose item comes out portable (for a store to keep)."""
        return lambda: self.portable(compute())


def _local_id(value: Any, ids: list[int]) -> Any:
    if isinstance(value, str) and value.startswith(PLACE) and value[len(PLACE) :].isdigit():
        place = int(value[len(PLACE) :])
        return ids[place] if place < len(ids) else value
    return value


def _walk(obj: Any, found: list[int], seen: set[int], depth: int) -> None:
    if depth > _DEPTH or id(obj) in seen:
        return
    if isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(value, found, seen, depth + 1)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, found, seen, depth + 1)
    elif isinstance(obj, Transform):  # what other objects hold cannot record operations
        seen.add(id(obj))
        if isinstance(obj, TraceableTransform):
            found.append(id(obj))
        for value in (getattr(obj, "__dict__", None) or {}).values():
            _walk(value, found, seen, depth + 1)


def _convert(item: Any, change: Callable[[Any], Any], depth: int) -> None:
    """Change, in place, the id of each operation recorded in ``item`` (and of the operations nested in one)."""
    if depth > _DEPTH:
        return
    if isinstance(item, MetaTensor):
        for ops in (item.applied_operations, item.pending_operations):
            _convert(ops, change, depth + 1)
    elif isinstance(item, Mapping):
        if TraceKeys.ID in item and TraceKeys.CLASS_NAME in item and isinstance(item, dict):  # an operation
            item[TraceKeys.ID] = change(item[TraceKeys.ID])
        for value in item.values():
            _convert(value, change, depth + 1)
    elif isinstance(item, (list, tuple)) and item and isinstance(item[0], (Mapping, list, tuple, MetaTensor)):
        for value in item:  # operations, or items; a list of numbers (a bounding box, a long series) holds none
            _convert(value, change, depth + 1)
