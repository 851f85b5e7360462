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
How the processes sharing a :py:class:`monai.data.SharedCacheStore` coordinate: who still uses the store, who
computes a missing item, whose temporary files are dead, which directories are left over.

Each question is whether some process is still alive, and pids cannot answer it across PID namespaces (containers
sharing ``/dev/shm`` see each other's files, not each other's processes). So each fact is an ``fcntl.flock`` lock on
a file of the store, which the kernel releases when its holder dies, in any namespace: a lock that can be taken
means that its holder is gone. Participation is a shared lock on ``<store>/.lock`` per store object, a claim an
exclusive lock on ``<store>/<stem>.claim``, a write an exclusive lock on its temporary file in ``.tmp/``. Locks are
held on descriptors that a forked child closes at once, so a DataLoader worker never keeps or removes a store.

Without ``fcntl`` (Windows) there is no store: :py:data:`AVAILABLE` is ``False``, the one place that asks.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

AVAILABLE = fcntl is not None
ENV_ROOT = "MONAI_CACHE_ROOT"  # where new stores are created, instead of /dev/shm
PREFIX = "monai-cache-"
_LOCK, _NEW_LOCK = ".lock", ".lock-new"  # a creator holds `.lock-new` before it is renamed: cleaners ignore it
_MIN_AGE = 5.0  # seconds: a store without a lock file, or an unlocked temporary file, younger than this is kept
_JOIN_TIMEOUT = 10.0  # seconds a new participant waits for a remover to finish
_LEAVE_PATIENCE = 0.25  # seconds a leaver waits for children forked just before to drop their copy of the lock
_POLL_MIN, _POLL_MAX = 0.001, 0.05
_OPEN = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)


class Held:
    """A lock held on a descriptor of this process; a forked child closes its copy, and holds nothing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        _HELD.add(self)

    def close(self) -> bool:
        """Close the descriptor, releasing the lock; ``False`` if this process did not hold it."""
        fd, self.fd = self.fd, -1
        _HELD.discard(self)
        if fd < 0:
            return False
        os.close(fd)
        return True


_HELD: weakref.WeakSet[Held] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
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


def _try_lock(fd: int, exclusive: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    return True


def try_hold(path: str, flags: int = 0) -> Held | None:
    """Open ``path`` (created with ``flags``) and hold it exclusively; ``None`` if someone else holds it."""
    while True:
        held = Held(os.open(path, _OPEN | flags, 0o600))
        if not _try_lock(held.fd, exclusive=True):
            held.close()
            return None
        if _same_file(held.fd, path):
            return held
        held.close()  # removed by its holder between our open and our lock: again


# -- participation ----------------------------------------------------------------------------------------------------


def create(path: str) -> Held:
    """Make the lock file of the new store ``path`` and participate: cleaners never see it without a holder."""
    new = os.path.join(path, _NEW_LOCK)
    held = Held(os.open(new, _OPEN | os.O_CREAT | os.O_EXCL, 0o600))
    fcntl.flock(held.fd, fcntl.LOCK_SH)
    os.replace(new, os.path.join(path, _LOCK))
    return held


def join(path: str) -> Held:
    """
    Participate in the existing store ``path``.

    Raises:
        FileNotFoundError: the store is gone, or being removed by its last participant or a cleaner.
    """
    lock, deadline, delay = os.path.join(path, _LOCK), time.monotonic() + _JOIN_TIMEOUT, _POLL_MIN
    while True:
        held = Held(os.open(lock, _OPEN))
        if _try_lock(held.fd, exclusive=False):
            if _same_file(held.fd, lock):
                return held
            held.close()
            raise FileNotFoundError(errno.ENOENT, "the store was removed while joining it", lock)
        held.close()  # a remover holds it exclusively
        if time.monotonic() > deadline:
            raise FileNotFoundError(errno.ENOENT, f"the store was being removed for over {_JOIN_TIMEOUT} s", lock)
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX)


def _remove_if_unheld(path: str, patience: float = 0.0) -> bool:
    """Remove the store ``path`` if no one participates, holding its lock meanwhile; whether it was removed."""
    lock = os.path.join(path, _LOCK)
    try:
        fd = os.open(lock, _OPEN)
    except OSError:
        return False
    try:
        deadline = time.monotonic() + patience
        while not _try_lock(fd, exclusive=True):
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_MAX / 5)
        if not _same_file(fd, lock):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)
    finally:
        os.close(fd)


def leave(path: str, held: Held) -> bool:
    """Stop participating; remove the store if no participant is left. Whether it was removed."""
    return held.close() and _remove_if_unheld(path, _LEAVE_PATIENCE)


def cleanup_leftovers(root: str) -> list[str]:
    """
    Remove the ``monai-cache-*`` directories of this user in ``root`` in which no process participates: at once if
    their lock file can be taken, after a few seconds if they have none (a creator that died before making it).
    """
    removed: list[str] = []
    try:
        with os.scandir(root) as it:
            candidates = [e for e in it if e.name.startswith(PREFIX)]
    except OSError:
        return removed
    for entry in candidates:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if os.path.lexists(os.path.join(entry.path, _LOCK)):
            if _remove_if_unheld(entry.path):
                removed.append(entry.path)
        elif time.time() - st.st_mtime >= _MIN_AGE:
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(entry.path)
    return removed


# -- claims -----------------------------------------------------------------------------------------------------------


class ClaimUnavailable(OSError):
    """A claim file could not be created: the caller computes without claiming."""


def compute_once(
    claim: str,
    lookup: Callable[[], Any],
    compute: Callable[[], Any],
    publish: Callable[[Any], Any],
    timeout: float,
    mine: set[str],
    miss: Any,
) -> tuple[Any, bool]:
    """
    ``lookup()`` unless it returns ``miss``; else the item computed once across processes and threads, by the holder
    of ``claim``, and published. The others poll for the item or the claim (a dead holder's claim goes with it); past
    ``timeout`` seconds they compute it without publishing, and the second value is ``True``. A thread that holds
    ``claim`` already (``mine``: the claims of the thread) computes the item again.

    Raises:
        ClaimUnavailable: the claim file cannot be created.
    """
    if claim in mine:
        return compute(), False
    deadline, delay = time.monotonic() + timeout, _POLL_MIN
    while True:
        try:
            held = try_hold(claim, os.O_CREAT)
        except OSError as err:
            raise ClaimUnavailable(err.errno, str(err)) from err
        if held is not None:
            try:
                mine.add(claim)
                item = lookup()  # published between the caller's miss and this claim?
                if item is miss:
                    item = compute()
                    publish(item)
                return item, False
            finally:
                mine.discard(claim)
                unlink_quiet(claim)  # while holding it: a waiter that opened it sees that it was replaced
                held.close()
        item = lookup()
        if item is not miss:
            return item, False
        if time.monotonic() > deadline:
            return compute(), True
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX)


# -- temporary files --------------------------------------------------------------------------------------------------


def open_temp(path: str) -> Held:
    """Create the temporary file ``path`` and hold it exclusively until it is published or removed."""
    held = Held(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600))
    try:
        fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # cleaners leave files this young alone
    except BaseException:
        held.close()
        unlink_quiet(path)
        raise
    return held


def clean_dead_temps(tmp_dir: str) -> None:
    """Remove the temporary files of writers that died while writing: unlocked, and older than a few seconds."""
    try:
        with os.scandir(tmp_dir) as it:
            entries = [e for e in it if time.time() - e.stat(follow_symlinks=False).st_mtime >= _MIN_AGE]
    except OSError:
        return
    for entry in entries:
        try:
            held = try_hold(entry.path)
        except OSError:
            continue
        if held is not None:
            unlink_quiet(entry.path)
            held.close()


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
    """
    Refuse a store directory that another user could have written to: its items are unpickled when read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        PermissionError: ``path`` is a symbolic link, not a directory, owned by another user, or open to others.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"SharedCacheStore: {path!r} does not exist (a store is removed when its last participant closes); "
            "create one with SharedCacheStore() and pass its .path to the other processes",
            path,
        ) from None
    why = "its items are unpickled when read, and unpickling data written by someone else can run arbitrary code"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise PermissionError(f"SharedCacheStore: refusing {path!r}, {what}, because {why}.")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"SharedCacheStore: refusing {path!r}, owned by uid {st.st_uid}, not by this user (uid {os.getuid()}), "
            f"because {why}."
        )
    if st.st_mode & 0o077:
        raise PermissionError(
            f"SharedCacheStore: refusing {path!r}, of mode {oct(stat.S_IMODE(st.st_mode))}: it must be private to "
            f"its owner (chmod 700), because {why}."
        )
