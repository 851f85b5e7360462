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
How the processes sharing a :py:class:`monai.data.cache_store.SharedCacheStore` coordinate: who still uses the store.

Each question is whether some process is still alive, and pids cannot answer it across PID namespaces (containers
sharing ``/dev/shm`` see each other's files, not each other's processes). So each fact is an ``fcntl.flock`` lock on
a file of the store, which the kernel releases when its holder dies, in any namespace: a lock that can be taken
means that its holder is gone. Using a store is a shared lock on ``<store>/.lock`` per store object. Locks are held
on descriptors that a forked child closes at once, so a DataLoader worker never keeps or removes a store.
Without ``fcntl`` (Windows) there is no store: :py:data:`AVAILABLE`, the one place that asks, is ``False``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import time
import weakref

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

AVAILABLE = fcntl is not None
ENV_ROOT = "MONAI_CACHE_ROOT"  # where new stores are created, instead of /dev/shm
PREFIX = "monai-cache-"
LOCK_FILE = ".lock"
_PATIENCE = 0.25  # seconds a leaver waits for children forked just before to close their copy of its lock
_POLL_MIN, _POLL_MAX = 0.001, 0.05
_OPEN = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)


class Held:
    """A lock held on a descriptor of this process; a forked child closes its copy, and holds nothing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        _HELD.add(self)
        _close_in_forked_children()

    def close(self) -> bool:
        """Close the descriptor, releasing the lock; ``False`` if this process did not hold it."""
        fd, self.fd = self.fd, -1
        _HELD.discard(self)
        if fd >= 0:
            os.close(fd)
        return fd >= 0


_HELD: weakref.WeakSet[Held] = weakref.WeakSet()
_HOOKED: list = []  # whether the at-fork hook is registered: at the first lock held, never at import


def _close_in_forked_children() -> None:  # in a forked child, the inherited locks are its parent's: closed
    if not _HOOKED and hasattr(os, "register_at_fork"):
        _HOOKED.append(True)
        os.register_at_fork(after_in_child=lambda: [held.close() for held in list(_HELD)])


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _same_file(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not removed or replaced since it was opened)."""
    try:
        st, fst = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    return True


def try_hold(path: str, flags: int = 0, shared: bool = False) -> Held | None:
    """
    Open ``path`` (with ``flags``, such as ``O_CREAT``) and lock it without waiting; ``None`` if someone holds a
    conflicting lock, or (a shared lock) if the file was removed or replaced meanwhile.
    """
    while True:
        held = Held(os.open(path, _OPEN | flags, 0o600))
        try:
            locked = _try_lock(held.fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        except BaseException:  # such as ENOLCK: no descriptor is left open
            held.close()
            raise
        if not locked:
            held.close()
            return None
        if _same_file(held.fd, path):
            return held
        held.close()
        if shared:
            return None  # else its holder removed it between our open and our lock: open it anew


# -- participation ----------------------------------------------------------------------------------------------------


def create(path: str) -> Held:
    """Make the lock file of the new store ``path``, and participate."""
    held = Held(os.open(os.path.join(path, LOCK_FILE), _OPEN | os.O_CREAT | os.O_EXCL, 0o600))
    fcntl.flock(held.fd, fcntl.LOCK_SH)
    return held


def join(path: str) -> Held:
    """
    Participate in the existing store ``path``.

    Raises:
        FileNotFoundError: the store is gone, or being removed (only a remover holds its lock exclusively).
    """
    held = try_hold(os.path.join(path, LOCK_FILE), shared=True)
    if held is None:
        raise FileNotFoundError(errno.ENOENT, "the store is being removed", path)
    return held


def _remove_if_unheld(path: str, patience: float = 0.0) -> bool:
    """Remove the store ``path`` if no one participates, holding its lock meanwhile; whether it was removed."""
    deadline = time.monotonic() + patience
    while True:
        try:
            held = try_hold(os.path.join(path, LOCK_FILE))
        except OSError:
            return False
        if held is not None:
            shutil.rmtree(path, ignore_errors=True)
            held.close()
            return not os.path.lexists(path)
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_MAX / 5)


def leave(path: str, held: Held) -> bool:
    """Stop participating; remove the store if no participant is left."""
    return held.close() and _remove_if_unheld(path, _PATIENCE)


# -- directories ------------------------------------------------------------------------------------------------------


def default_root() -> str:
    """``$MONAI_CACHE_ROOT`` if set, else ``/dev/shm`` if writable, else the system's temporary directory."""
    configured = os.environ.get(ENV_ROOT)
    if configured:
        if not os.path.isdir(configured):
            raise FileNotFoundError(errno.ENOENT, f"{ENV_ROOT}={configured!r} must name an existing directory")
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def check_private(path: str) -> None:
    """Refuse (``PermissionError``) a store directory that another user could have written: its items are unpickled."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"SharedCacheStore: {path!r} does not exist (a store is removed with its last user)", path
        ) from None
    problem = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    elif st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"of mode {oct(stat.S_IMODE(st.st_mode))}, open to other users (it must be 0o700)"
    if problem:
        raise PermissionError(
            f"SharedCacheStore: refusing {path!r}, {problem}: its items are unpickled when read, and unpickling "
            "data written by someone else can run arbitrary code."
        )
