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
Checksums of the items of a persistent store on a disk.

A disk can return other bytes than were written: a failing device, a file system repaired after a crash, a file
restored in part. The item format checks an item's header, lengths and pickle stream, not its array bytes. Here, the digest
of the whole item file is kept in an extended attribute of the file (``user.monai.sum``), set on the temporary file
before the store renames it into place, so that an item and its checksum are published together. The first read of an
item in a run (a session of the persistent store) checks it and records that it did (``user.monai.seen``: the
session), so that the run's other processes trust it, and each process remembers the files it checked. A first read
that checks costs what hashing the whole item costs; on a file system that keeps checksums of its own (btrfs, ZFS),
``MONAI_CACHE_CHECKSUMS=0`` turns them off: items are then written without one and read unchecked.

The digest is XXH3-64 of the ``xxhash`` package where it is installed, else zlib's CRC-32; the attribute names its
algorithm, so that either reads what the other wrote (``benchmarks/bench_cache.py`` measures the cost of a checked first read).
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from typing import Any

try:
    import xxhash
except ImportError:  # the fork's wheel requires it; CRC-32 is slower, and as good at finding damaged bytes
    xxhash = None  # type: ignore[assignment]

SUM, SEEN = "user.monai.sum", "user.monai.seen"
ENV = "MONAI_CACHE_CHECKSUMS"  # "0": no checksums, for file systems that keep their own (btrfs, ZFS)


def enabled() -> bool:
    """Whether this process keeps and checks checksums: unless ``$MONAI_CACHE_CHECKSUMS`` is ``0``."""
    return os.environ.get(ENV, "1").strip() != "0"


# no extended attributes on this file system (or for this user): its items are read unchecked
UNSUPPORTED = {errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}
_ATTRIBUTES = hasattr(os, "setxattr")  # Linux: not macOS, where the store works too


def digest(algorithm: bytes, data: Any) -> bytes | None:
    """The hexadecimal digest of the bytes ``data`` by ``algorithm``; ``None`` if this process lacks it."""
    if algorithm == b"xxh3" and xxhash is not None:
        return b"%016x" % xxhash.xxh3_64_intdigest(data)
    if algorithm == b"crc32":
        return b"%08x" % zlib.crc32(data)
    return None


def seal(fd: int) -> None:
    """
    Record the digest of the file open at ``fd`` (to read and write) in its attribute.

    Raises:
        OSError: the attribute cannot be set (``ENOTSUP``: this file system has none).
    """
    if not _ATTRIBUTES:
        raise OSError(errno.ENOTSUP, "this platform has no extended attributes")
    algorithm = b"xxh3" if xxhash is not None else b"crc32"
    size = os.fstat(fd).st_size
    if size:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:  # just written: in the page cache
            value = digest(algorithm, m)
    else:
        value = digest(algorithm, b"")
    os.setxattr(fd, SUM, algorithm + b":" + (value or b""))


def check(fd: int, view: Any, session: int) -> bool | None:
    """
    Whether the item file open at ``fd``, read as ``view``, holds the bytes that were sealed, or was checked in the
    session ``session`` already; ``None`` if it cannot be known here (no attributes, or an algorithm that this process
    lacks). A file without its digest was not written whole by a store that seals: ``False``.
    """
    if not _ATTRIBUTES:
        return None
    try:
        if os.getxattr(fd, SEEN) == b"%d" % session:
            return True
    except OSError as err:
        if err.errno in UNSUPPORTED:
            return None
    try:
        recorded = os.getxattr(fd, SUM)
    except OSError as err:
        return None if err.errno in UNSUPPORTED else False
    algorithm, _, value = recorded.partition(b":")
    found = digest(algorithm, view)
    if found is None:
        return None
    if found != value:
        return False
    try:  # the run's other processes need not read it whole again
        os.setxattr(fd, SEEN, b"%d" % session)
    except OSError:
        pass
    return True
