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
Whether a mapping of an item file that the mapping pool of :py:mod:`monai_sharedcache._pool` takes back is still
pristine: no page written since it was made.

A mapping handed back to the pool must hold exactly the file's content: no page written (a private copy) since it
was made. Checking costs a walk of its page tables, in one of two ways:
- by page category (``PAGEMAP_SCAN``, Linux >= 6.7, else a read of ``/proc/self/pagemap``): a page present or
  swapped that is not a page of the file is a copy. The kernel looks at every present page's ``struct page``: about
  2 ms for the 37,000 pages of a 145 MiB item once a worker has read all of it, a large part of a hit.
- by write watch, for a mapping taken again after a first reuse: its pages are all brought in at once
  (``MADV_POPULATE_READ``, one call) and write-protected with a ``userfaultfd`` in asynchronous mode (Linux >= 6.7):
  a write still makes its private copy, without any signal or handler, and clears the page's write-protect bit;
  ``PAGEMAP_SCAN`` then finds a written page by that bit alone, in about 0.03 ms for the same item, and later hits
  take no page fault at all. Where the kernel refuses (older kernels, a seccomp profile that blocks
  ``userfaultfd``, a file system other than tmpfs), mappings are checked by page category.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

import numpy as np

_PAGE = mmap.PAGESIZE

UNMAP, WATCHED = -1, -2  # states of a released mapping; a state >= 0 is how often it was kept before, unwatched
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_PAGE_IS_WRITTEN, _PAGE_IS_FILE, _PAGE_IS_PRESENT, _PAGE_IS_SWAPPED, _PAGE_IS_HUGE = (
    1 << 1,
    1 << 2,
    1 << 3,
    1 << 4,
    1 << 6,
)
_SCAN_ARG = struct.Struct("12Q")  # size, flags, start, end, walk_end, vec, vec_len, max_pages, 4 category masks
_scan_works: bool | None = None  # None until the first call tells whether this kernel has PAGEMAP_SCAN


def _scan(addr: int, size: int, inverted: int, mask: int, anyof: int) -> bool | None:
    """Whether a page of ``[addr, addr+size)`` matches (``PAGEMAP_SCAN``, stops at the first); None if unknown."""
    import fcntl  # here, not at import: the pool runs this only where SharedCacheStore.supported (fcntl) holds

    global _scan_works
    if _scan_works is False:
        return None
    region = ctypes.create_string_buffer(24)  # one struct page_region: start, end, categories
    vec = ctypes.addressof(region)
    arg = bytearray(_SCAN_ARG.pack(_SCAN_ARG.size, 0, addr, addr + size, 0, vec, 1, 1, inverted, mask, anyof, mask))
    fd = _pagemap()
    if fd is None:
        return None
    try:
        found = int(fcntl.ioctl(fd, _PAGEMAP_SCAN, arg))  # type: ignore[call-overload]  # a mutable buffer: an int
    except OSError:
        _scan_works = False  # ENOTTY or EINVAL: a kernel older than 6.7
        return None
    _scan_works = True
    return bool(found > 0)


_PAGEMAP: list[int] = [-1, -1]  # this process's descriptor of /proc/self/pagemap, and its pid


def _pagemap() -> int | None:
    """A descriptor of this process's pagemap, kept open; a forked child opens its own (the parent's is of the
    parent's memory)."""
    fd, pid = _PAGEMAP
    if pid == os.getpid():
        return fd
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        _PAGEMAP[:] = [os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC), os.getpid()]
    except OSError:
        _PAGEMAP[:] = [-1, -1]
        return None
    return _PAGEMAP[0]


class _WriteWatch:
    """This process's ``userfaultfd``, in asynchronous write-protect mode (see the comment above)."""

    _NR = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine if hasattr(os, "uname") else "")
    _API, _REGISTER, _WRITEPROTECT = 0xC018AA3F, 0xC020AA00, 0xC018AA06  # UFFDIO_API, _REGISTER, _WRITEPROTECT
    _FEATURES = (1 << 12) | (1 << 13) | (1 << 15)  # WP_HUGETLBFS_SHMEM, WP_UNPOPULATED, WP_ASYNC
    _USER_MODE_ONLY, _MADV_POPULATE_READ = 1, 22

    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid = -1
        self._failed = False

    def after_fork_in_child(self) -> None:
        """A forked child must never use its parent's userfaultfd, which acts on the parent's memory."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self.__init__()  # type: ignore[misc]

    def active(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def _open(self, libc: Any) -> bool:
        import fcntl  # as in _scan

        if self.active() or self._failed:
            return not self._failed
        self._failed = True
        if self._NR is None or _scan_works is not True:
            return False
        flags = os.O_CLOEXEC | os.O_NONBLOCK | self._USER_MODE_ONLY
        fd = int(libc.syscall(self._NR, flags))
        if fd < 0:
            return (
                False  # e.g. EPERM: blocked by a seccomp profile (Docker's default) or by vm.unprivileged_userfaultfd
            )
        try:
            api = bytearray(struct.pack("3Q", 0xAA, self._FEATURES, 0))
            fcntl.ioctl(fd, self._API, api)
            if struct.unpack("3Q", api)[1] & self._FEATURES != self._FEATURES:
                raise OSError("userfaultfd without asynchronous write-protection of shmem")
        except OSError:
            os.close(fd)
            return False
        self._fd, self._pid, self._failed = fd, os.getpid(), False
        return True

    def watch(self, libc: Any, addr: int, size: int) -> bool:
        """Bring in every page of the mapping and write-protect them; False if the kernel refuses."""
        import fcntl  # as in _scan

        size = -(-size // _PAGE) * _PAGE  # whole pages, as the mapping
        if not self._open(libc) or libc.madvise(addr, size, self._MADV_POPULATE_READ) != 0 or self._fd is None:
            return False
        try:
            fcntl.ioctl(self._fd, self._REGISTER, bytearray(struct.pack("4Q", addr, size, 1 << 1, 0)))  # MODE_WP
            fcntl.ioctl(self._fd, self._WRITEPROTECT, bytearray(struct.pack("3Q", addr, size, 1)))  # MODE_WP
        except OSError:
            return False  # e.g. EINVAL: not a tmpfs file; a registration without protection changes nothing
        return True

    def written(self, addr: int, size: int) -> bool:
        """Whether a page of a watched mapping was written since it was watched (True if unknown)."""
        found = _scan(addr, size, 0, _PAGE_IS_WRITTEN, 0)
        return found is not False


WATCH = _WriteWatch()


def _pristine(addr: int, size: int) -> bool:
    """Whether no page of the private mapping ``[addr, addr+size)`` was written (Linux pagemap); False if unknown."""
    written = _scan(addr, size, _PAGE_IS_FILE, _PAGE_IS_FILE, _PAGE_IS_PRESENT | _PAGE_IS_SWAPPED)
    if written is not None:
        return not written
    first, count = addr // _PAGE, (size + _PAGE - 1) // _PAGE
    fd = _pagemap()  # a kernel older than 6.7: read the page table entries, 8 bytes per page
    if fd is None:
        return False
    try:
        data = os.pread(fd, count * 8, first * 8)
    except OSError:
        return False
    if len(data) != count * 8:
        return False
    entries = np.frombuffer(data, dtype=np.uint64)
    present_or_swapped = (entries >> np.uint64(62)) != 0  # bit 63 present, bit 62 swapped
    file_page = ((entries >> np.uint64(61)) & np.uint64(1)) != 0  # bit 61: page of the file, not a private copy
    return not bool(np.any(present_or_swapped & ~file_page))


def keep(libc: Any, addr: int, size: int, state: int) -> int:
    """The state in which a released mapping is kept for reuse, or ``UNMAP`` if a page was written or it is unknown."""
    if state == WATCHED and WATCH.active():  # else a forked child: its pages lost their write-protect bits
        return UNMAP if WATCH.written(addr, size) else WATCHED
    if not _pristine(addr, size):
        return UNMAP
    # reused before, so likely to be reused again; not on huge pages (a tmpfs mounted with huge=): their few page
    # table entries are cheap to check, and write-protecting them splits them into small pages that fault again
    if state >= 1 and not _scan(addr, size, 0, _PAGE_IS_HUGE, 0) and WATCH.watch(libc, addr, size):
        return WATCHED
    return max(state, 0) + 1
