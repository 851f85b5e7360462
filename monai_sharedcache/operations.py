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
replaced by its place: the path that leads to it from the cached transforms, such as ``[3, "spacing_transform",
"sp_resample"]``. A process that reads the item replaces each place by the id of the transform that the same path
leads to in its own transforms. The key of an item proves that the cached transforms compute the same, so the path
leads to a transform of the same code and state; a place that leads nowhere makes the item a miss. An id of any other
object is kept as it is: ``Invertd`` still refuses a pipeline that differs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from monai.data import MetaTensor
from monai.transforms import TraceableTransform, Transform
from monai.utils import TraceKeys

__all__ = ["OperationIds", "PLACE"]

PLACE = "monai_sharedcache.transform:"  # an id in a stored item: this prefix and the transform's path, in JSON
_DEPTH = 16  # transforms held by transforms, or containers in an item, walked at most this deep


class OperationIds:
    """
    The ids of the cached ``transforms`` in the operations recorded in an item, as this process has them
    (:py:meth:`local`) and as a store keeps them (:py:meth:`portable`): by the path that leads to each transform from
    the cached transforms, through the transforms that they hold (``Spacingd`` holds a ``Spacing``, which holds the
    ``SpatialResample`` that records the operation) and the lists and dicts in which they hold them.

    Args:
        transforms: the cached transforms (the Compose options, a mapping, may come first).
    """

    def __init__(self, transforms: Sequence[Any]) -> None:
        self.transforms = list(transforms)

    def portable(self, item: Any) -> Any:
        """``item``, changed in place: the ids of the cached transforms become their places."""
        paths: dict[int, list] = {}  # walked at each computation: a transform may make one that it holds at its call
        _walk(self.transforms, [], paths, set(), 0)
        places = {ident: PLACE + json.dumps(path) for ident, path in paths.items()}
        _convert(item, lambda v: places.get(v, v) if type(v) is int else v, 0)
        return item

    def local(self, item: Any, default: Any = None) -> Any:
        """``item``, changed in place: each place becomes the id of the transform at that place in this process;
        ``default`` where a place leads to none."""
        lost: list[str] = []

        def to_id(value: Any) -> Any:
            if not (isinstance(value, str) and value.startswith(PLACE)):
                return value
            found = self._resolve(value[len(PLACE) :])
            if found is None:
                lost.append(value)
                return value
            return id(found)

        _convert(item, to_id, 0)
        return default if lost else item

    def computing(self, compute: Callable[[], Any]) -> Callable[[], Any]:
        """``compute``, whose item comes out portable (for a store to keep)."""
        return lambda: self.portable(compute())

    def _resolve(self, place: str) -> TraceableTransform | None:
        try:
            path = json.loads(place)
        except ValueError:
            return None
        obj: Any = self.transforms
        for step in path if isinstance(path, list) else [None]:
            if isinstance(obj, (list, tuple)) and type(step) is int and 0 <= step < len(obj):
                obj = obj[step]
            elif isinstance(obj, dict) and isinstance(step, str) and step in obj:
                obj = obj[step]
            elif isinstance(obj, Transform) and isinstance(step, str):
                obj = (getattr(obj, "__dict__", None) or {}).get(step)
            else:
                return None
        return obj if isinstance(obj, TraceableTransform) else None


def _walk(obj: Any, path: list, paths: dict[int, list], seen: set[int], depth: int) -> None:
    """The path of each traceable transform in ``obj``, the first that leads to it (as :py:meth:`_resolve` takes it)."""
    if depth > _DEPTH:
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, [*path, i], paths, seen, depth + 1)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str):
                _walk(value, [*path, key], paths, seen, depth + 1)
    elif isinstance(obj, Transform) and id(obj) not in seen:  # what other objects hold records no operation
        seen.add(id(obj))
        if isinstance(obj, TraceableTransform):
            paths[id(obj)] = path
        for name, value in (getattr(obj, "__dict__", None) or {}).items():
            _walk(value, [*path, name], paths, seen, depth + 1)


def _convert(item: Any, change: Callable[[Any], Any], depth: int) -> bool:
    """
    Change, in place, the id of each operation recorded in ``item``: in its MetaTensors and under its keys that end in
    ``_transforms`` (where a transform traces data that is not a MetaTensor). Whether it found an operation.
    """
    if depth > _DEPTH:
        return False
    if isinstance(item, MetaTensor):
        return _operations(item.applied_operations, change, 0) | _operations(item.pending_operations, change, 0)
    found = False
    if isinstance(item, Mapping):
        for key, value in item.items():
            if isinstance(key, str) and key.endswith(TraceKeys.KEY_SUFFIX):
                found |= _operations(value, change, 0)
            elif isinstance(value, (MetaTensor, Mapping, list, tuple)):
                found |= _convert(value, change, depth + 1)
    elif isinstance(item, (list, tuple)) and item and _convert(item[0], change, depth + 1):
        # the rest only where the first holds operations: every read walks the item, and a list of 100,000 boxes
        # or annotations holds none; a store keeps and reads an item by the same walk, so both see the same ids
        for value in item[1:]:
            _convert(value, change, depth + 1)
        found = True
    return found


def _operations(ops: Any, change: Callable[[Any], Any], depth: int) -> bool:
    """Change the id of each operation in ``ops`` and of the operations nested in one (in its ``extra_info``)."""
    found = False
    if depth > _DEPTH:
        return found
    if isinstance(ops, dict):
        if TraceKeys.ID in ops and TraceKeys.CLASS_NAME in ops:  # an operation
            ops[TraceKeys.ID], found = change(ops[TraceKeys.ID]), True
        for value in ops.values():
            if isinstance(value, (dict, list)):
                found |= _operations(value, change, depth + 1)
    elif isinstance(ops, list):
        for op in ops:
            found |= _operations(op, change, depth + 1)
    return found
