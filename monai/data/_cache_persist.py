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
What keeps a :py:class:`monai.data.SharedCacheStore` across runs: ``SharedCacheStore(path, persistent=True)``.

A job ends often (a crash, a pod restarted, a node preempted, every run of a sweep), and a store that goes with its
last user makes every restart compute the whole cache again. A persistent store lives in a directory that the user
names, marked by a ``.persistent`` file, which the cleaner of leftovers never removes. Its items outlive the runs, so
four things must hold across them:

- **never stale**: an item's key includes the version of the item format and the MONAI version (see
  :py:func:`version_tag`), besides the content key and the transforms' fingerprint that ``CacheDataset`` gives;
- **never torn**: items are published by an atomic rename after an ``fsync`` (in the store), so a run killed at any
  moment, or a node that loses power, leaves only whole items and temporary files that the next run removes;
- **bounded**: a *session* is a time during which someone uses the store: its first user (who takes ``.lock``
  exclusively) starts one, by touching ``.session``. Reads set the access time of an item, so the items of earlier
  sessions can be evicted least recently used first (:py:func:`evict`), while those of the current session never
  are: epochs read every item in turn, and least-recently-used eviction would drop each one just before its next use;
- **safe**: items are unpickled, so the directory and every file in it must be this user's, closed to others, and no
  symbolic link (:py:func:`check_files`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
import warnings
from typing import Any

from monai.data import _cache_budget as budget
from monai.data import _cache_counters as counters
from monai.data import _cache_format as fmt
from monai.data import _cache_locks as locks

try:
    import fcntl
except ImportError:  # Windows: SharedCacheStore is not available, nothing here is called
    fcntl = None  # type: ignore[assignment]

TMP = ".tmp"  # the store's temporary files
LAYOUT = 1  # the version of the directory's layout, in the marker file
_SESSION = ".session"  # its modification time is the start of the current session
_EVICT = ".evict"  # held exclusively by the process that evicts
_WAIT = 10.0  # seconds to wait for the short exclusive locks of another process
_TOUCH_NS = 1_000_000_000  # an access time is renewed at most once a second


def version_tag() -> str:
    """What a persistent store adds to every key: the item format's version and the MONAI version."""
    import monai  # imported by the time any store is used

    return f"format{fmt.VERSION}-monai{monai.__version__}"


def check_local(path: str) -> None:
    """
    Refuse a persistent store on a network file system. Its sessions and the removal of what killed runs left rely on
    ``flock``, which is local to a node or emulated there: a run on another node could be taken for gone.

    Raises:
        ValueError: ``path`` is on a network file system (see :py:func:`monai.data._cache_locks.network_fs`).
    """
    kind = locks.network_fs(path)
    if kind is not None:
        raise ValueError(
            f"SharedCacheStore: {path!r} is on a network file system ({kind}), where flock may be local to a node or "
            "emulated, and a persistent store relies on flock to tell which runs still use it: keep a persistent "
            "store on a node-local file system (a local disk, /dev/shm)."
        )


def _refuse(path: str, name: str, problem: str) -> PermissionError:
    what = "it" if name == path else f"{name!r} in it"
    return PermissionError(
        f"SharedCacheStore: refusing the persistent store {path!r}: {what} is {problem}. Its items are unpickled when "
        "read, and unpickling data written by someone else can run arbitrary code. If you trust its content, make it "
        f"yours and closed to others (chown -R $USER {path}; chmod 700 {path}; chmod -R go-w {path}; remove links); "
        "else remove the directory or choose another path."
    )


def _write(path: str, text: str) -> None:
    """
    Replace the small file ``path`` by one holding ``text``, mode ``0o600``, on disk whole or not at all. It is written
    in ``.tmp``, held while written, where the cleaner of dead temporary files removes it if its writer is killed.
    """
    store, name = os.path.split(path)
    new = os.path.join(store, TMP, f"{name}-{os.getpid()}-{time.monotonic_ns()}-0")  # ends with the bytes it counts
    held = locks.open_temp(new)
    try:
        os.write(held.fd, text.encode())
        os.fsync(held.fd)
        os.replace(new, path)
    finally:
        held.close()
    _sync_dir(store)


def _sync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not every platform syncs a directory
        pass
    finally:
        os.close(fd)


def write_budget(path: str, reserve: int | None, max_bytes: int | None) -> None:
    """
    Record the budget of the persistent store ``path``: the values given replace the recorded ones, the others stay.
    A new store's reserve is, by default, at least a tenth of its file system: a disk holds checkpoints and logs too.
    """
    record = os.path.join(path, budget.BUDGET_FILE)
    old = budget.Budget.load(path) if os.path.exists(record) else None
    if old is None:
        reserve = budget.env_bytes(budget.ENV_RESERVE) if reserve is None else reserve
        max_bytes = budget.env_bytes(budget.ENV_MAX_BYTES) if max_bytes is None else max_bytes
        if reserve is None:
            st = os.statvfs(path)
            total = st.f_blocks * st.f_frsize
            reserve = max(budget.default_reserve(total), total // 10)
    elif reserve is None and max_bytes is None:
        return
    else:
        reserve = old.reserve if reserve is None else reserve
        max_bytes = old.max_bytes if max_bytes is None else max_bytes
    _write(record, json.dumps({"reserve": reserve, "max_bytes": max_bytes}))


def _problem(st: os.stat_result, others: int) -> str | None:
    """What is wrong with a file of status ``st`` in a persistent store, if anything; ``others``: the mode bits
    that others must not have."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        return "neither a regular file nor a directory"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & others:
        return (
            f"of mode {oct(stat.S_IMODE(st.st_mode))}, " + ("open to" if others == 0o077 else "writable by") + " others"
        )
    return None


def check_files(path: str) -> None:
    """
    Refuse (``PermissionError``) a persistent directory that is a symbolic link, not this user's or open to others,
    or in which a file is a symbolic link, not this user's, or writable by others.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        raise NotADirectoryError(
            errno.ENOTDIR, "SharedCacheStore: the path of a persistent store is not a directory", path
        )
    problem = _problem(st, 0o077)
    if problem:
        raise _refuse(path, path, problem)
    with os.scandir(path) as it:
        entries = [(e.path, e.stat(follow_symlinks=False)) for e in it]
    for sub in [name for name, st in entries if stat.S_ISDIR(st.st_mode)]:  # .tmp and .counters
        try:
            with os.scandir(sub) as it:
                entries += [(e.path, e.stat(follow_symlinks=False)) for e in it]
        except FileNotFoundError:
            pass
    for name, st in entries:
        problem = _problem(st, 0o022)
        if problem:
            raise _refuse(path, name, problem)


def open_dir(path: str) -> None:
    """
    Make the persistent store ``path`` if missing (mode ``0o700``), check it and every file in it, and mark it.

    Raises:
        PermissionError: see :py:func:`check_files`.
        ValueError: ``path`` is a directory that holds other files and no store, or a store of another layout.
    """
    if os.path.basename(path).startswith(locks.PREFIX):  # the cleaners of older versions would remove it
        raise ValueError(
            f"SharedCacheStore: the name of a persistent store must not start with {locks.PREFIX!r}, the prefix of "
            f"temporary stores, got {path!r}."
        )
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    check_files(path)
    os.makedirs(os.path.join(path, TMP), 0o700, exist_ok=True)  # before any record is written: see _write
    marker = os.path.join(path, locks.PERSISTENT)
    try:
        with open(marker) as f:
            layout = json.load(f).get("layout")
    except FileNotFoundError:
        other = sorted(n for n in os.listdir(path) if not n.startswith(".") and not n.endswith(".item"))
        if other:
            raise ValueError(
                f"SharedCacheStore: {path!r} is not empty and holds no persistent store (no {locks.PERSISTENT} file; "
                f"it holds {other[:3]}): give the path of a new or empty directory, or of a persistent store."
            ) from None
        layout = None
    except (ValueError, AttributeError):  # a marker that a crash of the node left empty: items check themselves
        layout = None
    if layout is None:
        _write(marker, json.dumps({"layout": LAYOUT}))
        layout = LAYOUT
    if layout != LAYOUT:
        raise ValueError(
            f"SharedCacheStore: {path!r} is a persistent store of layout {layout!r}, and this version reads layout "
            f"{LAYOUT}: clear it (remove the directory) or choose another path."
        )


def _lock(fd: int, how: int, timeout: float) -> bool:
    """Take ``flock(fd, how)``, polling up to ``timeout`` seconds; whether it was taken."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except (BlockingIOError, PermissionError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def join(path: str, reserve: int | None = None, max_bytes: int | None = None) -> tuple[locks.Held, int]:
    """
    Participate in the persistent store ``path``: the lock held, and the start of the current session (in the file
    system's clock, in ns). The first participant after none starts a session: it records the budget (see
    :py:func:`write_budget`), gives up the counts of the gone processes of the last one, and touches ``.session``.
    A participant that joins a session keeps to the budget recorded, and is told if it asked for another.
    """
    held = locks.Held(os.open(os.path.join(path, locks.LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    try:
        session = os.path.join(path, _SESSION)
        if _lock(held.fd, fcntl.LOCK_EX, 0.0):  # no one else uses the store: a new session
            write_budget(path, reserve, max_bytes)
            slots = os.path.join(path, counters.SLOTS_DIR)
            for name in os.listdir(slots) if os.path.isdir(slots) else []:
                slot = locks.try_hold(os.path.join(slots, name))
                if slot is not None:  # not held by a live process, such as a last DataLoader worker
                    locks.unlink_quiet(os.path.join(slots, name))
                    slot.close()
            _start_session(path)
        else:
            _tell_other_budget(path, reserve, max_bytes)
        if not _lock(held.fd, fcntl.LOCK_SH, _WAIT):
            raise OSError(errno.EAGAIN, "another process holds the store's lock exclusively", path)
        try:
            start = os.stat(session).st_mtime_ns
        except FileNotFoundError:  # its first user was killed before making it
            start = _start_session(path)
    except BaseException:
        held.close()
        raise
    return held, start


def _tell_other_budget(path: str, reserve: int | None, max_bytes: int | None) -> None:
    """Warn if the budget asked for differs from the one that the store's current session keeps to."""
    recorded = budget.Budget.load(path)
    asked = {"reserve": (reserve, recorded.reserve), "max_bytes": (max_bytes, recorded.max_bytes)}
    other = [f"{name}={old} (asked: {new})" for name, (new, old) in asked.items() if new is not None and new != old]
    if other:
        warnings.warn(
            f"SharedCacheStore {path}: another run uses this persistent store, and its budget holds for this run too: "
            f"{', '.join(other)}. A budget given is recorded when a run opens the store that no other run uses.",
            RuntimeWarning,
            stacklevel=4,
        )


def _start_session(path: str) -> int:
    """
    Touch ``.session`` twice, until its second time (the file system's clock, at its granularity) is later than its
    first, and so than that of every item written so far: an item is of an earlier session if and only if it is older
    than ``.session``. No item is looked at: a session starts as fast with many items as with few.
    """
    session = os.path.join(path, _SESSION)
    _write(session, str(os.getpid()))
    latest = os.stat(session).st_mtime_ns
    deadline = time.monotonic() + 2.5  # a file system that keeps whole seconds may need one
    while True:
        os.utime(session, follow_symlinks=False)
        start = os.stat(session, follow_symlinks=False).st_mtime_ns
        if start > latest or time.monotonic() > deadline:
            return start
        time.sleep(0.001)


def session_start(path: str) -> int:
    """The start of the current session of the store ``path`` (for a process that does not participate)."""
    try:
        return os.stat(os.path.join(path, _SESSION)).st_mtime_ns
    except OSError:
        return time.time_ns()


def touch(path: str, st: os.stat_result, start: int) -> bool:
    """
    Record a use of the item file ``path`` in the session of ``start``: its access time, of the status ``st`` that was
    read before the use (a read may set it too). Whether it was the first use in this session of an earlier item.
    """
    now = time.time_ns()
    if st.st_atime_ns >= start and now - st.st_atime_ns <= _TOUCH_NS:  # renewed once a second at most
        return False
    try:
        if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:  # replaced meanwhile
            return False
        os.utime(path, ns=(now, st.st_mtime_ns), follow_symlinks=False)  # the mtime: when written
    except OSError:
        return False
    return st.st_atime_ns < start and st.st_mtime_ns < start


def _items(path: str) -> list[tuple[int, int, int, str]]:
    """``(atime, mtime, size, path)`` of every item file of the store ``path``."""
    found = []
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.name.endswith(".item"):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_atime_ns, st.st_mtime_ns, st.st_size, e.path))
    except OSError:
        pass
    return found


def evict(path: str, start: int, nbytes: int, budget_: Any) -> int | None:
    """
    Remove the least recently used items of earlier sessions until an item of ``nbytes`` fits ``budget_`` (its
    ``max_bytes`` and the reserve on the store's file system); the bytes removed, or ``None`` if no item of an earlier
    session is left (none can appear during the session). Items used since ``start`` stay.
    """
    held = locks.Held(os.open(os.path.join(path, _EVICT), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    try:
        if not _lock(held.fd, fcntl.LOCK_EX, _WAIT):  # another process evicts for as long: let it
            return 0
        items = _items(path)
        old = sorted(i for i in items if i[0] < start)  # least recently used first
        if not old:
            return None
        excess = 0
        if budget_.max_bytes is not None:
            excess = sum(size for _, _, size, _ in items) + nbytes - budget_.max_bytes
        try:
            st = os.statvfs(path)
            free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            reserve = budget.default_reserve(total) if budget_.reserve is None else budget_.reserve
            excess = max(excess, reserve - (free - nbytes))
        except (OSError, AttributeError):
            pass
        removed = gone = 0
        for _, _, size, item in old:
            if removed >= excess:
                break
            try:
                os.unlink(item)
                removed, gone = removed + size, gone + 1
            except OSError:
                pass
        budget_.count(-removed, items=-gone)
        return removed
    finally:
        held.close()
