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
  :py:func:`version_tag`), besides the content key and the transforms' hash that ``CacheDataset`` gives;
- **never torn**: items are published by an atomic rename after an ``fsync`` (in the store), so a run killed at any
  moment, or a node that loses power, leaves only whole items and temporary files that the next run removes;
- **bounded**: a *session* is a time during which someone uses the store: its first user (who takes ``.lock``
  exclusively) starts one, by touching ``.session``. Reads set the access time of an item, so the items of earlier
  sessions can be evicted least recently used first (:py:func:`evict`), while those of the current session never
  are: epochs read every item in turn, and least-recently-used eviction would drop each one just before its next use;
- **safe**: items are unpickled, so the directory and the store's own files in it must be this user's, closed to
  others, and no symbolic link (:py:func:`check_files`); each item is checked when it is read, and else is a miss.
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

TMP = ".tmp"  # the store's temporary files
LAYOUT = 1  # the version of the directory's layout, in the marker file
_SESSION = ".session"  # its modification time is the start of the current session
_EVICT = ".evict"  # held exclusively by the process that evicts
# the files and directories that a persistent store makes besides its items, which check_files checks
_OWN_FILES = (locks.LOCK_FILE, locks.MARK, locks.PERSISTENT, budget.BUDGET_FILE, budget.USED_FILE, _SESSION, _EVICT)
_OWN_DIRS = (TMP, counters.SLOTS_DIR)
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
    what = f"{name!r} in it"
    return PermissionError(
        f"SharedCacheStore: refusing the persistent store {path!r}: {what} is {problem}. Its items are unpickled when "
        "read, and unpickling data written by someone else can run arbitrary code. If you trust its content, make it "
        f"yours and closed to others (chown -R $USER {path}; chmod 700 {path}; chmod -R go-w {path}; remove links); "
        "else remove the directory or choose another path."
    )


def _write(d: locks.Dir, name: str, text: str) -> None:
    """
    Replace the small file ``name`` by one holding ``text``, mode ``0o600``, on disk whole or not at all. It is written
    in ``.tmp``, held while written, where the cleaner of dead temporary files removes it if its writer is killed.
    """
    tmp = locks.Dir(d.path, TMP, d)
    new = f"{name}-{os.getpid()}-{time.monotonic_ns()}-0"  # ends with the bytes it counts: none (see _cache_budget)
    held = locks.open_temp(new, tmp)
    try:
        os.write(held.fd, text.encode())
        os.fsync(held.fd)
        os.replace(new, name, src_dir_fd=tmp.fd, dst_dir_fd=d.fd)
    finally:
        held.close()
    try:
        os.fsync(d.fd)
    except OSError:  # not every platform syncs a directory
        pass


def write_budget(d: locks.Dir, reserve: int | None, max_bytes: int | None) -> None:
    """
    Record the budget of the persistent store ``d``: the values given replace the recorded ones, the others stay.
    A new store's reserve is, by default, at least a tenth of its file system: a disk holds checkpoints and logs too.
    """
    old = budget.Budget.load(d) if _exists(d, budget.BUDGET_FILE) else None
    if old is None:
        reserve = budget.env_bytes(budget.ENV_RESERVE) if reserve is None else reserve
        max_bytes = budget.env_bytes(budget.ENV_MAX_BYTES) if max_bytes is None else max_bytes
        if reserve is None:
            st = os.statvfs(d.fd)
            total = st.f_blocks * st.f_frsize
            reserve = max(budget.default_reserve(total), total // 10)
    elif reserve is None and max_bytes is None:
        return
    else:
        reserve = old.reserve if reserve is None else reserve
        max_bytes = old.max_bytes if max_bytes is None else max_bytes
    _write(d, budget.BUDGET_FILE, json.dumps({"reserve": reserve, "max_bytes": max_bytes}))


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


def _exists(d: locks.Dir, name: str) -> bool:
    try:
        d.stat(name)
        return True
    except FileNotFoundError:
        return False


def check_files(d: locks.Dir) -> None:
    """
    Refuse (``PermissionError``) a persistent store in which a file of the store's own (not an item: each is checked
    when read, and else a miss) is a symbolic link, not this user's, or writable by others (the directory itself was
    checked when it was opened). No directory of items is listed: opening costs the same with any number of items.
    """
    entries = []
    for name in sorted(_OWN_FILES + _OWN_DIRS):
        try:
            entries.append((name, d.stat(name)))
        except FileNotFoundError:
            pass
    for sub in [name for name, st in entries if name in _OWN_DIRS and stat.S_ISDIR(st.st_mode)]:
        try:  # .tmp and .counters: a file per writer or process
            at = locks.Dir(d.path, sub, d)
            entries += [(os.path.join(sub, name), at.stat(name)) for name in at.names()]
        except FileNotFoundError:
            pass
    for name, st in entries:
        problem = _problem(st)
        if problem:
            raise _refuse(d.path, name, problem)


def _make_private(path: str) -> None:
    """Make the directory ``path`` and its missing parents, each of mode ``0o700`` whatever the umask."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        _make_private(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_dir(path: str) -> locks.Dir:
    """
    Open the persistent store ``path``, made if missing (mode ``0o700``, parents included): a directory that the store
    made (it has its mark), or an empty one, which is marked.

    Raises:
        PermissionError: ``path`` is a symbolic link, not this user's or open to others.
        ValueError: ``path`` holds something and no store, or a store of another layout.
    """
    if os.path.basename(path).startswith(locks.PREFIX):  # the cleaners of older versions would remove it
        raise ValueError(
            f"SharedCacheStore: the name of a persistent store must not start with {locks.PREFIX!r}, the prefix of "
            f"temporary stores, got {path!r}."
        )
    _make_private(path)
    d = locks.Dir(path)
    if not _exists(d, locks.MARK):  # a store's directory is never listed: it may hold many items
        names = d.names()
        if not names:  # empty: marked first, so that from now on it is a store's, whatever interrupts the rest
            try:
                os.close(d.open(locks.MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:  # marked by another process meanwhile
                pass
        elif locks.MARK not in names:
            raise ValueError(
                f"SharedCacheStore: {path!r} is not empty and holds no persistent store (it holds {sorted(names)[:3]} "
                f"and no {locks.MARK}, the mark of a store; a persistent store of an older version has none, and is not "
                "reused): give the path of a new or empty directory, or of a persistent store."
            )
    d = locks.Dir(path, mark=True)
    try:
        os.mkdir(TMP, 0o700, dir_fd=d.fd)
    except FileExistsError:
        pass
    if not _exists(d, locks.PERSISTENT):  # a new store, or one whose start was interrupted
        _write(d, locks.PERSISTENT, json.dumps({"layout": LAYOUT}))
    try:
        found = d.read_checked(locks.PERSISTENT)
        layout = json.loads(found[0]).get("layout") if found is not None else None
    except (OSError, ValueError, AttributeError):  # AttributeError: not a JSON object
        layout = None
    if layout != LAYOUT:
        raise ValueError(
            f"SharedCacheStore: {path!r} is a persistent store of layout {layout!r}, and this version reads layout "
            f"{LAYOUT}: clear it (remove the directory) or choose another path."
        )
    return d


def join(d: locks.Dir, reserve: int | None = None, max_bytes: int | None = None) -> tuple[locks.Held, int]:
    """
    Participate in the persistent store ``d``: the lock held, and the start of the current session (in the file
    system's clock, in ns). The first participant after none starts a session: it records the budget (see
    :py:func:`write_budget`), gives up the counts of the gone processes of the last one, and touches ``.session``.
    A participant that joins a session keeps to the budget recorded, and is told if it asked for another.
    """
    held = locks.Held(d.open(locks.LOCK_FILE, os.O_RDWR | os.O_CREAT))
    try:
        if locks.lock(held.fd, True, 0.0):  # no one else uses the store: a new session
            write_budget(d, reserve, max_bytes)
            try:
                slots = locks.Dir(d.path, counters.SLOTS_DIR, d)
            except FileNotFoundError:
                slots = None
            for name in slots.names() if slots is not None else []:
                slot = locks.try_hold(name, at=slots)
                if slot is not None:  # not held by a live process, such as a last DataLoader worker
                    locks.unlink_quiet(name, slots)
                    slot.close()
            _start_session(d)
        else:
            _tell_other_budget(d, reserve, max_bytes)
        if not locks.lock(held.fd, False, _WAIT):
            raise OSError(errno.EAGAIN, "another process holds the store's lock exclusively", d.path)
        try:
            start = d.stat(_SESSION).st_mtime_ns
        except FileNotFoundError:  # its first user was killed before making it
            start = _start_session(d)
    except BaseException:
        held.close()
        raise
    return held, start


def _tell_other_budget(d: locks.Dir, reserve: int | None, max_bytes: int | None) -> None:
    """Warn if the budget asked for differs from the one that the store's current session keeps to."""
    recorded = budget.Budget.load(d)
    asked = {"reserve": (reserve, recorded.reserve), "max_bytes": (max_bytes, recorded.max_bytes)}
    other = [f"{name}={old} (asked: {new})" for name, (new, old) in asked.items() if new is not None and new != old]
    if other:
        warnings.warn(
            f"SharedCacheStore {d.path}: another run uses this persistent store, and its budget holds for this run "
            f"too: {', '.join(other)}. A budget given is recorded when a run opens the store that no other run uses.",
            RuntimeWarning,
            stacklevel=4,
        )


def _start_session(d: locks.Dir) -> int:
    """
    Touch ``.session`` twice, until its second time (the file system's clock, at its granularity) is later than its
    first, and so than that of every item written so far: an item is of an earlier session if and only if it is older
    than ``.session``. No item is looked at: a session starts as fast with many items as with few.
    """
    _write(d, _SESSION, str(os.getpid()))
    latest = d.stat(_SESSION).st_mtime_ns
    deadline = time.monotonic() + 2.5  # a file system that keeps whole seconds may need one
    while True:
        os.utime(_SESSION, dir_fd=d.fd, follow_symlinks=False)
        start = d.stat(_SESSION).st_mtime_ns
        if start > latest or time.monotonic() > deadline:
            return start
        time.sleep(0.001)


def session_start(d: locks.Dir) -> int:
    """The start of the current session of the store ``d`` (for a process that does not participate)."""
    try:
        return d.stat(_SESSION).st_mtime_ns
    except OSError:
        return time.time_ns()


def touch(d: locks.Dir, name: str, st: os.stat_result, start: int) -> bool:
    """
    Record a use of the item file ``name`` in the session of ``start``: its access time, of the status ``st`` that was
    read before the use (a read may set it too). Whether it was the first use in this session of an earlier item.
    """
    now = time.time_ns()
    if st.st_atime_ns >= start and now - st.st_atime_ns <= _TOUCH_NS:  # renewed once a second at most
        return False
    try:
        if d.stat(name).st_ino != st.st_ino:  # replaced meanwhile
            return False
        os.utime(name, ns=(now, st.st_mtime_ns), dir_fd=d.fd, follow_symlinks=False)  # the mtime: when written
    except OSError:
        return False
    return st.st_atime_ns < start and st.st_mtime_ns < start


def _items(d: locks.Dir) -> list[tuple[int, int, int, str]]:
    """``(atime, mtime, size, name)`` of every item file of the store ``d``."""
    found = []
    try:
        with os.scandir(d.fd) as it:
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


def evict(d: locks.Dir, start: int, nbytes: int, budget_: Any) -> int | None:
    """
    Remove the least recently used items of earlier sessions until an item of ``nbytes`` fits ``budget_`` (its
    ``max_bytes`` and the reserve on the store's file system); the bytes removed, or ``None`` if no item of an earlier
    session is left (none can appear during the session). Items used since ``start`` stay.
    """
    held = locks.Held(d.open(_EVICT, os.O_RDWR | os.O_CREAT))
    try:
        if not locks.lock(held.fd, True, _WAIT):  # another process evicts for as long: let it
            return 0
        items = _items(d)
        old = sorted(i for i in items if i[0] < start)  # least recently used first
        if not old:
            return None
        excess = 0
        if budget_.max_bytes is not None:
            excess = sum(size for _, _, size, _ in items) + nbytes - budget_.max_bytes
        try:
            st = os.statvfs(d.fd)
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
                d.unlink(item)
                removed, gone = removed + size, gone + 1
            except OSError:
                pass
        budget_.count(-removed, items=-gone)
        return removed
    finally:
        held.close()
