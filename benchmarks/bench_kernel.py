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
The kernel's floor of a first read: what mapping a store's item file costs the kernel alone, with no Python object
made. For one item file, timed interleaved with the floor's hit (medians):

- ``touch``: open + a fresh ``MAP_PRIVATE`` mapping of the whole file + one byte read in each page of the crop region
  of each array (exactly the pages a crop of ``roi`` reads; a random crop position at each repetition) + munmap;
- ``populate``: open + a fresh mapping + ``madvise(MADV_POPULATE_READ)`` of the whole file + munmap.

The arrays are located in the file by its buffer table (see ``monai/data/_cache_format.py``: a fixed prefix, the key,
then ``(offset, length)`` per out-of-band buffer), each array being the buffer of its byte size. Anything not available
(no libc, a kernel without ``MADV_POPULATE_READ``, another file format) is reported as an ``error``, never raised.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench_common import median, minflt

MADV_POPULATE_READ = 22
_PREFIX = struct.Struct("<8sHHIQIIQ")  # magic, version, flags, header_len, total_len, key_len, n_buffers, pickle_len
_ENTRY = struct.Struct("<QQ")  # offset, length of an out-of-band buffer
_MAGIC = b"\x89MONAI\r\n"


def buffer_table(path: str) -> list[tuple[int, int]]:
    """The ``(offset, length)`` of the out-of-band buffers of an item file."""
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        magic, _, _, header_len, _, key_len, n_buffers, _ = _PREFIX.unpack(head)
        if magic != _MAGIC:
            raise ValueError(f"{path}: not an item file")
        f.seek(_PREFIX.size + key_len)
        table = f.read(_ENTRY.size * n_buffers)
    return [_ENTRY.unpack_from(table, i * _ENTRY.size) for i in range(n_buffers)]


def locate_arrays(path: str, arrays: Sequence[tuple[Sequence[int], int]]) -> list[int]:
    """The file offset of each array ``(shape, itemsize)``: the first unused buffer of its byte size."""
    table = buffer_table(path)
    used: set[int] = set()
    offsets = []
    for shape, itemsize in arrays:
        nbytes = itemsize
        for s in shape:
            nbytes *= int(s)
        found = next((i for i, (_, length) in enumerate(table) if length == nbytes and i not in used), None)
        if found is None:
            raise ValueError(f"{path}: no buffer of {nbytes} bytes")
        used.add(found)
        offsets.append(table[found][0])
    return offsets


def crop_pages(
    offset: int, shape: Sequence[int], itemsize: int, start: Sequence[int], roi: Sequence[int], page: int
) -> Any:
    """The page numbers (of the file) that a crop of ``roi`` at ``start`` (spatial) of a C-order array reads."""
    import numpy as np

    c, x, y, z = (int(s) for s in shape)
    x0, y0, z0 = (int(s) for s in start)
    rx, ry, rz = (int(s) for s in roi)
    cc, xx, yy = np.meshgrid(np.arange(c), np.arange(x0, x0 + rx), np.arange(y0, y0 + ry), indexing="ij")
    first = offset + itemsize * (((cc * x + xx) * y + yy) * z + z0)
    last = first + rz * itemsize - 1
    first, last = (first // page).ravel(), (last // page).ravel()
    span = int((last - first).max()) if first.size else 0
    pages = [first + k for k in range(span + 1)]
    return np.unique(np.concatenate([p[p <= last] for p in pages]))


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _map(libc: Any, path: str) -> tuple[int, int]:
    """A fresh private read-only mapping of the whole file ``path``: (address, size); the descriptor is closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
    finally:
        os.close(fd)
    return addr, size


def measure(
    path: str,
    arrays: Sequence[tuple[Sequence[int], int]],
    roi: Sequence[int],
    reps: int,
    floor_hit: Callable[[], None],
    seed: int = 0,
) -> dict[str, Any]:
    """
    Time ``touch`` and ``populate`` (see the module's docstring) on the item file ``path`` of the ``arrays``
    (``(shape, itemsize)`` with shape ``(C, X, Y, Z)``), ``reps`` times, each interleaved with one ``floor_hit()``.
    """
    import numpy as np

    res: dict[str, Any] = {"path": path, "floor_s": [], "touch_s": [], "populate_s": [], "touch_minflt": []}
    try:
        libc = _libc()
        offsets = locate_arrays(path, arrays)
        res["file_bytes"] = os.path.getsize(path)
    except (OSError, AttributeError, ValueError, struct.error) as err:
        return {"path": path, "error": f"{type(err).__name__}: {err}"}
    page = mmap.PAGESIZE
    rng = np.random.default_rng(seed)
    n_pages = []
    for _ in range(reps):
        start = [int(rng.integers(0, int(s) - int(r) + 1)) for s, r in zip(arrays[0][0][1:], roi)]
        pages = np.concatenate(
            [crop_pages(off, shape, size, start, roi, page) for off, (shape, size) in zip(offsets, arrays)]
        )
        n_pages.append(int(pages.size))
        touch_at = pages * page
        t0 = time.perf_counter()
        floor_hit()
        res["floor_s"].append(time.perf_counter() - t0)
        try:
            f0 = minflt()
            t0 = time.perf_counter()
            addr, size = _map(libc, path)
            view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
            int(view[touch_at].sum())  # one byte per page: each page of the crop is faulted in
            del view
            libc.munmap(addr, size)
            res["touch_s"].append(time.perf_counter() - t0)
            res["touch_minflt"].append(minflt() - f0)
        except OSError as err:
            res["touch_error"] = str(err)
        if "populate_error" in res:
            continue
        try:
            t0 = time.perf_counter()
            addr, size = _map(libc, path)
            rc = libc.madvise(addr, size, MADV_POPULATE_READ)
            err_no = ctypes.get_errno()
            libc.munmap(addr, size)
            elapsed = time.perf_counter() - t0
            if rc != 0:
                raise OSError(err_no, f"madvise(MADV_POPULATE_READ): {os.strerror(err_no)}")
            res["populate_s"].append(elapsed)
        except OSError as err:
            res["populate_error"] = str(err)
    res["crop_pages"] = median(n_pages)
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios to the floor (``None`` where not available) of one :func:`measure` result."""
    floor = median(res.get("floor_s", []))
    out: dict[str, Any] = {"error": res.get("error"), "floor_s": floor, "crop_pages": res.get("crop_pages")}
    for what in ("touch", "populate"):
        values = res.get(f"{what}_s") or []
        out[f"{what}_s"] = median(values) if values else None
        out[f"{what}_x_floor"] = median(values) / floor if values and floor == floor and floor > 0 else None
        out[f"{what}_error"] = res.get(f"{what}_error")
    faults = res.get("touch_minflt") or []
    out["touch_minflt"] = median(faults) if faults else None
    return out
