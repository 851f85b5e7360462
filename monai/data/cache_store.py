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
A serverless runtime cache shared by processes on one machine: every item is a file in a private directory
(on ``/dev/shm`` by default), written atomically and read through a private copy-on-write memory mapping.

See :py:class:`SharedCacheStore`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import mmap
import os
import pickle
import re
import secrets
import shutil
import stat
import struct
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from monai.data.cache_budget import ENV_ROOT, Budget

__all__ = ["MISS", "SharedCacheStore"]


class _Miss:
    """The type of :py:data:`MISS`, what :py:meth:`SharedCacheStore.get` returns when it has no item for a key."""

    def __reduce__(self) -> str:
        return "MISS"

    def __repr__(self) -> str:
        return "MISS"


MISS = _Miss()
_WARN_LOCK = threading.Lock()

# -- file format ---------------------------------------------------------------------------------------------------
# An item file is: a fixed prefix, the key (utf-8), a table of (offset, length) of the out-of-band buffers, the pickle
# stream at ``header_len``, then every out-of-band buffer, raw, at an offset aligned to ``_ALIGN`` bytes.
_MAGIC = b"\x89MONAI\r\n"
_VERSION = 1
# magic, version, flags, header_len, total_len, key_len, n_buffers, pickle_len
_PREFIX = struct.Struct("<8sHHIQIIQ")
_ENTRY = struct.Struct("<QQ")
_ALIGN = 64
# files smaller than this are read into memory; larger ones are mapped copy-on-write
_SMALL_FILE = 64 * 1024

_PREFIX_DIR = "monai-cache-"
_ITEM_SUFFIX = ".item"
_CLAIM_SUFFIX = ".claim"
_LIVE_PREFIX = ".live-"
_TMP_DIR = ".tmp"
_META_FILE = ".meta"
_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")

# a store directory is a leftover only if it has not been modified for this long (it may be being created)
_LEFTOVER_MIN_AGE = 5.0
# a claim file without a readable owner (its creator died between creating and writing it) is stale after this
_EMPTY_CLAIM_GRACE = 5.0
_POLL_MIN, _POLL_MAX = 0.001, 0.05
# start times are exact clock ticks on Linux, seconds computed from floating point values elsewhere
_START_TOLERANCE = 0 if sys.platform.startswith("linux") else 2
# errors after which this process stops writing to the store (they will not go away by themselves)
_PERSISTENT_WRITE_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", -1)}

_O_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_GPU_MESSAGE = (
    "SharedCacheStore can only store CPU tensors, got a tensor on device '{}'. The shared cache holds the output "
    "of the deterministic transforms in shared memory; keep those transforms on the CPU and move the data to the "
    "GPU after them, e.g. with EnsureTyped(keys, device=...) placed after the first random transform."
)


class _CorruptItem(Exception):
    """An item file that is not a complete item of this format."""


# -- processes ------------------------------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """
    The start time of process ``pid`` (clock ticks since boot on Linux, seconds since the epoch elsewhere), ``0`` if
    the process is alive but its start time is unknown, ``None`` if it does not exist or is a zombie.
    """
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError:
            data = b""
        if data:
            # the command name (field 2) is in parentheses and may itself contain spaces and parentheses
            fields = data[data.rindex(b")") + 2 :].split()
            if fields[0] in (b"Z", b"X", b"x"):
                return None
            return int(fields[19])  # field 22, "starttime"
    try:
        import psutil  # optional dependency of MONAI
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return int(proc.create_time())
        except psutil.NoSuchProcess:  # including psutil.ZombieProcess
            return None
        except Exception:  # e.g. psutil.AccessDenied: the process exists
            return 0
    if os.name != "posix":
        return 0  # cannot tell without psutil: assume alive, so that nothing in use is ever removed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def _pid_namespace() -> int:
    """An id of this process's PID namespace (Linux), ``0`` if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino if sys.platform.startswith("linux") else 0
    except OSError:
        return 0


_SELF: tuple[int, int, int] = (-1, 0, 0)


def _self_id() -> tuple[int, int, int]:
    """``(pid, start time, PID namespace)`` of this process, recomputed after a fork."""
    global _SELF
    pid = os.getpid()
    if _SELF[0] != pid:
        _SELF = (pid, _start_time(pid) or 0, _pid_namespace())
    return _SELF


def _is_alive(pid: int, start: int, namespace: int) -> bool:
    """
    Whether the process ``(pid, start, namespace)`` (as recorded by :py:func:`_self_id`) is alive. A process of
    another PID namespace (another container sharing the directory) cannot be checked and counts as alive.
    """
    own_namespace = _self_id()[2]
    if namespace and own_namespace and namespace != own_namespace:
        return True
    current = _start_time(pid)
    if current is None:
        return False
    return not (current and start and abs(current - start) > _START_TOLERANCE)


def _parse_owner(text: str) -> tuple[int, int, int] | None:
    """``(pid, start, namespace)`` from ``"<pid>-<start>-<namespace>"``, or ``None``."""
    parts = text.split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def _has_live_participant(path: str) -> bool:
    """Whether a liveness marker in ``path`` belongs to a live process (``True`` if it cannot be told)."""
    try:
        with os.scandir(path) as it:
            names = [e.name for e in it if e.name.startswith(_LIVE_PREFIX)]
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for name in names:
        owner = _parse_owner(name[len(_LIVE_PREFIX) :].rsplit("-", 1)[0])  # .live-<pid>-<start>-<ns>-<token>
        if owner is not None and _is_alive(*owner):
            return True
    return False


def _release_participation(path: str, marker: str, owner_pid: int) -> None:
    """Remove this process's liveness marker and, if no live participant remains, the store directory."""
    if os.getpid() != owner_pid:
        return  # a forked child (e.g. a DataLoader worker) holding an inherited copy of the store
    _unlink_quiet(marker)
    if not _has_live_participant(path):
        shutil.rmtree(path, ignore_errors=True)
        _POOL.purge(path + os.sep)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _default_root() -> str:
    configured = os.environ.get(ENV_ROOT)
    if configured:
        if not os.path.isdir(configured):
            raise FileNotFoundError(
                errno.ENOENT, f"{ENV_ROOT}={configured!r} must name an existing directory for new cache stores"
            )
        return configured
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _check_private_dir(path: str) -> None:
    """Refuse a directory that another user could have written to: its items are unpickled when read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"SharedCacheStore: the cache directory {path!r} does not exist (a store is removed when its last "
            "participant closes); create a new one with SharedCacheStore() and pass its .path to the other processes",
            path,
        ) from None
    why = "items in a cache directory are unpickled when read, and unpickling data written by someone else can run "
    why += "arbitrary code"
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(
            f"SharedCacheStore: {path!r} is a symbolic link, not a directory; refusing it because {why}."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"SharedCacheStore: {path!r} is not a directory; refusing it because {why}.")
    getuid = getattr(os, "getuid", None)
    if getuid is not None and st.st_uid != getuid():
        raise PermissionError(
            f"SharedCacheStore: {path!r} is owned by uid {st.st_uid}, not by this user (uid {getuid()}); "
            f"refusing it because {why}."
        )
    if os.name == "posix" and st.st_mode & 0o077:
        raise PermissionError(
            f"SharedCacheStore: {path!r} has mode {oct(stat.S_IMODE(st.st_mode))}, so other users can access it; "
            f"it must be private to its owner (mode 0o700) because {why}."
        )


# -- serialization --------------------------------------------------------------------------------------------------

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


# -- reading: private copy-on-write mappings that hold no file descriptor ----------------------------------------------

_LIBC: Any = None
_LIBC_LOADED = False


def _libc() -> Any:
    """libc's mmap/munmap through ctypes (Python < 3.13 on POSIX, where ``mmap.mmap`` keeps a dup of the fd)."""
    global _LIBC, _LIBC_LOADED
    if not _LIBC_LOADED:
        _LIBC_LOADED = True
        if os.name == "posix" and sys.version_info < (3, 13):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_long,
                ]
                libc.munmap.restype = ctypes.c_int
                libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                _LIBC = libc
            except (OSError, AttributeError):
                _LIBC = None
    return _LIBC


class _MappingPool:
    """
    Private mappings of item files that a later read in this process may take over, with their page tables.

    A fresh mapping costs a page fault for every page a reader touches, and an ``munmap`` at the end; for a random
    crop of a large image that is most of a hit's cost. A mapping whose views are all gone, and whose pages were
    never written (no copy-on-write page in ``/proc/self/pagemap``), still holds exactly the file's content, so the
    next read of the same file (same path, device, inode, size and modification time) reuses it: no new faults, no
    unmap. A written mapping, or one that cannot be checked (no pagemap), is unmapped as before, so every reader
    still gets a private, pristine copy. The pool is per process and bounded. Kept mappings of files removed or
    replaced since are dropped at the next release or read, and at once when their store is closed or invalidated
    in this process, so that they do not pin the removed files' pages.

    Releases come from ``__del__``, which the garbage collector may run anywhere, even inside this pool's own
    critical section: they are only queued (a thread-safe ``deque``), and whoever gets the lock without waiting
    processes the queue. Nothing here ever waits for the lock from a finalizer.
    """

    MAX_MAPPINGS = 32
    MIN_SIZE = 8 << 20  # smaller mappings are cheaper to make again than to check in the pagemap

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple, list[tuple[int, int]]] = {}
        self._order: list[tuple[tuple, int, int]] = []  # oldest first, for eviction
        self._queue: deque = deque()  # ("release", libc, ident, addr, size) or ("purge", path prefix)
        self._libc: Any = None

    def take(self, ident: tuple) -> int | None:
        """A kept mapping of the file ``ident``, or None."""
        with self._lock:  # never called from a finalizer; a finalizer run in here only queues
            free = self._free.get(ident)
            addr = None
            if free:
                addr, size = free.pop()
                self._order.remove((ident, addr, size))
        self.drain()
        return addr

    def release(self, libc: Any, ident: tuple | None, addr: int, size: int) -> None:
        """Keep an unwritten mapping of a file that still exists for reuse; unmap anything else. Never blocks."""
        self._libc = libc
        self._queue.append(("release", libc, ident, addr, size))
        self.drain()

    def purge(self, prefix: str) -> None:
        """Unmap the kept mappings of files under ``prefix`` (a closed or invalidated store). Never blocks."""
        self._queue.append(("purge", prefix))
        self.drain()

    def drain(self) -> None:
        while self._queue:
            if not self._lock.acquire(blocking=False):
                return  # the holder (this thread re-entered by the collector, or another thread) drains the queue
            try:
                while self._queue:
                    self._process(self._queue.popleft())
            finally:
                self._lock.release()

    def _process(self, job: tuple) -> None:
        unmap: list[tuple[int, int]] = []
        if job[0] == "release":
            _, libc, ident, addr, size = job
            if ident is None or not _is_current(ident) or not _pristine(addr, size):
                unmap.append((addr, size))
            else:
                self._free.setdefault(ident, []).append((addr, size))
                self._order.append((ident, addr, size))
            stale = [entry for entry in self._order if not _is_current(entry[0])]
        else:
            prefix = job[1]
            stale = [entry for entry in self._order if entry[0][0].startswith(prefix)]
        keep = [entry for entry in self._order if entry not in stale]
        keep = keep[max(0, len(keep) - self.MAX_MAPPINGS) :]
        for entry in self._order:
            if entry not in keep:
                self._free[entry[0]].remove(entry[1:])
                unmap.append(entry[1:])
        self._order = keep
        for addr, size in unmap:
            self._libc.munmap(addr, size)

    def reset_lock(self) -> None:
        """After a fork: the lock may have been held by a thread that does not exist in the child."""
        self._lock = threading.Lock()


_POOL = _MappingPool()
if hasattr(os, "register_at_fork"):  # a forked child keeps its own, still private, copies of the mappings
    os.register_at_fork(after_in_child=_POOL.reset_lock)
_PAGE = mmap.PAGESIZE


def _is_current(ident: tuple) -> bool:
    """Whether the file a mapping was made of, ``(path, device, inode, size, mtime)``, is still at its path."""
    path, dev, ino, size, mtime = ident
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (dev, ino, size, mtime)


def _pristine(addr: int, size: int) -> bool:
    """Whether no page of the private mapping ``[addr, addr+size)`` was written (Linux pagemap); False if unknown."""
    first, count = addr // _PAGE, (size + _PAGE - 1) // _PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        data = os.pread(fd, count * 8, first * 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(data) != count * 8:
        return False
    entries = np.frombuffer(data, dtype=np.uint64)
    present_or_swapped = (entries >> np.uint64(62)) != 0  # bit 63 present, bit 62 swapped
    file_page = ((entries >> np.uint64(61)) & np.uint64(1)) != 0  # bit 61: page of the file, not a private copy
    return not bool(np.any(present_or_swapped & ~file_page))


class _PrivateMapping:
    """Owner of a ``MAP_PRIVATE`` file mapping made through libc; recycled or unmapped when its last view is gone."""

    def __init__(self, libc: Any, addr: int, size: int, ident: tuple | None) -> None:
        self._libc, self._addr, self._size, self._ident = libc, addr, size, ident
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (addr, False), "version": 3}

    def __del__(self) -> None:
        try:
            _POOL.release(self._libc, self._ident, self._addr, self._size)
        except Exception:
            pass


def _map_private(fd: int, size: int, ident: tuple | None = None) -> memoryview:
    """
    A writable, private, copy-on-write mapping of the whole file ``fd``; the caller may close ``fd`` at once.

    ``ident`` (path, device, inode, size, modification time) lets an unwritten mapping of the same file be reused.
    """
    if sys.version_info >= (3, 13):
        kwargs: dict[str, Any] = {"trackfd": False}
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY, **kwargs))
    libc = _libc()
    if libc is None:  # e.g. Windows: the mapping keeps a handle of its own
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))
    if size < _POOL.MIN_SIZE:
        ident = None  # not pooled: unmapped with its last view
    addr = _POOL.take(ident) if ident is not None else None
    if addr is None:
        prot = mmap.PROT_READ | mmap.PROT_WRITE  # type: ignore[attr-defined]
        addr = libc.mmap(None, size, prot, mmap.MAP_PRIVATE, fd, 0)  # type: ignore[attr-defined]
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    return memoryview(cast(Any, np.asarray(_PrivateMapping(libc, addr, size, ident))))


def _read_small(fd: int, size: int) -> memoryview:
    """Read a small file into a private, writable, 64-byte aligned buffer."""
    arr = np.empty(size + _ALIGN, dtype=np.uint8)
    start = -arr.ctypes.data % _ALIGN
    view = memoryview(cast(Any, arr[start : start + size]))
    pos = 0
    while pos < size:
        if hasattr(os, "readv"):
            n = os.readv(fd, [view[pos:]])
        else:  # Windows
            chunk = os.read(fd, size - pos)
            n = len(chunk)
            view[pos : pos + n] = chunk
        if n <= 0:
            break
        pos += n
    return view[:pos]


def _read_file(path: str) -> tuple[memoryview, int]:
    """The content of ``path`` as a private writable buffer, and the file's inode; no descriptor stays open."""
    fd = os.open(path, os.O_RDONLY | _O_BINARY)
    try:
        st = os.fstat(fd)
        if st.st_size < _SMALL_FILE:
            return _read_small(fd, st.st_size), st.st_ino
        return _map_private(fd, st.st_size, (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)), st.st_ino
    finally:
        os.close(fd)


def _remove_if_same(path: str, ino: int) -> None:
    """Remove ``path`` if it is still the file with inode ``ino`` (not one published since)."""
    try:
        if os.lstat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass


def _attach_pickled(cls: type[SharedCacheStore], path: str, claim_timeout: float) -> SharedCacheStore:
    """Unpickle a store: attach to its directory without participating; a store whose directory is gone misses."""
    try:
        return cls(path, participate=False, claim_timeout=claim_timeout)
    except FileNotFoundError as err:
        store = cls.__new__(cls)
        store._setup(path, claim_timeout)
        store._gone = True
        store._warn_once(f"the cache directory {path} is gone", err)
        return store


class SharedCacheStore:
    """
    A runtime cache shared by all the processes of one machine, without a server: every item is a file in a private
    directory, by default on ``/dev/shm`` (a RAM-backed file system), named after the item's content key.

    Processes share a store by its :py:attr:`path`: the DataLoader workers of a process receive it with the dataset
    (a store pickles as its path, so this works under ``fork``, ``spawn`` and ``forkserver``); other processes, such
    as the DDP ranks of one node, attach with ``SharedCacheStore(path)``.

    Storage:
        An item is pickled with protocol 5. The bytes of numpy arrays and of CPU tensors of any dtype (including
        ``MetaTensor``, whose ``meta``, ``applied_operations`` and ``is_batch`` are kept) are not pickled: they are
        written raw, aligned to 64 bytes, after the pickle stream. An item is written to a temporary file with
        ``os.write`` and published with an atomic ``os.replace``: a crashed writer never leaves a partial item under
        its final name, and a full file system is an ``ENOSPC`` error, never a ``SIGBUS``. A published file is never
        modified again, only replaced or removed. The directory holds ``<key>.item`` files, ``<key>.claim`` files
        (see Claims), liveness markers ``.live-*`` (see Lifetime), the capacity in ``.meta`` and the files being
        written in ``.tmp/`` (those of writers that died are removed by the next :py:meth:`put`).

        Only CPU tensors can be stored; storing a tensor on another device raises ``TypeError``. Keep the cached
        (deterministic) transforms on the CPU and move the data to the GPU after them, for example with
        ``EnsureTyped(keys, device=...)`` placed after the first random transform. Tensors are stored detached
        (``requires_grad`` is not kept) and contiguous; tensors of one item that share memory are stored separately.

    Reading:
        A file is mapped with a private, copy-on-write mapping (files under 64 KiB are simply read into a private
        buffer) and no file descriptor stays open. Arrays and tensors of the item are views of that mapping: reading
        costs no copy, and their pages are shared with the page cache until someone writes to them.

        Every :py:meth:`get` returns a new object graph over its own private mapping, so a caller may modify an item
        in place (as random transforms do) without affecting the cache or any other reader.
        When all views of a mapping are gone and none of its pages was written (checked in ``/proc/self/pagemap``),
        the process keeps the mapping, with its page tables, for the next read of the same unchanged file: repeated
        hits of an item then cost no new page faults and no ``munmap``. A written mapping is always unmapped.
        ``reads_are_private`` is therefore ``True``, and ``CacheDataset`` skips its deepcopy of cached items.

    Claims:
        :py:meth:`get_or_compute` computes each missing item once across all processes and threads: the first one
        creates an exclusive ``<key>.claim`` file, the others wait for the item, for the claim to be released, or
        for its owner to die (a claim of a dead process is removed), at most ``claim_timeout`` seconds. An owner is
        a process (pid and start time, so that a reused pid is not mistaken for it) and a thread.

    Faults:
        A removed directory, a full file system or a permission error never raises: this process warns once and
        carries on as with a cache that misses (after a persistent write error such as ``ENOSPC`` it stops writing,
        but still reads what is there). A removed directory is never created again. A malformed item file counts
        as a miss and is removed.

    Lifetime:
        Each participating process (``participate=True``) keeps a liveness marker
        ``.live-<pid>-<start time>-<pid namespace>-<random>`` in the directory (one per store object).
        :py:meth:`close` (called at exit too) removes the marker of this process and, if no marker of a live process
        remains, the directory. Only the process that registered acts: a forked DataLoader worker
        that inherits the store never removes anything. Directories of crashed runs are removed by
        :py:meth:`cleanup_leftovers`, which every new store runs on its root. A directory without any marker of a
        live process (for example one used only by non-participating processes) counts as a leftover once it has
        not been modified for a few seconds. A process of another PID namespace (another container sharing
        ``/dev/shm``) cannot be checked and counts as alive. A process that attaches with ``participate=True`` at
        the very moment the last participant closes may find the directory gone, and then works without cache.

    Budget:
        The DataLoader moves batches from its workers through shared memory, on the same ``/dev/shm`` by default,
        so a store that filled it would make the DataLoader fail (Docker's default ``/dev/shm`` is 64 MB). An item
        that would leave less than ``reserve`` bytes free, or take the store past ``max_bytes``, is computed and
        returned without being stored; each process warns once, and ``stats()["refused"]`` counts such items.
        See :py:mod:`monai.data.cache_budget` for the default.

    Security:
        Items are unpickled when read, which can run arbitrary code, so a store attaches only to a real directory
        (not a symbolic link) owned by the current user and inaccessible to others (mode ``0o700``, as created).

    Args:
        path: the directory of an existing store to attach to; ``None`` creates a new store.
        root: where to create a new store: the directory named by the environment variable ``MONAI_CACHE_ROOT``
            if set, else ``/dev/shm`` if it is a writable directory, else the system's temporary directory (macOS,
            Windows). Only used when ``path`` is ``None``.
        participate: whether this process keeps the store alive until it closes it (see Lifetime).
        claim_timeout: how long, in seconds, :py:meth:`get_or_compute` waits for an item another process or thread
            is computing before it computes the item itself without storing it.
        reserve: bytes that the store keeps free on its file system, for the DataLoader's own shared memory (see
            Budget); ``None`` for ``MONAI_CACHE_RESERVE_BYTES`` if set, else half the file system, at most 4 GiB.
            Only used when ``path`` is ``None``: the store's creator sets the budget for all its users.
        max_bytes: a cap on the total size of the store's items; ``None`` for ``MONAI_CACHE_MAX_BYTES`` if set,
            else no cap. Only used when ``path`` is ``None``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        PermissionError: ``path`` is not a private directory of the current user (see Security).
        ValueError: ``claim_timeout``, ``reserve`` or ``max_bytes`` is negative, or ``root``, ``reserve`` or
            ``max_bytes`` is given with ``path``.
        FileNotFoundError: ``MONAI_CACHE_ROOT`` names no directory.

    Example:
        .. code-block:: python

            store = SharedCacheStore()  # a new directory /dev/shm/monai-cache-*
            store.resize(2)
            store.put(0, "3f2a", {"image": torch.zeros(1, 8, 8)})
            item = store.get(0, "3f2a")  # {"image": tensor(...)}, a private copy-on-write view
            other = SharedCacheStore(store.path)  # e.g. in another process of the same user
            other.get(0, "3f2a")
            other.close()
            store.close()  # the last participant to close removes the directory

    Limitations:
        Keys map to file names: a key that is not ``[0-9A-Za-z_-]{1,128}`` is stored under its SHA-256 digest.
        The key is also recorded in the file and checked on read, so a file for another key is a miss (which also
        covers case-insensitive file systems). Outside Linux, liveness is checked with ``psutil`` if installed, else
        by pid only. Windows is supported on a best-effort basis only (no ownership or mode check; an item that is
        being read cannot be replaced). A store is for the processes of one machine: liveness checks do not work
        across machines on a network file system.
    """

    reads_are_private = True
    _warned: set[tuple[int, int, str]] = set()  # (pid, store, what) of the warnings given, once per process

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        root: str | os.PathLike | None = None,
        participate: bool = True,
        claim_timeout: float = 600.0,
        reserve: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if claim_timeout < 0:
            raise ValueError(f"claim_timeout must be non-negative, got {claim_timeout}.")
        Budget("", reserve, max_bytes)  # checks the values before anything is created
        if path is None:
            root_dir = _default_root() if root is None else os.fspath(root)
            SharedCacheStore.cleanup_leftovers(root_dir)
            new_path = os.path.abspath(tempfile.mkdtemp(prefix=_PREFIX_DIR, dir=root_dir))
            try:
                os.mkdir(os.path.join(new_path, _TMP_DIR), 0o700)
                Budget.create(new_path, reserve, max_bytes)
                self._setup(new_path, claim_timeout)
                if participate:
                    self._register()
            except BaseException:
                shutil.rmtree(new_path, ignore_errors=True)
                raise
            return
        if root is not None or reserve is not None or max_bytes is not None:
            raise ValueError("root, reserve and max_bytes are only used to create a new store (path=None).")
        dir_path = os.path.abspath(os.fspath(path))
        _check_private_dir(dir_path)
        try:  # never os.makedirs: a store that has just been removed must not be created again
            os.mkdir(os.path.join(dir_path, _TMP_DIR), 0o700)
        except FileExistsError:
            pass
        self._setup(dir_path, claim_timeout)
        if participate:
            self._register()

    def _setup(self, path: str, claim_timeout: float) -> None:
        self._path = path
        self._tmp_dir = os.path.join(path, _TMP_DIR)
        self._claim_timeout = float(claim_timeout)
        self._gone = False  # the directory was removed (or this store closed): always miss
        self._writable = True  # False after a persistent write error
        self._local = threading.local()  # per thread: the claims it holds
        self._finalizer: weakref.finalize | None = None
        self._budget = Budget.load(path)  # as recorded by the process that created the store

    def _register(self) -> None:
        pid, start, namespace = _self_id()
        marker = os.path.join(self._path, f"{_LIVE_PREFIX}{pid}-{start}-{namespace}-{secrets.token_hex(4)}")
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        # runs at close(), at garbage collection and at interpreter exit, and only in this process
        self._finalizer = weakref.finalize(self, _release_participation, self._path, marker, pid)

    @property
    def path(self) -> str:
        """The directory of the store."""
        return self._path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def __reduce__(self) -> tuple:
        """Pickle as the path: unpickling attaches to the same directory with ``participate=False``."""
        return _attach_pickled, (type(self), self._path, self._claim_timeout)

    # -- slots ----------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """
        The capacity last set by :py:meth:`resize` in any process.

        Returns:
            the number of slots, ``0`` if never set or unreadable.
        """
        try:
            with open(os.path.join(self._path, _META_FILE), "rb") as f:
                return int(json.loads(f.read())["capacity"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def resize(self, n: int) -> None:
        """
        Record the capacity ``n``, seen by every process. Items are addressed by key, so none is removed.

        Args:
            n: the number of slots.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"the capacity must be non-negative, got {n}.")
        if self._gone:
            return
        tmp = self._tmp_name("meta")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o600)
            try:
                _write_all(fd, memoryview(json.dumps({"capacity": int(n), "format": _VERSION}).encode()))
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(self._path, _META_FILE))
        except OSError as err:
            _unlink_quiet(tmp)
            self._fault("cannot record the capacity", err)

    def get(self, index: int, key: str, default: Any = MISS) -> Any:
        """
        Read the item stored under ``key``.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            default: what to return if there is no readable item for ``key``.

        Returns:
            a new object graph of the item (arrays and tensors are views of a private copy-on-write mapping),
            or ``default``.
        """
        if self._gone:
            return default
        path = self._item_path(key)
        try:
            buf, ino = _read_file(path)
        except FileNotFoundError:
            return default
        except OSError as err:
            self._warn_once("cannot read items", err)
            return default
        try:
            item = _decode(buf, key)
        except _CorruptItem:
            _remove_if_same(path, ino)
            return default
        except Exception as err:  # e.g. a class that this process cannot import
            self._warn_once("cannot unpickle items", err)
            return default
        return default if item is MISS else item

    def put(self, index: int, key: str, item: Any) -> bool:
        """
        Store ``item`` under ``key``, replacing what is stored under it, atomically.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            item: any picklable object; tensors must be on the CPU.

        Returns:
            whether the item was stored (``False`` after a file system fault, see the class documentation).

        Raises:
            TypeError: the item holds a tensor that is not on the CPU.
            Exception: whatever pickling the item raises (e.g. for an unpicklable object).
        """
        if self._gone or not self._writable:
            return False
        chunks, total = _encode(key, item)  # raises before any file is created
        why = self._budget.room_for(total)
        if why is not None:
            self._budget.refuse()
            self._warn_budget(total, why)
            return False
        tmp = self._tmp_name(self._stem(key))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o600)
        except OSError as err:
            self._fault("cannot write items", err)
            return False
        try:
            try:
                _write_item(fd, chunks, total)
            finally:
                os.close(fd)
            os.replace(tmp, self._item_path(key))
        except OSError as err:
            _unlink_quiet(tmp)
            self._fault("cannot write items", err)
            return False
        except BaseException:
            _unlink_quiet(tmp)
            raise
        self._budget.written(total)
        self._clean_dead_temps()
        return True

    def invalidate(self, old_keys: Sequence[str], new_keys: Sequence[str]) -> None:
        """
        Remove the items of the keys in ``old_keys`` but not in ``new_keys``, and nothing else: other datasets or
        processes may keep other items in the same store.

        Args:
            old_keys: the keys before the change.
            new_keys: the keys after the change.
        """
        if self._gone:
            return
        removed = set(old_keys) - set(new_keys)
        if removed:
            _POOL.purge(os.path.join(self._path, ""))  # kept mappings of removed items would pin their pages
        for key in removed:
            try:
                os.unlink(self._item_path(key))
            except FileNotFoundError:
                if not os.path.isdir(self._path):
                    self._fault("cannot remove items", FileNotFoundError(errno.ENOENT, "no such directory", self._path))
                    return
            except OSError as err:
                self._fault("cannot remove items", err)
                return

    def get_or_compute(self, index: int, key: str, compute: Callable[[], Any]) -> Any:
        """
        Return the item stored under ``key``; on a miss compute and store it, once across processes and threads.

        Args:
            index: the slot, informational only: items are addressed by ``key``.
            key: the content key of the item.
            compute: computes the item; called at most once per call, and not at all on a hit.

        Returns:
            the item.

        Raises:
            Exception: whatever ``compute`` raises (the claim is released first), or what :py:meth:`put` raises.
        """
        item = self.get(index, key)
        if item is not MISS:
            return item
        if self._gone or not self._writable:
            return compute()
        claim = self._claim_path(key)
        deadline = time.monotonic() + self._claim_timeout
        delay = _POLL_MIN
        while True:
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                pass
            except OSError as err:
                self._fault("cannot create claim files", err)
                return compute()
            else:
                return self._compute_claimed(fd, claim, index, key, compute)
            item = self.get(index, key)
            if item is not MISS:
                return item
            state, ino = self._claim_state(claim)
            if state == "absent":
                continue
            if state == "stale":
                _remove_if_same(claim, ino)
                continue
            if state == "mine" or time.monotonic() > deadline:
                if state != "mine":
                    timeout = TimeoutError(f"{claim} was held for more than claim_timeout={self._claim_timeout} s")
                    self._warn_once("waited too long for another process to compute an item", timeout)
                return compute()  # computing it here, without storing it, cannot deadlock or corrupt anything
            time.sleep(delay)
            delay = min(delay * 1.5, _POLL_MAX)

    def _compute_claimed(self, fd: int, claim: str, index: int, key: str, compute: Callable[[], Any]) -> Any:
        ino = -1
        held = self._held_claims()
        try:
            try:
                pid, start, namespace = _self_id()
                _write_all(fd, memoryview(f"{pid} {start} {threading.get_ident()} {namespace}\n".encode()))
                ino = os.fstat(fd).st_ino
            except OSError:
                pass  # an empty claim still excludes the others; they treat it as stale after a grace period
            finally:
                os.close(fd)
            held.add(claim)
            item = self.get(index, key)  # it may have been published between our miss and our claim
            if item is MISS:
                item = compute()
                self.put(index, key, item)
            return item
        finally:
            held.discard(claim)
            if ino >= 0:
                _remove_if_same(claim, ino)
            else:
                _unlink_quiet(claim)

    def _held_claims(self) -> set[str]:
        held = getattr(self._local, "claims", None)
        if held is None:
            held = self._local.claims = set()
        return held  # type: ignore[no-any-return]

    def _claim_state(self, claim: str) -> tuple[str, int]:
        """``("absent"|"held"|"stale"|"mine", inode)`` of the claim file ``claim``."""
        try:
            fd = os.open(claim, os.O_RDONLY)
        except FileNotFoundError:
            return "absent", -1
        except OSError:
            return "held", -1
        try:
            st = os.fstat(fd)
            text = os.read(fd, 256).decode("ascii", "replace").split()
        except OSError:
            return "held", -1
        finally:
            os.close(fd)
        try:
            pid, start, tid, namespace = (int(x) for x in text)
        except ValueError:  # being written, or its creator died before writing it
            return ("stale" if time.time() - st.st_mtime > _EMPTY_CLAIM_GRACE else "held"), st.st_ino
        if (pid, start, namespace) == _self_id():
            if claim in self._held_claims():
                return "mine", st.st_ino  # compute() asks for the item it is computing
            alive = tid != threading.get_ident() and any(t.ident == tid for t in threading.enumerate())
            return ("held" if alive else "stale"), st.st_ino
        return ("held" if _is_alive(pid, start, namespace) else "stale"), st.st_ino

    def stats(self) -> dict[str, int]:
        """
        Count the items of the store (one directory scan; any process can call it).

        Returns:
            ``{"filled": number of items, "capacity": len(self), "nbytes": total size of the item files,
            "refused": number of items that were computed but not stored because of the budget (reserve or
            max_bytes), by all processes}``.
        """
        filled = nbytes = 0
        try:
            with os.scandir(self._path) as it:
                for entry in it:
                    if entry.name.endswith(_ITEM_SUFFIX) and not entry.name.startswith("."):
                        try:
                            nbytes += entry.stat(follow_symlinks=False).st_size
                        except OSError:
                            continue
                        filled += 1
        except OSError:
            pass
        return {"filled": filled, "capacity": len(self), "nbytes": nbytes, "refused": self._budget.refused()}

    # -- lifetime -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """
        Stop using the store in this process. If this process participates, remove its liveness marker and, if no
        live participant remains, the whole directory. Idempotent; in a process other than the one that registered
        (a forked worker) only this object is disabled.
        """
        self._gone = True
        if self._finalizer is not None:
            self._finalizer()  # a weakref.finalize runs at most once
        _POOL.purge(os.path.join(self._path, ""))

    @staticmethod
    def cleanup_leftovers(root: str | os.PathLike | None = None) -> list[str]:
        """
        Remove the store directories left in ``root`` by processes that are gone: ``monai-cache-*`` directories of
        the current user without a liveness marker of a live process, not modified for a few seconds.

        Args:
            root: the directory to clean; by default the default root of new stores.

        Returns:
            the removed directories.
        """
        root_dir = _default_root() if root is None else os.fspath(root)
        getuid = getattr(os, "getuid", None)
        removed: list[str] = []
        try:
            with os.scandir(root_dir) as it:
                candidates = [e for e in it if e.name.startswith(_PREFIX_DIR)]
        except OSError:
            return removed
        now = time.time()
        for entry in candidates:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or (getuid is not None and st.st_uid != getuid()):
                continue
            if now - st.st_mtime < _LEFTOVER_MIN_AGE or _has_live_participant(entry.path):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(entry.path)
        return removed

    # -- helpers --------------------------------------------------------------------------------------------------

    @staticmethod
    def _stem(key: str) -> str:
        return key if _SAFE_KEY.fullmatch(key) else hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

    def _item_path(self, key: str) -> str:
        return os.path.join(self._path, self._stem(key) + _ITEM_SUFFIX)

    def _claim_path(self, key: str) -> str:
        return os.path.join(self._path, self._stem(key) + _CLAIM_SUFFIX)

    def _tmp_name(self, stem: str) -> str:
        pid, start, namespace = _self_id()
        return os.path.join(self._tmp_dir, f"{stem}-{pid}-{start}-{namespace}-{secrets.token_hex(4)}")

    def _clean_dead_temps(self) -> None:
        """Remove the temporary files of writers that died while writing."""
        pid = os.getpid()
        try:
            with os.scandir(self._tmp_dir) as it:
                names = [e.name for e in it]
        except OSError:
            return
        for name in names:
            parts = name.rsplit("-", 4)  # <stem>-<pid>-<start>-<namespace>-<token>
            owner = _parse_owner("-".join(parts[1:4])) if len(parts) == 5 else None
            if owner is not None and owner[0] != pid and not _is_alive(*owner):
                _unlink_quiet(os.path.join(self._tmp_dir, name))

    def _fault(self, what: str, err: OSError) -> None:
        """Degrade after a file system error: warn once, and stop using the store or writing to it."""
        if not os.path.isdir(self._path):
            self._gone = True
            _POOL.purge(os.path.join(self._path, ""))
            self._warn_once(f"the cache directory {self._path} is gone", err)
            return
        if isinstance(err, FileNotFoundError) and not os.path.isdir(self._tmp_dir):
            try:  # only the store's own subdirectory, never the store itself
                os.mkdir(self._tmp_dir, 0o700)
            except OSError:
                pass
        elif err.errno in _PERSISTENT_WRITE_ERRORS:
            self._writable = False
        self._warn_once(f"{what} in {self._path}", err)

    def _warn_once(self, what: str, err: BaseException) -> None:
        """Warn once per process and store that the cache cannot be used as it should, and why."""
        token = (os.getpid(), id(self), what)  # the pid: a forked child warns for itself
        with _WARN_LOCK:
            if token in SharedCacheStore._warned:
                return
            SharedCacheStore._warned.add(token)
        warnings.warn(
            f"CacheDataset runtime cache ({type(self).__name__}): {what} ({type(err).__name__}: {err}). "
            "Items are computed without the cache from now on in this process.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _warn_budget(self, nbytes: int, why: str) -> None:
        """Warn once per process and store that items past the budget are not stored, why, and what to do."""
        token = (os.getpid(), id(self), "budget")
        with _WARN_LOCK:
            if token in SharedCacheStore._warned:
                return
            SharedCacheStore._warned.add(token)
        warnings.warn(
            f"SharedCacheStore {self._path}: not storing an item of {nbytes / 2**20:.1f} MiB because {why}. Items "
            "past the budget are computed without being stored (stats()['refused'] counts them). To cache more: "
            "give the container more shared memory (docker run --shm-size=..., or --ipc=host), put the cache on a "
            f"local disk or another tmpfs ({ENV_ROOT}=/path, or create_shared_cache(root=...)), or set the "
            "store's reserve / max_bytes.",
            RuntimeWarning,
            stacklevel=3,
        )
