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
The file format of a :py:class:`monai.data.SharedCacheStore` item, and its (de)serialization.

Readers map item files and hand out their arrays and tensors as views of the mapping, so the bytes of every array
must sit raw in the file, aligned, and be located without reading the whole file: a pickle stream alone would copy
them. An item file is therefore: a fixed prefix, the key (utf-8, checked on read so that a file of another key is a
miss), a table of (offset, length) of the out-of-band buffers, the protocol-5 pickle stream at ``header_len``, then
every out-of-band buffer (the bytes of numpy arrays and CPU tensors), raw, at an offset aligned to ``_ALIGN`` bytes.
Files are written with ``os.write`` only, never through a mapping: a full file system is an error, not a ``SIGBUS``.

Storage:
    An item is pickled with protocol 5. The bytes of numpy arrays and of CPU tensors of any dtype (including
    ``MetaTensor``, whose ``meta``, ``applied_operations`` and ``is_batch`` are kept) are not pickled: they are written
    raw, aligned to 64 bytes, after the pickle stream. An item is written to a temporary file with ``os.write`` and
    published with an atomic ``os.replace``: a crashed writer never leaves a partial item under its final name, and a
    full file system is an ``ENOSPC`` error, never a ``SIGBUS``. A published file is never modified again, only replaced
    or removed. The directory holds ``<key>.item`` files, ``<key>.claim`` files (see :py:mod:`monai.data.cache_coord`),
    the lock file ``.lock`` (see :py:mod:`monai.data.cache_coord`), the capacity in ``.meta`` and the files being
    written in ``.tmp/`` (each locked by its writer; those of writers that died are removed by the next
    :py:meth:`~monai.data.SharedCacheStore.put`).

    Only CPU tensors can be stored; storing a tensor on another device raises ``TypeError``. Keep the cached
    (deterministic) transforms on the CPU and move the data to the GPU after them, for example with
    ``EnsureTyped(keys, device=...)`` placed after the first random transform. Tensors are stored detached
    (``requires_grad`` is not kept) and contiguous; tensors of one item that share memory are stored separately.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
from typing import Any, cast

import numpy as np
import torch

__all__ = ["MISS"]


class _Miss:
    """The type of :py:data:`MISS`, what :py:meth:`SharedCacheStore.get` returns when it has no item for a key."""

    def __reduce__(self) -> str:
        return "MISS"

    def __repr__(self) -> str:
        return "MISS"


MISS = _Miss()

_MAGIC = b"\x89MONAI\r\n"
_VERSION = 1
# magic, version, flags, header_len, total_len, key_len, n_buffers, pickle_len
_PREFIX = struct.Struct("<8sHHIQIIQ")
_ENTRY = struct.Struct("<QQ")
_ALIGN = 64
# files smaller than this are written from one buffer and read into memory; larger ones are mapped copy-on-write
_SMALL_FILE = 64 * 1024
_GPU_MESSAGE = (
    "SharedCacheStore can only store CPU tensors, got a tensor on device '{}'. The shared cache holds the output "
    "of the deterministic transforms in shared memory; keep those transforms on the CPU and move the data to the "
    "GPU after them, e.g. with EnsureTyped(keys, device=...) placed after the first random transform."
)


class _CorruptItem(Exception):
    """An item file that is not a complete item of this format."""


_PLAIN_STATE_SUBCLASSES: dict[type, bool] = {}


def _plain_state_subclass(cls: type) -> bool:
    """Whether a tensor subclass pickles as tensor data plus its ``__dict__`` (no custom pickling, no slots)."""
    ok = _PLAIN_STATE_SUBCLASSES.get(cls)
    if ok is None:
        ok = all(
            getattr(cls, name, None) is getattr(torch.Tensor, name, None)
            for name in ("__reduce_ex__", "__reduce__", "__getstate__", "__setstate__")
        )
        for base in cls.__mro__:
            if base is torch.Tensor:
                break
            ok = ok and "__slots__" not in vars(base)
        _PLAIN_STATE_SUBCLASSES[cls] = ok
    return ok


def _rebuild_tensor(
    buffer: Any, dtype: torch.dtype, shape: tuple[int, ...], cls: type, state: dict | None
) -> torch.Tensor:
    """Rebuild a tensor (or tensor subclass such as MetaTensor) over the raw bytes ``buffer``, without a copy."""
    if buffer is None:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8)).view(dtype).reshape(shape)
    if cls is not torch.Tensor:
        t = t.as_subclass(cls)
    if state:
        t.__dict__.update(state)
    return t


def _rebuild_ndarray(buffer: Any, dtype: np.dtype, shape: tuple[int, ...], order: str) -> np.ndarray:
    """Rebuild a numpy array over the raw bytes ``buffer``, without a copy."""
    if buffer is None:
        return np.empty(shape, dtype=dtype, order="F" if order == "F" else "C")
    return np.frombuffer(buffer, dtype=np.uint8).view(dtype).reshape(shape, order="F" if order == "F" else "C")


def _reduce_tensor(t: torch.Tensor) -> Any:
    cls = type(t)
    if t.device.type != "cpu":
        raise TypeError(_GPU_MESSAGE.format(t.device))
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented
    if cls is not torch.Tensor and not _plain_state_subclass(cls):
        return NotImplemented
    state = getattr(t, "__dict__", None) or None
    data = t.as_subclass(torch.Tensor) if cls is not torch.Tensor else t
    data = data.detach().resolve_conj().resolve_neg().contiguous()
    buffer: pickle.PickleBuffer | None = None
    if data.numel() > 0:
        try:
            raw = data.reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError):  # sub-byte dtypes: leave them to torch's own pickling
            return NotImplemented
        buffer = pickle.PickleBuffer(cast(Any, raw))
    return _rebuild_tensor, (buffer, data.dtype, tuple(data.shape), cls, state)


def _reduce_ndarray(arr: np.ndarray) -> Any:
    if arr.dtype.hasobject:
        return NotImplemented
    if type(arr) is not np.ndarray:
        arr = arr.view(np.ndarray)
    if arr.flags.c_contiguous:
        order = "C"
    elif arr.flags.f_contiguous:
        order = "F"
    else:
        arr, order = np.ascontiguousarray(arr), "C"
    if arr.size == 0:
        return _rebuild_ndarray, (None, arr.dtype, arr.shape, order)
    raw = arr.ravel(order="K").view(np.uint8)  # a view of the bytes in memory order
    return _rebuild_ndarray, (pickle.PickleBuffer(cast(Any, raw)), arr.dtype, arr.shape, order)


class _StorePickler(pickle.Pickler):
    """Protocol-5 pickler that sends the bytes of tensors and numpy arrays out-of-band."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        if type(obj) is np.ndarray or type(obj) is np.memmap:
            return _reduce_ndarray(obj)
        return NotImplemented


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _encode(key: str, item: Any) -> tuple[list[tuple[int, memoryview]], int]:
    """Serialize ``item``: the chunks ``(offset, bytes)`` of the file, and its total length."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _StorePickler(stream, protocol=5, buffer_callback=buffers.append).dump(item)
    body = stream.getbuffer()
    raws = [b.raw() for b in buffers]
    key_bytes = key.encode("utf-8", "surrogatepass")
    header_len = _align(_PREFIX.size + len(key_bytes) + _ENTRY.size * len(raws), 8)
    total = header_len + body.nbytes
    table = []
    for raw in raws:
        offset = _align(total, _ALIGN)
        table.append((offset, raw.nbytes))
        total = offset + raw.nbytes
    header = bytearray(header_len)
    _PREFIX.pack_into(header, 0, _MAGIC, _VERSION, 0, header_len, total, len(key_bytes), len(raws), body.nbytes)
    header[_PREFIX.size : _PREFIX.size + len(key_bytes)] = key_bytes
    for i, entry in enumerate(table):
        _ENTRY.pack_into(header, _PREFIX.size + len(key_bytes) + i * _ENTRY.size, *entry)
    chunks = [(0, memoryview(header)), (header_len, body)]
    chunks += [(offset, raw) for (offset, _), raw in zip(table, raws)]
    return chunks, total


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]


def _write_item(fd: int, chunks: list[tuple[int, memoryview]], total: int) -> None:
    """Write the chunks of an item with ``os.write`` (never through a mapping: a full disk is an error, not SIGBUS)."""
    if total < _SMALL_FILE:
        out = bytearray(total)
        for offset, data in chunks:
            out[offset : offset + data.nbytes] = data
        _write_all(fd, memoryview(out))
        return
    pos = 0
    for offset, data in chunks:
        if offset > pos:
            _write_all(fd, memoryview(bytes(offset - pos)))
        _write_all(fd, data)
        pos = offset + data.nbytes


def _decode(buf: memoryview, key: str) -> Any:
    """Unpickle an item file held in ``buf``; ``MISS`` if it holds another key; ``_CorruptItem`` if malformed."""
    size = buf.nbytes
    if size < _PREFIX.size:
        raise _CorruptItem("truncated header")
    magic, version, _, header_len, total, key_len, n_buffers, pickle_len = _PREFIX.unpack_from(buf, 0)
    if magic != _MAGIC or version != _VERSION:
        raise _CorruptItem("bad magic or version")
    table_end = _PREFIX.size + key_len + _ENTRY.size * n_buffers
    if total != size or table_end > header_len or header_len + pickle_len > size:
        raise _CorruptItem("truncated or inconsistent lengths")
    try:
        stored_key = bytes(buf[_PREFIX.size : _PREFIX.size + key_len]).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as err:
        raise _CorruptItem("bad key") from err
    if stored_key != key:
        return MISS
    buffers = []
    start = _PREFIX.size + key_len
    for i in range(n_buffers):
        offset, length = _ENTRY.unpack_from(buf, start + i * _ENTRY.size)
        if offset < header_len + pickle_len or offset + length > size:
            raise _CorruptItem("bad buffer table")
        buffers.append(buf[offset : offset + length])
    try:
        return pickle.loads(buf[header_len : header_len + pickle_len], buffers=buffers)
    except (pickle.UnpicklingError, EOFError, struct.error) as err:
        raise _CorruptItem(f"bad pickle stream: {err}") from err
