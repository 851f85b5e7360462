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
The item files of :py:class:`monai_sharedcache.SharedCacheStore`: a prefix, the key (checked on read), a table of
buffers, the protocol-5 pickle stream, then the bytes of each array or CPU tensor, 64-byte aligned, so that a reader's
private mapping of the file gives them as views, with no copy.
"""

from __future__ import annotations

import enum
import errno
import io
import os
import pickle
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
import torch

MISS = object()  # what `decode` returns for the file of another key
_MAGIC = b"\x89MONAI\r\n"
VERSION = 3  # 2: numpy dtypes and scalars by their description; 3: rebuilt by this module of the package
_PREFIX = struct.Struct("<8sHHIQIIQ")  # magic, version, flags, header_len, total_len, key_len, n_buffers, pickle_len
_ENTRY = struct.Struct("<QQ")
_ALIGN = 64
FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"  # opens a descriptor's file again
_SMALL_FILE = 64 * 1024  # smaller files are read, larger ones mapped
_GPU = "SharedCacheStore stores CPU tensors only, got one on {}"
UNSTORABLE = "Such items are computed without being stored. To cache them, keep the cached transforms on the CPU (move "
UNSTORABLE += "the data to the device after them, e.g. with EnsureTyped(keys, device=...)), or use runtime_cache=False."


# what MONAI's items hold, beside the types that pickle writes as opcodes (dict, list, str, ...), MONAI's enums and
# tensor subclasses, and torch's dtypes; numpy's own reductions are left out: their dtype state can forge pointers
_SAFE = {
    "builtins": {"complex", "range", "slice", "set", "frozenset", "bytearray", "bytes"},
    "collections": {"OrderedDict", "deque", "Counter"},
    "datetime": {"date", "datetime", "time", "timedelta", "timezone"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "torch": {"Size", "Tensor", "device"},
    "pydicom.uid": {"UID"},  # a str: the meta of MONAI's DICOM reader holds it (prune_metadata=False)
    __name__: {"_rebuild_tensor", "_rebuild_ndarray", "_rebuild_scalar", "_numpy_dtype"},
}
ALLOW = "To allow a type: torch.serialization.add_safe_globals([YourType]) where the store is made, or the store's "
ALLOW += "weights_only=False."


class CorruptItemError(Exception):
    ino: int | None = None  # of the file found damaged, where known


class UnsafeTypeError(pickle.UnpicklingError):
    """An item holds a type that the allow-list leaves out."""


class OffCpuError(TypeError):
    """An item holds a tensor off the CPU."""


class _Unpickler(pickle.Unpickler):
    """
    Only the callables of ``_SAFE``, MONAI's enums and tensor types, torch's dtypes, those of ``add_safe_globals``
    and the store's own (``allowed``): reading imports no module and calls nothing else.
    """

    allowed: dict[str, Any] = {}  # by the name that a pickle gives

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE.get(module, ()) and module in sys.modules:  # a module not loaded is not imported
            return super().find_class(module, name)
        loaded = sys.modules.get(module) if module.partition(".")[0] in ("monai", "torch") else None
        obj = vars(loaded).get(name) if loaded is not None else None  # no module __getattr__: it may import
        if isinstance(obj, torch.dtype) or isinstance(obj, type) and issubclass(obj, (enum.Enum, torch.Tensor)):
            return obj
        if f"{module}.{name}" in self.allowed:
            return self.allowed[f"{module}.{name}"]
        for safe in torch.serialization.get_safe_globals():
            found, qualname = safe if isinstance(safe, tuple) else (safe, f"{safe.__module__}.{safe.__qualname__}")
            if qualname == f"{module}.{name}":
                return found
        raise UnsafeTypeError(f"{module}.{name} is not among the types allowed in an item. {ALLOW}")


def _numpy_dtype(spec: Any) -> np.dtype:
    dtype: np.dtype = np.dtype(spec)  # numpy makes it, and its flags, from the description alone
    if dtype.hasobject:  # its bytes would be read as pointers
        raise UnsafeTypeError(f"a numpy array or scalar of objects ({dtype}) is not allowed in an item. {ALLOW}")
    return dtype


def _dtype_spec(dtype: np.dtype) -> Any:
    return dtype.descr if dtype.fields is not None else dtype.str


def _rebuild_scalar(spec: Any, raw: bytes) -> Any:
    return np.frombuffer(raw, dtype=_numpy_dtype(spec), count=1)[0]


def loads(stream: Any, buffers: list, weights_only: bool, allowed: dict[str, Any] | None = None) -> Any:
    if not weights_only:
        return pickle.Unpickler(io.BytesIO(stream), buffers=buffers).load()
    unpickler = _Unpickler(io.BytesIO(stream), buffers=buffers)
    unpickler.allowed = allowed or {}
    return unpickler.load()


def named_types(entries: Iterable) -> dict[str, Any]:
    """The entries of ``add_safe_globals`` (a type, or ``(type, name)``) by the name that a pickle gives them."""
    named = {}
    for entry in entries:
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        named[name] = obj
    return named


def carry_types(allowed: dict[str, Any]) -> tuple[bytes, ...]:
    """
    ``allowed`` and the types of ``add_safe_globals`` here, each pickled with its name (a class by reference), for a
    store pickled to another process; one that pickle cannot store (a class defined in a function) is left out.
    """
    carried = []
    for named in {**allowed, **named_types(torch.serialization.get_safe_globals())}.items():
        try:
            carried.append(pickle.dumps(named))
        except Exception:
            pass
    return tuple(carried)


def carried_types(carried: tuple[bytes, ...]) -> dict[str, Any]:
    """
    The types of :py:func:`carry_types`, from the store's own pickle (as trusted as the dataset that holds it), but
    those that this process cannot import: their items are refused, and named.
    """
    found = {}
    for data in carried:
        try:
            name, obj = pickle.loads(data)
        except Exception:
            continue
        found[name] = obj
    return found


def _plain_state(cls: type) -> bool:
    """Whether a tensor subclass (such as MetaTensor) pickles as its data and ``__dict__``."""
    names = ("__reduce_ex__", "__reduce__", "__getstate__", "__setstate__")
    if any(getattr(cls, n, None) is not getattr(torch.Tensor, n, None) for n in names):
        return False
    return not any("__slots__" in vars(base) for base in cls.__mro__[: cls.__mro__.index(torch.Tensor)])


def _rebuild_tensor(buffer: Any, dtype: torch.dtype, shape: tuple, cls: type, state: dict | None) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype) if buffer is None else torch.frombuffer(buffer, dtype=torch.uint8)
    t = t.view(dtype).reshape(shape)
    if cls is not torch.Tensor:
        t = t.as_subclass(cls)
    if state:
        t.__dict__.update(state)
    return t


def _rebuild_ndarray(buffer: Any, spec: Any, shape: tuple, order: Any) -> np.ndarray:
    dtype = _numpy_dtype(spec)
    if buffer is None:
        return np.empty(shape, dtype=dtype, order=order)
    return np.frombuffer(buffer, dtype=np.uint8).view(dtype).reshape(shape, order=order)


class _Pickler(pickle.Pickler):
    """Protocol 5, with the bytes of CPU tensors and numpy arrays out of band."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise OffCpuError(_GPU.format(obj.device))
            cls = type(obj)
            if obj.layout is not torch.strided or obj.is_quantized or obj.is_nested:
                return NotImplemented
            if cls is not torch.Tensor and not _plain_state(cls):
                return NotImplemented
            data = obj.as_subclass(torch.Tensor).detach().resolve_conj().resolve_neg().contiguous()
            buffer = None
            if data.numel():
                try:
                    buffer = pickle.PickleBuffer(cast(Any, data.reshape(-1).view(torch.uint8).numpy()))
                except (RuntimeError, TypeError):  # sub-byte dtypes: torch's own pickling
                    return NotImplemented
            return _rebuild_tensor, (buffer, data.dtype, tuple(data.shape), cls, getattr(obj, "__dict__", None))
        if type(obj) in (np.ndarray, np.memmap) and not obj.dtype.hasobject:
            arr = obj.view(np.ndarray)
            order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
            if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
                arr = np.ascontiguousarray(arr)
            raw = pickle.PickleBuffer(cast(Any, arr.ravel(order="K").view(np.uint8))) if arr.size else None
            return _rebuild_ndarray, (raw, _dtype_spec(arr.dtype), arr.shape, order)
        if isinstance(obj, np.generic) and not obj.dtype.hasobject:
            return _rebuild_scalar, (_dtype_spec(obj.dtype), obj.tobytes())
        if isinstance(obj, np.dtype) and not obj.hasobject:
            return _numpy_dtype, (_dtype_spec(obj),)
        return NotImplemented


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def encode(
    key: str, item: Any, weights_only: bool = True, allowed: dict[str, Any] | None = None
) -> tuple[list[tuple[int, memoryview]], int]:
    """
    The ``(offset, bytes)`` chunks of the file of ``item`` under ``key``, and its length; raises if pickle fails, or
    (``weights_only``) if the item cannot be read back (``UnsafeTypeError``) with the types ``allowed`` too.
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(item)
    body, raws = stream.getbuffer(), [b.raw() for b in buffers]
    if weights_only:  # what the readers would refuse is not stored: no item computed and written on every read
        loads(body, raws, weights_only, allowed)
    key_bytes = key.encode("utf-8", "surrogatepass")
    header_len = _align(_PREFIX.size + len(key_bytes) + _ENTRY.size * len(raws))
    total, table = header_len + body.nbytes, []
    for raw in raws:
        table.append((_align(total), raw.nbytes))
        total = table[-1][0] + raw.nbytes
    header = bytearray(header_len)
    _PREFIX.pack_into(header, 0, _MAGIC, VERSION, 0, header_len, total, len(key_bytes), len(raws), body.nbytes)
    header[_PREFIX.size : _PREFIX.size + len(key_bytes)] = key_bytes
    for i, entry in enumerate(table):
        _ENTRY.pack_into(header, _PREFIX.size + len(key_bytes) + i * _ENTRY.size, *entry)
    return [(0, memoryview(header)), (header_len, body)] + [(o, r) for (o, _), r in zip(table, raws)], total


def write_item(fd: int, chunks: list[tuple[int, memoryview]]) -> None:
    for offset, data in chunks:
        while data.nbytes:
            n = os.pwrite(fd, data, offset)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            data, offset = data[n:], offset + n


def read_file(
    d: Any,
    name: str,
    map_large: Callable[[int, os.stat_result, str], memoryview],
    verify: Callable[[int, os.stat_result, memoryview], bool] | None = None,
) -> tuple[memoryview, int]:
    """
    A private view of the file ``name`` in the directory ``d``, checked before a byte is read, and its inode;
    ``CorruptItemError`` if ``verify(fd, status, view)`` finds it other than written.
    """
    found = d.open_checked_stat(name)
    if found is None:
        raise PermissionError(errno.EPERM, "a link, or not a private file: not an item the store wrote", name)
    fd, st = found
    try:
        if st.st_size < _SMALL_FILE:  # into an aligned buffer
            arr = np.empty(st.st_size + _ALIGN, dtype=np.uint8)
            start = -arr.__array_interface__["data"][0] % _ALIGN
            view, got = memoryview(cast(Any, arr[start : start + st.st_size])), 0
            while got < st.st_size and (n := os.readv(fd, [view[got:]])):
                got += n
            view = view[:got]
        else:
            view = map_large(fd, st, name)
        if verify is not None and not verify(fd, st, view):
            err = CorruptItemError(f"{name}: its bytes are not those written")
            err.ino = st.st_ino
            raise err
        return view, st.st_ino
    finally:
        os.close(fd)


def decode(buf: memoryview, key: str, weights_only: bool = True, allowed: dict[str, Any] | None = None) -> Any:
    """
    The item in the file content ``buf``, or ``MISS`` if it holds another key; raises ``CorruptItemError``, or
    (``weights_only``) ``UnsafeTypeError`` for a type that the allow-list and ``allowed`` leave out.
    """
    if buf.nbytes < _PREFIX.size:
        raise CorruptItemError("truncated header")
    magic, version, _, header_len, total, key_len, n_buffers, pickle_len = _PREFIX.unpack_from(buf, 0)
    if magic != _MAGIC or version != VERSION:
        raise CorruptItemError("bad magic or version")
    table = _PREFIX.size + key_len
    if total != buf.nbytes or table + _ENTRY.size * n_buffers > header_len or header_len + pickle_len > total:
        raise CorruptItemError("truncated or inconsistent lengths")
    if bytes(buf[_PREFIX.size : table]) != key.encode("utf-8", "surrogatepass"):
        return MISS
    buffers = []
    for i in range(n_buffers):
        offset, length = _ENTRY.unpack_from(buf, table + i * _ENTRY.size)
        if offset < header_len + pickle_len or offset + length > total:
            raise CorruptItemError("bad buffer table")
        buffers.append(buf[offset : offset + length])
    try:
        return loads(buf[header_len : header_len + pickle_len], buffers, weights_only, allowed)
    except UnsafeTypeError:
        raise
    except (pickle.UnpicklingError, EOFError, struct.error) as err:
        raise CorruptItemError(f"bad pickle stream: {err}") from err
