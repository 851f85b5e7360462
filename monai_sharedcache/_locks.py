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
The directory of a :py:class:`monai_sharedcache.SharedCacheStore` and how its processes coordinate.

Whether a process still uses a store or writes a file cannot be told by pids across PID namespaces (containers that
share ``/dev/shm``), so each is an ``fcntl.flock`` lock, which the kernel releases when its holder dies: using a store
is a shared lock on ``<store>/.lock``, computing an item an exclusive lock on ``<stem>.claim``, writing one on its
temporary file in ``.tmp/``. A forked child closes the locks it inherits, so a DataLoader worker never keeps or removes
a store. Without ``fcntl`` (Windows) :py:data:`AVAILABLE` is ``False``.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
import warnings
import weakref

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

AVAILABLE = fcntl is not None
ENV_ROOT = "MONAI_CACHE_ROOT"
PREFIX = "monai-cache-"
LOCK_FILE, _NEW_LOCK = ".lock", ".lock-new"  # cleaners ignore a store whose creator still holds `.lock-new`
MARK = ".monai-cache"  # in every directory that a store makes: no other directory is joined or removed
KEEP = ".persistent"  # see mark_kept
NETWORK_FS = ("nfs", "nfs4", "lustre", "fuse", "cifs", "smb3", "ceph", "glusterfs", "gpfs", "beegfs", "9p")
_MOUNTINFO = "/proc/self/mountinfo"
_WARNED: set[str] = set()
_MIN_AGE = 5.0  # seconds: younger unlocked files, and stores without a lock file, may be about to be locked
_PATIENCE = 0.25  # seconds a leaver waits for the children it forked just before to close their copy of its lock
_POLL_MAX = 0.05
_TEMP_TRIES = 1000  # 1 ms apart: a cleaner holds a file it removes for microseconds
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN = os.O_RDWR | _NOFOLLOW


class Dir:
    """
    A directory opened once without following a link, and checked: this user's, mode ``0o700`` and, with ``mark``, made
    by a store. Everything after goes through its descriptor, so that renaming or replacing the path redirects nothing.
    """

    def __init__(self, path: str, name: str | None = None, at: Dir | None = None, mark: bool = False) -> None:
        self.path: str = path if at is None else os.path.join(at.path, name or "")
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
        try:
            self.fd: int = os.open(path if at is None else name or "", flags, dir_fd=None if at is None else at.fd)
        except OSError as err:
            if err.errno == errno.ENOTDIR and os.path.isfile(self.path) and not os.path.islink(self.path):
                raise NotADirectoryError(
                    errno.ENOTDIR, f"SharedCacheStore: {self.path!r} is a file, not a store"
                ) from None
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refuse(self.path, "a symbolic link or not a directory") from err
            if err.errno == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, f"SharedCacheStore: {self.path!r} does not exist") from None
            raise
        self._finalizer = weakref.finalize(self, os.close, self.fd)  # closed with its last user: never reused early
        st = self.ident = os.fstat(self.fd)
        if st.st_uid != os.getuid():
            raise _refuse(self.path, f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
        if st.st_mode & 0o077:
            raise _refuse(self.path, f"of mode {oct(stat.S_IMODE(st.st_mode))}, open to other users (not 0o700)")
        if mark:
            try:
                found = self.open_checked_stat(MARK)
            except FileNotFoundError:
                found = None
            if found is None:
                raise _refuse(self.path, f"not a directory that a store made (it has no {MARK} file of this user)")
            os.close(found[0])

    def moved(self) -> bool:
        """Whether ``path`` no longer names this directory."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != (self.ident.st_dev, self.ident.st_ino)

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=self.fd)

    def open_checked_stat(self, name: str) -> tuple[int, os.stat_result] | None:
        """``name`` opened to read, and its status, if a regular file of this user, of one link, closed to writers."""
        try:
            fd = self.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO does not block
        except OSError as err:
            if err.errno == errno.ELOOP:
                return None
            raise
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022 and st.st_nlink == 1:
            return fd, st
        os.close(fd)
        return None

    def stat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def names(self) -> list[str]:
        with os.scandir(self.fd) as it:
            return [e.name for e in it]

    def remove(self) -> None:
        """Remove what this directory holds, following no link, then the directory if it is still at its path."""
        names = self.names()
        for name in names:
            try:
                if name != MARK:
                    self.unlink(name)
            except OSError:  # a directory (EISDIR; EPERM on macOS): emptied too, if it is a private one
                try:
                    Dir(self.path, name, self).remove()
                    os.rmdir(name, dir_fd=self.fd)  # through this directory, even if its path has moved
                except OSError:
                    pass
        try:  # the mark goes last: what a late writer keeps from removal stays a store's, for the next cleaner
            if MARK in names and self.names() == [MARK]:
                self.unlink(MARK)
            if not self.moved():
                os.rmdir(self.path)  # only if empty
        except OSError:
            pass


class Held:
    """A lock held on a descriptor of this process; a forked child closes its copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        _HELD.add(self)
        if not _HOOKED and hasattr(os, "register_at_fork"):  # at the first lock, never at import
            _HOOKED.append(True)
            os.register_at_fork(after_in_child=lambda: [held.close() for held in list(_HELD)])

    def close(self) -> bool:
        """Release the lock; ``False`` if this process did not hold it."""
        fd, self.fd = self.fd, -1
        _HELD.discard(self)
        if fd >= 0:
            os.close(fd)
        return fd >= 0


_HELD: weakref.WeakSet[Held] = weakref.WeakSet()
_HOOKED: list = []


def unlink_quiet(path: str, at: Dir | None = None) -> None:
    try:
        os.unlink(path, dir_fd=None if at is None else at.fd)
    except OSError:
        pass


def try_hold(path: str, flags: int = 0, shared: bool = False, at: Dir | None = None) -> Held | None:
    """
    Open ``path`` (in ``at``, with ``flags``) and lock it without waiting; ``None`` if a conflicting lock is held, or
    (shared) if the file was removed or replaced meanwhile.
    """
    while True:
        held = Held(os.open(path, _OPEN | flags, 0o600, dir_fd=None if at is None else at.fd))
        try:
            fcntl.flock(held.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            st, fst = os.stat(path, dir_fd=None if at is None else at.fd, follow_symlinks=False), os.fstat(held.fd)
            if (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
                return held
        except (BlockingIOError, PermissionError):
            held.close()
            return None
        except FileNotFoundError:
            pass
        except BaseException:
            held.close()
            raise
        held.close()
        if shared:
            return None  # else its holder removed it between our open and our lock: open it anew


def create(d: Dir) -> Held:
    """Mark the new store ``d``, make its lock file and hold it: cleaners never see it without a user."""
    os.close(d.open(MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    held = Held(d.open(_NEW_LOCK, _OPEN | os.O_CREAT | os.O_EXCL))
    try:
        fcntl.flock(held.fd, fcntl.LOCK_SH)
        os.replace(_NEW_LOCK, LOCK_FILE, src_dir_fd=d.fd, dst_dir_fd=d.fd)
    except BaseException:
        held.close()
        raise
    return held


def join(d: Dir) -> Held:
    """Use the store ``d``; ``FileNotFoundError`` if it is being removed (only a remover locks it exclusively)."""
    held = try_hold(LOCK_FILE, shared=True, at=d)
    if held is None:
        raise FileNotFoundError(errno.ENOENT, "the store is being removed", d.path)
    return held


def _remove_if_unheld(d: Dir, patience: float = 0.0, lock: str = LOCK_FILE) -> bool:
    if _exists(d, KEEP):  # never locked exclusively: a process that joins it meanwhile is never refused
        return False
    deadline = time.monotonic() + patience
    while True:
        try:
            held = try_hold(lock, at=d)
        except OSError:
            return False
        if held is not None:
            d.remove()
            held.close()
            return not os.path.lexists(d.path)
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_MAX / 5)


def _exists(d: Dir, name: str) -> bool:
    try:
        d.stat(name)
        return True
    except FileNotFoundError:
        return False


def mark_kept(d: Dir) -> None:
    """
    Make ``d``, empty or such a store already, a store that its last user and the cleaners keep. Its files are made
    before its mark, so that an interrupted call leaves what the next one completes; ``ValueError`` if it holds more.
    """
    if _exists(d, MARK) and _exists(d, KEEP):
        return
    names, made = set(d.names()), {KEEP, LOCK_FILE, ".tmp", MARK}
    if not names <= made or (MARK in names and KEEP not in names):
        if _exists(d, MARK) and _exists(d, KEEP):  # completed by another process meanwhile: it marks it last
            return
        shown = (sorted(names - made) or sorted(names))[:3]
        raise ValueError(
            f"SharedCacheStore: {d.path!r} holds {shown} and no store kept across runs: give the path of an empty "
            "directory, or of such a store."
        )
    for name in (KEEP, LOCK_FILE):
        os.close(d.open(name, os.O_WRONLY | os.O_CREAT))
    try:
        os.mkdir(".tmp", 0o700, dir_fd=d.fd)
    except FileExistsError:
        pass
    os.close(d.open(MARK, os.O_WRONLY | os.O_CREAT))


def leave(d: Dir, held: Held) -> bool:
    """Stop using the store; remove it if no user is left."""
    return held.close() and _remove_if_unheld(d, _PATIENCE)


def fs_type(path: str) -> str | None:
    """The type of the file system that holds ``path``, from ``/proc/self/mountinfo``; ``None`` without it."""
    try:
        with open(_MOUNTINFO) as f:
            mounts = [line.split(" - ", 1) for line in f.read().splitlines() if " - " in line]
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), "", None
    for left, right in mounts:
        fields = left.split()
        point = fields[4].replace("\\040", " ") if len(fields) > 4 else ""
        if point and (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, right.split()[0] if right.split() else None
    return kind


def cleanup_leftovers(root: str) -> list[str]:
    """
    Remove the stores of this user in ``root`` that no process uses: at once if their lock can be taken, after a few
    seconds if they have none (their creator died first). Not on a network file system, where ``flock`` may be local
    to a node: a lock that can be taken does not tell that its holder is gone there.
    """
    kind = fs_type(root)
    if kind is not None and kind.split(".")[0] in NETWORK_FS:
        if root not in _WARNED:
            _WARNED.add(root)
            warnings.warn(
                f"SharedCacheStore: {root!r} is on a network file system ({kind}), where flock may be local to a node, "
                "so the stores that crashed runs leave there are not removed. Put stores on a node-local file system "
                f"(/dev/shm, a local disk: {ENV_ROOT}=/path or root=...).",
                RuntimeWarning,
                stacklevel=3,
            )
        return []
    try:
        with os.scandir(root) as it:
            found = [e.path for e in it if e.name.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for path in found:
        try:
            d = Dir(path, mark=True)
            if _exists(d, KEEP):
                continue
            names = d.names()
            if LOCK_FILE in names:
                done = _remove_if_unheld(d)
            elif done := time.time() - d.ident.st_mtime >= _MIN_AGE:
                if _NEW_LOCK not in names:
                    d.remove()
                else:  # its creator holds it until the store has its lock file, however long it is stopped
                    done = _remove_if_unheld(d, lock=_NEW_LOCK)
        except OSError:  # not a store of this user: left alone
            continue
        if done and not os.path.lexists(path):
            removed.append(path)
    return removed


def open_temp(name: str, tmp: Dir) -> Held:
    """Create the temporary file ``name`` in ``tmp``, locked until it is published or removed."""
    for _ in range(_TEMP_TRIES):
        try:
            held = try_hold(name, os.O_CREAT | os.O_EXCL, at=tmp)
        except FileExistsError:
            held = None
        if held is not None:
            return held
        # a cleaner locked it between our create and our lock, as a dead writer's file: it removes it at once
        time.sleep(0.001)
    raise FileExistsError(errno.EEXIST, "a temporary file of that name is held", name)


def clean_dead_files(d: Dir) -> None:
    """
    Remove the files of ``d`` that no process holds locked: the temporary files and claims of processes that died. A
    file that its maker has created but not yet locked may be removed too: :py:func:`try_hold` then makes it anew.
    """
    try:
        names = d.names()
    except OSError:
        return
    for name in names:
        try:
            held = try_hold(name, at=d)
        except OSError:
            continue
        if held is not None:
            unlink_quiet(name, d)
            held.close()


def default_root() -> str:
    """``$MONAI_CACHE_ROOT`` if set, else ``/dev/shm`` if writable, else the system's temporary directory."""
    configured = os.environ.get(ENV_ROOT)
    if configured:  # checked by making a store there
        return os.path.expanduser(configured)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _refuse(path: str, problem: str) -> PermissionError:
    return PermissionError(
        f"SharedCacheStore: refusing {path!r}, {problem}: its items are unpickled when read, and unpickling data "
        "written by someone else can run arbitrary code. Only a private directory that a store of this user made is "
        "used."
    )
