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
The ``flock`` locks of a store's own files beside its items (its counts, sessions and evictions).

As in :py:mod:`monai_sharedcache._locks`, who is alive is known from locks that the kernel releases when a process
dies, in any PID namespace.
A lock is held on a descriptor that a forked child closes at once, so a DataLoader worker never holds its parent's.
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from collections.abc import Callable
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no store there
    fcntl = None  # type: ignore[assignment]

_HELD: weakref.WeakSet[Held] = weakref.WeakSet()


def _close_all() -> None:
    for held in list(_HELD):  # in a forked child: its parent's locks
        held.close()


if hasattr(os, "register_at_fork"):  # a module of the store, imported at a store's first use
    os.register_at_fork(after_in_child=_close_all)


class Held:
    """A locked descriptor of this process, closed in a forked child, and when it is garbage."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        _HELD.add(self)

    def close(self) -> None:
        self.fd = -1
        _HELD.discard(self)
        self._closer()  # once: a second call does nothing


def take(fd: int, shared: bool = False, wait: float = 0.0) -> bool:
    """Lock the file open at ``fd``, polling for up to ``wait`` seconds; whether it was locked."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return True
        except (BlockingIOError, PermissionError):  # another process holds a conflicting lock
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def hold(at: Any, name: str, shared: bool = False, wait: float = 0.0) -> Held | None:
    """
    The file ``name`` of the checked directory ``at`` (made if missing, never through a link), locked; ``None`` if
    another process holds a conflicting lock for longer than ``wait`` seconds.

    Raises:
        OSError: the file cannot be opened or made (``ELOOP``: it is a link).
    """
    held = Held(at.open(name, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)))
    try:
        if take(held.fd, shared, wait):
            return held
    except BaseException:
        held.close()
        raise
    held.close()
    return None


def pin(fd: int) -> bool:
    """
    Pin the file open at ``fd``, about to be mapped, with a shared lock: a lock belongs to the open file, which a
    mapping holds, so it lasts until the last mapping of it and the last descriptor are gone, in every process that
    has them (a forked child too). ``False`` if a store is removing the file, or has removed it.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return os.fstat(fd).st_nlink > 0  # removed between its opening and the lock: counted out already
    except OSError:
        return False


def retire(at: Any, name: str, aside: Callable[[], Any]) -> tuple[int, int]:
    """
    Remove the item file ``name`` of the checked directory ``at``. A file that a kept mapping pins, in any process, is
    renamed into the directory ``aside()`` instead, where the store counts it until :py:func:`free_aside` finds it
    released; if that fails (a full disk cannot make the directory or its entry), its name is removed all the same,
    so that it is never served again, and its bytes stay in memory or on disk uncounted until its readers let go.

    Returns:
        the bytes freed now or no longer counted, and of those the bytes that stay pinned uncounted.

    Raises:
        OSError: it cannot be opened or removed (``FileNotFoundError``: it is gone).
    """
    size, removed = _remove_unpinned(at, name)
    if removed:
        return size, 0
    try:
        d = aside()  # held while its descriptor is used: a directory's descriptor is closed with it
        os.rename(name, f"{name}-{secrets.token_hex(8)}", src_dir_fd=at.fd, dst_dir_fd=d.fd)
        return 0, 0
    except OSError:
        at.unlink(name)
        return size, size


def keep_aside(at: Any, name: str, aside: Callable[[], Any]) -> tuple[Any, str] | None:
    """
    Before the item file ``name`` of ``at`` is replaced: a second name for it in the directory ``aside()``, so that a
    mapping that pins it stays counted there once it is replaced (see :py:func:`release_aside`). ``None`` if there is
    no such file, or no second name can be made.
    """
    try:
        d = aside()
        new = f"{name}-{secrets.token_hex(8)}"
        os.link(name, new, src_dir_fd=at.fd, dst_dir_fd=d.fd, follow_symlinks=False)
        return d, new
    except OSError:
        return None


def release_aside(kept: tuple[Any, str]) -> int:
    """The bytes of a replaced file that :py:func:`keep_aside` kept, removed now if nothing pins it, else 0."""
    d, name = kept
    try:
        size, removed = _remove_unpinned(d, name)
    except OSError:
        return 0
    return size if removed else 0


def free_aside(d: Any) -> tuple[int, int]:
    """
    Remove the files that :py:func:`retire` moved into the directory ``d`` and that no mapping pins any more: the bytes
    removed, and those still pinned.
    """
    freed = pinned = 0
    for name in d.names():
        try:
            size, removed = _remove_unpinned(d, name)
        except OSError:
            continue
        freed, pinned = (freed + size, pinned) if removed else (freed, pinned + size)
    return freed, pinned


def _remove_unpinned(at: Any, name: str) -> tuple[int, bool]:
    """The size of the file ``name`` of ``at``, and whether it was removed: not while a mapping pins it."""
    fd = at.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until it is gone: no mapping is pooled meanwhile
        except BlockingIOError:
            return size, False
        at.unlink(name)
        return size, True
    finally:
        os.close(fd)
