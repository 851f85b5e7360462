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
What keeps a store across runs: ``SharedCacheStore(path, persistent=True)``.

A job ends often (a crash, a pod restarted, a node preempted, every run of a sweep), and a store that goes with its
last user makes every restart compute the whole cache again. A persistent store lives in a directory that the user
names, marked as kept (``_locks.mark_kept``): its last user and the cleaners of leftovers leave it.
Its items outlive the runs, so four things must hold across them:

- **never stale**: an item's file name includes the version of the item format and the MONAI version (see
  :py:func:`version_tag`), besides the content key and the transforms' hash that ``CacheDataset`` gives;
- **never torn**: items are published by an atomic rename after an ``fsync``, so a run killed at any moment, or a
  node that loses power, leaves only whole items and temporary files that the next run removes;
- **bounded**: a *session* is a time during which someone uses the store: its first user (who takes ``.users``
  exclusively) starts one, by touching ``.session``. Reads set the access time of an item, so the items of earlier
  sessions can be evicted least recently used first (:py:func:`evict`), while those of the current session never
  are: epochs read every item in turn, and least-recently-used eviction would drop each one just before its next use;
- **safe**: items are unpickled, so the directory and the store's own files in it must be this user's, closed to
  others, and no symbolic link (:py:func:`check_files`); each item is checked when it is read, and else is a miss.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from typing import Any

from monai_sharedcache import _flock
from monai_sharedcache import _locks as locks
from monai_sharedcache import _memory as memory

SESSION = ".session"  # its modification time is the start of the current session; it marks a persistent store
USERS = ".users"  # held shared by every user of the store, exclusively by the one that starts a session
_EVICT = ".evict"  # held exclusively by the process that evicts
_NETWORK_FS = ("nfs", "nfs4", "lustre", "fuse", "cifs", "smb3", "ceph", "glusterfs", "gpfs", "beegfs", "9p")
_WAIT = 10.0  # seconds to wait for the short exclusive locks of another process


def version_tag() -> str:
    """
    What a persistent store adds to every key: the MONAI version, which the item format goes with (a file of another
    format is a miss anyway, and removed).
    """
    import monai  # imported by the time any store is used

    return f"monai{monai.__version__}"


def prepare(path: str) -> tuple[str, tuple[int, int]]:
    """
    Make ``path`` a persistent store unless it is one: its missing parents and itself made (mode ``0o700``), then
    marked as kept. Its path without links (see :py:func:`resolve`), and the identity of its directory.

    Raises:
        ValueError: ``path`` is on a network file system, is named like a temporary store, or holds something else.
        PermissionError: ``path`` is not a private directory of this user, or goes through a link that another user
            made or could replace.
    """
    check_local(path)  # before anything is made
    if os.path.basename(path).startswith("monai-cache-"):  # the cleaners of temporary stores would remove it
        raise ValueError(
            f"SharedCacheStore: the name of a persistent store must not start with 'monai-cache-', the prefix of "
            f"temporary stores, got {path!r}."
        )
    real, ident = resolve(path)
    try:
        locks.mark_kept(locks.Dir(real))
    except PermissionError as err:
        if err.errno is None:  # the store's refusal of a directory that is not private: it says why
            raise
        raise PermissionError(  # e.g. a directory of mode 0500: the error alone names a file of the store's own
            err.errno,
            f"SharedCacheStore: cannot make a persistent store in {real!r}, which this user cannot write "
            f"({err.strerror}: {err.filename!r}). Give a directory of yours that you can write (mode 0700), or a "
            "missing one, which is made.",
        ) from err
    return real, ident


def resolve(path: str) -> tuple[str, tuple[int, int]]:
    """
    The absolute ``path`` without links, its missing directories made (mode ``0o700``), and the identity of the
    directory it names. It is opened one component at a time from ``/``, never through a link unchecked: a link is
    followed only if this user or root owns it and its directory, and no other user can write that directory (which
    git's ``safe.directory`` also asks of a repository). Else another user could point it at another store of this
    user, whose items the store would then clear or evict.

    Raises:
        PermissionError: a link that another user made or could replace.
        OSError: a component is not a directory, or too many links.
    """
    flags, uid = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0), os.getuid()
    nofollow = flags | getattr(os, "O_NOFOLLOW", 0)
    todo, done, links, fd = path.split("/"), "/", 0, os.open("/", flags)
    try:
        while todo:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                new, done = os.open("..", flags, dir_fd=fd), os.path.dirname(done)
            else:
                try:
                    new = os.open(name, nofollow, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(name, 0o700, dir_fd=fd)
                    except FileExistsError:  # made meanwhile by another process: checked as any other
                        pass
                    new = os.open(name, nofollow, dir_fd=fd)
                    os.fchmod(new, 0o700)  # whatever the umask
                except OSError as err:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if err.errno not in (errno.ELOOP, errno.ENOTDIR) or not stat.S_ISLNK(st.st_mode) or links >= 40:
                        raise
                    _check_link(path, os.path.join(done, name), st, os.fstat(fd), uid)
                    target = os.readlink(name, dir_fd=fd)
                    links, todo = links + 1, target.split("/") + todo
                    if target.startswith("/"):
                        os.close(fd)
                        fd, done = os.open("/", flags), "/"
                    continue
                done = os.path.join(done, name)
            os.close(fd)
            fd = new
        st = os.fstat(fd)
        return done, (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def _check_link(path: str, link: str, st: os.stat_result, where: os.stat_result, uid: int) -> None:
    if st.st_uid not in (uid, 0):
        problem = f"owned by uid {st.st_uid}"
    elif where.st_uid not in (uid, 0) or where.st_mode & 0o022:
        problem = f"in a directory that other users can write (mode {oct(stat.S_IMODE(where.st_mode))})"
    else:
        return
    raise PermissionError(
        f"SharedCacheStore: refusing {path!r}: {link!r} is a symbolic link {problem}, which another user could point "
        "at another of your stores, whose items this store would clear. A link is followed only if you or root own "
        "it, in a directory that no one else can write: give the path without the link."
    )


def check_local(path: str) -> None:
    """
    Refuse a persistent store on a network file system: its sessions rely on ``flock``, which may be local to a node
    or emulated there, so a run on another node could be taken for gone.

    Raises:
        ValueError: ``path`` is on a network file system.
    """
    kind = memory.fs_type(path)
    if kind is not None and kind.split(".")[0] in _NETWORK_FS:
        raise ValueError(
            f"SharedCacheStore: {path!r} is on a network file system ({kind}), where flock may be local to a node or "
            "emulated, and a persistent store relies on flock to tell which runs still use it: keep a persistent "
            "store on a node-local file system (a local disk, /dev/shm)."
        )


def check_files(at: Any, names: tuple[str, ...]) -> None:
    """
    Refuse (``PermissionError``) a persistent store in which a file ``names`` of the store's own, or a file of its own
    directories, is a symbolic link, not this user's, or writable by others. No directory of items is listed.
    """
    for name in names:
        try:
            st = at.stat(name)
        except FileNotFoundError:
            continue
        problem = _problem(st)
        if problem is None and stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW, dir_fd=at.fd)
            try:
                for inner in os.listdir(sub):
                    problem = _problem(os.stat(inner, dir_fd=sub, follow_symlinks=False))
                    if problem is not None:
                        name = os.path.join(name, inner)
                        break
            finally:
                os.close(sub)
        if problem is not None:
            raise PermissionError(
                f"SharedCacheStore: refusing the persistent store {at.path!r}: {name!r} in it is {problem}. Its items "
                "are unpickled when read, and unpickling data written by someone else can run arbitrary code. If you "
                f"trust its content, make it yours and closed to others (chown -R $USER {at.path}; chmod 700 "
                f"{at.path}; chmod -R go-w {at.path}; remove links); else remove the directory or choose another path."
            )


def _problem(st: os.stat_result) -> str | None:
    """What is wrong with a file of status ``st`` in a persistent store, if anything."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        return "neither a regular file nor a directory"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"of mode {oct(stat.S_IMODE(st.st_mode))}, writable by others"
    return None


def join(at: Any) -> tuple[_flock.Held, bool]:
    """
    Use the persistent store ``at``: the lock on ``.users`` held shared, and whether this process starts a session
    (no other process used the store, or the one that started it died before it made ``.session``). The caller
    starts it with :py:func:`start_session` before it calls :py:func:`joined`, which lets the other users in.
    """
    held = _flock.hold(at, USERS)
    if held is not None:
        return held, True
    held = _flock.hold(at, USERS, shared=True, wait=_WAIT)
    if held is None:
        raise OSError(errno.EAGAIN, "another process holds the store's lock exclusively", at.path)
    try:
        at.stat(SESSION)
    except FileNotFoundError:
        return held, True
    return held, False


def joined(held: _flock.Held) -> None:
    """Let the other users in, once the session is started: the exclusive lock becomes a shared one."""
    if not _flock.take(held.fd, shared=True, wait=_WAIT):
        raise OSError(errno.EAGAIN, "another process holds the store's lock exclusively")


def start_session(at: Any) -> int:
    """
    Touch ``.session`` twice, until its second time (the file system's clock, at its granularity) is later than its
    first, and so than that of every item written so far: an item is of an earlier session if and only if it is older
    than ``.session``. No item is looked at: a session starts as fast with many items as with few.
    """
    os.close(at.open(SESSION, os.O_WRONLY | os.O_CREAT))
    os.utime(SESSION, dir_fd=at.fd, follow_symlinks=False)
    latest = at.stat(SESSION).st_mtime_ns
    deadline = time.monotonic() + 2.5  # a file system that keeps whole seconds may need one
    while True:
        os.utime(SESSION, dir_fd=at.fd, follow_symlinks=False)
        start = at.stat(SESSION).st_mtime_ns
        if start > latest or time.monotonic() > deadline:
            return start
        time.sleep(0.001)


def session_start(at: Any) -> int:
    """The start of the current session of the store ``at``."""
    try:
        return at.stat(SESSION).st_mtime_ns
    except OSError:
        return time.time_ns()


def touch(at: Any, name: str, st: os.stat_result, start: int) -> bool:
    """
    Record a use of the item file ``name`` in the session of ``start``: its access time, of the status ``st`` that was
    read before the use (a read may set it too). Whether it was the first use in this session of an earlier item.
    """
    now = time.time_ns()
    if st.st_atime_ns >= start:  # used in this session already: never evicted in it, so no need to write its inode
        return False
    try:
        if at.stat(name).st_ino != st.st_ino:  # replaced meanwhile
            return False
        os.utime(name, ns=(now, st.st_mtime_ns), dir_fd=at.fd, follow_symlinks=False)  # the mtime: when written
    except OSError:
        return False
    return st.st_atime_ns < start and st.st_mtime_ns < start


def items(at: Any) -> list[tuple[int, int, int, str]]:
    """``(atime, mtime, size, name)`` of every item file of the store ``at``."""
    found = []
    try:
        with os.scandir(at.fd) as it:
            for e in it:
                if e.name.endswith(".item"):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_atime_ns, st.st_mtime_ns, st.st_size, e.name))
    except OSError:
        pass
    return found


def evict(at: Any, start: int, excess: Any, remove: Callable[[str], int | None]) -> tuple[int, int] | None:
    """
    Remove the least recently used items of earlier sessions until ``excess(items)`` bytes are freed (``items`` as
    :py:func:`items` lists them), each by ``remove(name)``, which gives the bytes that it freed (``None``: not
    removed); the bytes freed and the items removed, or ``None`` if no item of an earlier session is left (none can
    appear during the session). Items used since ``start`` stay.
    """
    held = _flock.hold(at, _EVICT, wait=_WAIT)
    if held is None:  # another process evicts for as long: let it
        return 0, 0
    try:
        found = items(at)
        old = sorted(i for i in found if i[0] < start)  # least recently used first
        if not old:
            return None
        need, removed, gone = excess(found), 0, 0
        for _, _, _, item in old:
            if removed >= need:
                break
            freed = remove(item)
            if freed is not None:
                removed, gone = removed + freed, gone + 1
        return removed, gone
    finally:
        held.close()
