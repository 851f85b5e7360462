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
Coordination of the processes that share a :py:class:`monai.data.SharedCacheStore`: who participates, who computes
a missing item, whose temporary files are dead, and which directories are left over.

Every decision here is about whether some process is still alive. Recording pids (with start times to tell a
reused pid apart) cannot answer it across PID namespaces: containers or pods sharing ``/dev/shm`` see each other's
files but not each other's processes, so a record of another namespace must count as alive forever, and one stale
record then blocks every later process. Instead, each of these facts is an advisory lock, ``fcntl.flock``, on a
file of the store: the kernel drops a lock when the last descriptor of its holder is closed, including when the
holder dies, in whatever namespace it runs. A lock that can be taken therefore means that its holder is gone.

* Participation: every participating store object holds a shared lock on ``<store>/.lock``; the one that can take
  it exclusively after closing its own is the last, and removes the directory while holding it.
* Claims: the process computing a missing item holds an exclusive lock on ``<store>/<stem>.claim``.
* Temporary files: a writer holds an exclusive lock on its file in ``.tmp/`` until it is published.

Locks are held on descriptors opened with ``O_CLOEXEC``; a forked child closes its copies at once (closing a copy
does not release the parent's lock, but a child that outlived a killed parent would otherwise keep it). Without
``fcntl`` (Windows) nothing can be told, so nothing is removed for others and no claim excludes anyone: items may
be computed more than once, which is safe since publishing is atomic.

Claims:
    :py:meth:`~monai.data.SharedCacheStore.get_or_compute` computes each missing item once across all processes and
    threads: the first one holds an exclusive ``flock`` on a ``<key>.claim`` file while it computes and stores the item,
    the others poll (every 50 ms at most) for the item or for the claim, at most ``claim_timeout`` seconds, then compute
    the item without storing it. The kernel releases the lock of a process that dies, so a crashed or killed owner
    delays the others by about one poll, never ``claim_timeout``, whatever its PID namespace (other containers sharing
    ``/dev/shm``). Threads of one process exclude each other too; a ``compute`` that asks for the key its thread is
    computing computes it again, without storing it.

Lifetime:
    Each participating store object (``participate=True``) holds a shared ``flock`` on the store's ``.lock`` file.
    :py:meth:`~monai.data.SharedCacheStore.close` (called at garbage collection and at exit too) releases it and, if the
    lock can then be taken exclusively, no participant remains: it removes the directory while holding that lock, so no
    one joins meanwhile. A process that dies, even killed, releases its lock with it. Locks work across PID namespaces,
    so DDP ranks, containers and pods sharing ``/dev/shm`` participate alike: a store is never removed while a process
    of any of them participates, and it is removed when the last one leaves. A forked child (a DataLoader worker) drops
    the locks it inherits, so it never keeps the store, nor removes it. Directories of crashed runs are removed by
    :py:meth:`~monai.data.SharedCacheStore.cleanup_leftovers`, which every new store runs on its root: at once if no
    process holds their lock (so a store that nobody participates in, such as one created with ``participate=False``, is
    one), after a few seconds if they have no lock file (a creator died before making it). A process that attaches with
    ``participate=True`` while the last participant removes the store works without cache, as when the directory is gone
    (see the Faults of :py:class:`~monai.data.SharedCacheStore`).
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

from monai.data.cache_budget import ENV_ROOT

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

HAS_LOCKS = fcntl is not None
_PREFIX_DIR = "monai-cache-"
_LOCK_FILE = ".lock"
_NEW_LOCK_FILE = ".lock-new"  # the creator's lock file before it holds it (cleaners ignore it)
# a store directory without a lock file is a leftover only if it has not been modified for this long
_LEFTOVER_MIN_AGE = 5.0
_ATTACH_TIMEOUT = 10.0  # how long a new participant tries to share a lock that a remover holds
_POLL_MIN, _POLL_MAX = 0.001, 0.05
# how long a leaving participant tries to remove the store: a child forked just before still holds a copy of the
# lock until it runs its fork hook (within milliseconds); a real participant holds it for longer, and then it stays
_LEAVE_PATIENCE = 0.25
_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)


class Held:
    """A lock held on a descriptor of this process; a forked child closes its copy and holds nothing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        _HELD.add(self)

    def close(self) -> bool:
        """Close the descriptor, releasing the lock; ``False`` if this process does not hold it (forked child)."""
        fd, self.fd = self.fd, -1
        _HELD.discard(self)
        if fd < 0:
            return False
        try:
            os.close(fd)
        except OSError:
            pass
        return True


_HELD: weakref.WeakSet[Held] = weakref.WeakSet()


def _close_inherited() -> None:
    for held in list(_HELD):
        held.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _same_file(fd: int, path: str) -> bool:
    """Whether the descriptor ``fd`` is still the file at ``path`` (not unlinked or replaced since it was opened)."""
    try:
        st, fst = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _try_lock(fd: int, exclusive: bool) -> bool:
    """Take the lock without waiting; ``False`` if someone else holds a conflicting one."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EWOULDBLOCK (EACCES on some systems)
        return False
    return True


# -- participation ------------------------------------------------------------------------------------------------


def create_participation(path: str) -> Held | None:
    """Make the lock file of the new store ``path`` and hold it shared: cleaners never see it unheld."""
    new = os.path.join(path, _NEW_LOCK_FILE)
    fd = os.open(new, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
    held = Held(fd)
    try:
        if HAS_LOCKS:
            fcntl.flock(fd, fcntl.LOCK_SH)
        os.replace(new, os.path.join(path, _LOCK_FILE))
    except BaseException:
        held.close()
        raise
    if not HAS_LOCKS:
        held.close()
        return None
    return held


def join_participation(path: str) -> Held | None:
    """
    Hold the lock file of the existing store ``path`` shared. ``None`` without ``fcntl``.

    Raises:
        FileNotFoundError: the store is gone (removed by its last participant or as a leftover meanwhile).
    """
    lock = os.path.join(path, _LOCK_FILE)
    if not HAS_LOCKS:
        if not os.path.exists(lock):
            raise FileNotFoundError(errno.ENOENT, "the store has no lock file (being removed)", lock)
        return None
    deadline = time.monotonic() + _ATTACH_TIMEOUT
    delay = _POLL_MIN
    while True:
        held = Held(os.open(lock, _OPEN_FLAGS))  # FileNotFoundError: being removed, or removed
        if _try_lock(held.fd, exclusive=False):
            if _same_file(held.fd, lock):
                return held
            held.close()
            raise FileNotFoundError(errno.ENOENT, "the store was removed while joining it", lock)
        held.close()  # a remover (last participant or cleaner) holds it exclusively
        if time.monotonic() > deadline:
            raise FileNotFoundError(errno.ENOENT, f"the store was being removed for over {_ATTACH_TIMEOUT} s", lock)
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX)


def _remove_if_unheld(path: str, patience: float = 0.0) -> bool:
    """
    Remove the store directory ``path`` if no process holds its lock file; whether it was removed. ``patience``:
    how long to try, for children forked just before, which may not have run their fork hook yet.
    """
    lock = os.path.join(path, _LOCK_FILE)
    try:
        fd = os.open(lock, _OPEN_FLAGS)
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
        shutil.rmtree(path, ignore_errors=True)  # holding it: no one can join meanwhile
        return not os.path.lexists(path)
    finally:
        os.close(fd)


def leave_participation(path: str, held: Held | None) -> bool:
    """Release this object's participation; if no participant remains, remove the store. Whether it was removed."""
    if held is None or not held.close():
        return False  # no locks (never removed for others), or a forked child's inherited copy
    return _remove_if_unheld(path, _LEAVE_PATIENCE)


def cleanup_leftovers(root: str) -> list[str]:
    """
    Remove ``monai-cache-*`` directories of the current user in ``root`` that no process participates in: those
    whose lock file can be locked exclusively, and those without a lock file not modified for a few seconds.
    """
    getuid = getattr(os, "getuid", None)
    removed: list[str] = []
    try:
        with os.scandir(root) as it:
            candidates = [e for e in it if e.name.startswith(_PREFIX_DIR)]
    except OSError:
        return removed
    for entry in candidates:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or (getuid is not None and st.st_uid != getuid()):
            continue
        if os.path.lexists(os.path.join(entry.path, _LOCK_FILE)):
            if HAS_LOCKS and _remove_if_unheld(entry.path):
                removed.append(entry.path)
            continue
        if time.time() - st.st_mtime < _LEFTOVER_MIN_AGE:
            continue  # being created, or its lock file being removed by the last participant
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.path)
    return removed


# -- claims -------------------------------------------------------------------------------------------------------


def try_claim(claim: str) -> Held | None:
    """
    Hold the claim file ``claim`` exclusively, or ``None`` if another process or thread holds it.

    Raises:
        OSError: the claim file cannot be created.
    """
    if not HAS_LOCKS:
        return Held(-1)  # nothing can exclude others: compute (publishing is atomic, so this is only more work)
    while True:
        held = Held(os.open(claim, _OPEN_FLAGS | os.O_CREAT, 0o600))
        try:
            locked = _try_lock(held.fd, exclusive=True)
        except BaseException:
            held.close()
            raise
        if not locked:
            held.close()
            return None
        if _same_file(held.fd, claim):
            return held
        held.close()  # its holder released it (unlinked it) between our open and our lock: try again


class ClaimUnavailable(OSError):
    """A claim file could not be created (the caller computes without claiming)."""


def compute_once(
    claim: str,
    lookup: Callable[[], Any],
    compute: Callable[[], Any],
    publish: Callable[[Any], Any],
    timeout: float,
    mine: set[str],
    miss: Any,
    wait: bool = True,
) -> tuple[Any, bool]:
    """
    The item of ``claim``: ``lookup()`` unless it returns ``miss``; else computed once across processes and threads,
    by the holder of ``claim``, and published with ``publish``. The others poll for the item or the claim (the
    kernel releases the claim of a holder that dies); after ``timeout`` seconds they compute the item without
    publishing it, and the second value returned is ``True``. With ``wait=False`` they do not poll: they return
    ``miss`` at once. A thread that holds ``claim`` already (its ``compute`` asks for the item it is computing;
    ``mine`` is the thread's set of claims) computes it again.

    Raises:
        ClaimUnavailable: the claim file cannot be created.
    """
    if claim in mine:
        return compute(), False
    deadline = time.monotonic() + timeout
    delay = _POLL_MIN
    while True:
        try:
            held = try_claim(claim)
        except OSError as err:
            raise ClaimUnavailable(err.errno, str(err)) from err
        if held is not None:
            try:
                mine.add(claim)
                item = lookup()  # it may have been published between the caller's miss and this claim
                if item is miss:
                    item = compute()
                    publish(item)
                return item, False
            finally:
                mine.discard(claim)
                release_claim(claim, held)
        item = lookup()
        if item is not miss or not wait:
            return item, False
        if time.monotonic() > deadline:
            return compute(), True  # computing it here, without publishing it, cannot deadlock or corrupt anything
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX)


def release_claim(claim: str, held: Held) -> None:
    """Remove the claim file while holding it, then release it; nothing in a forked child."""
    if held.fd >= 0:
        unlink_quiet(claim)
        held.close()


# -- temporary files ----------------------------------------------------------------------------------------------


def open_temp(path: str) -> Held:
    """
    Create the temporary file ``path`` for writing and hold it exclusively, so that no one removes it.

    Between the creation and the lock, a cleaner (:py:func:`clean_dead_temps`, in another process or thread) may
    take the file for a dead writer's: it locks it, then removes it. The file is then made again, once the cleaner
    has removed it.

    Raises:
        OSError: the file cannot be created, or a cleaner holds it for more than a few seconds.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    deadline = time.monotonic() + 5.0
    while True:
        try:
            held = Held(os.open(path, flags, 0o600))
        except FileExistsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_MIN)  # a cleaner holds our first file and is about to remove it
            continue
        if not HAS_LOCKS:
            return held
        try:
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(held.fd, path):
                return held
        except OSError:  # the cleaner holds it now: it removes it next
            pass
        held.close()  # a cleaner took it for a dead writer's between our creation and our lock: make it again


def clean_dead_temps(tmp_dir: str) -> None:
    """Remove the temporary files in ``tmp_dir`` of writers that died while writing (no lock on them)."""
    if not HAS_LOCKS:
        return
    try:
        with os.scandir(tmp_dir) as it:
            entries = list(it)
    except OSError:
        return
    for entry in entries:
        try:
            fd = os.open(entry.path, _OPEN_FLAGS)
        except OSError:
            continue
        try:
            if _try_lock(fd, exclusive=True) and _same_file(fd, entry.path):
                unlink_quiet(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)


# -- directories --------------------------------------------------------------------------------------------------


def default_root() -> str:
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


def check_private_dir(path: str) -> None:
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
