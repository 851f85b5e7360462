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
Memory of a tree of processes, read from ``/proc`` (Linux): the one place of the benchmarks that walks ``/proc``.
Standard library only, so that any script can import it.

- :func:`descendants`: all descendant pids of a process (from the ppid field of ``/proc/*/stat``);
- :func:`rollup_kib`: the ``Pss*`` and ``Rss`` fields of ``/proc/<pid>/smaps_rollup``;
- :func:`snapshot` / :func:`tree_snapshot`: PSS, shared-memory bytes and the footprint of a set / tree of processes;
- :class:`PeakSampler`: a thread that samples :func:`tree_snapshot` and keeps the sample of the largest footprint.

The footprint counts what a cache can change: the PSS of anonymous and shared-memory pages
(``Pss_Anon + Pss_Shmem``; the file pages of libraries are left out: they are the same whatever the cache, and their
PSS depends on the unrelated processes of the machine that map the same libraries), where the PSS of the mapped pages
of shared-memory files is replaced by the whole allocated size of every shared-memory file the processes map or hold
open, and of every file under the store directories: such pages exist, mapped or not (a store's files, torch's
shared-memory segments held by a descriptor only), and each counts once.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Union

__all__ = ["descendants", "rollup_kib", "snapshot", "tree_snapshot", "PeakSampler"]

_VMA_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+\s")
_SHM_PREFIXES = ("/dev/shm/", "/memfd:", "/SYSV")

StoreDirs = Union[Sequence[str], Callable[[], Sequence[str]]]


def _ppids() -> dict[int, int]:
    """``{pid: ppid}`` of every process (from ``/proc/*/stat``)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        try:
            fields = data[data.rindex(b")") + 2 :].split()
            out[int(name)] = int(fields[1])
        except (ValueError, IndexError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """All descendant pids of ``pid`` (children, grandchildren...), sorted, from the ppid field of ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for child, parent in _ppids().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = [pid]
    seen = {pid}
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                out.append(child)
                todo.append(child)
    return sorted(out)


def rollup_kib(pid: int) -> dict[str, int]:
    """The ``Pss*`` and ``Rss`` fields (KiB) of ``/proc/<pid>/smaps_rollup``; ``{}`` if the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Pss", "Rss:")):
                    name, value = line.split()[:2]
                    out[name.rstrip(":")] = int(value)
    except (OSError, ValueError):
        return {}
    return out


def _file_key(path: str) -> tuple[tuple[int, int], int] | None:
    """``((st_dev, st_ino), allocated bytes)`` of the file behind ``path`` (e.g. ``/proc/<pid>/fd/<n>``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino), st.st_blocks * 512


def _shm_usage(pid: int, files: dict[tuple[int, int], int]) -> int | None:
    """
    Find the shared-memory files (``/dev/shm``, memfd, SysV) that ``pid`` maps or holds open, adding their allocated
    size to ``files`` (deduplicated by inode); return the PSS (KiB) of their file pages mapped by ``pid``, which the
    caller replaces by the files' whole size so that each page counts once, mapped or not. ``None`` if the process
    has no mappings any more (it is exiting or gone).
    """
    mapped = n_vmas = 0
    current: str | None = None
    vma_range = ""
    pss = anon = 0

    def close_vma() -> None:
        nonlocal mapped
        if current is None:
            return
        mapped += pss - anon
        found = _file_key(f"/proc/{pid}/map_files/{vma_range}")
        if found is not None:
            files[found[0]] = found[1]

    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if _VMA_HEADER.match(line):
                    close_vma()
                    n_vmas += 1
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    current = path if path.startswith(_SHM_PREFIXES) else None
                    vma_range = parts[0]
                    pss = anon = 0
                elif current is not None and line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif current is not None and line.startswith("Anonymous:"):
                    anon = int(line.split()[1])
    except OSError:
        return None
    close_vma()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(_SHM_PREFIXES):
            found = _file_key(f"/proc/{pid}/fd/{fd}")
            if found is not None:
                files[found[0]] = found[1]
    return mapped if n_vmas else None


def snapshot(pids: Sequence[int], store_dirs: Sequence[str] = ()) -> dict[str, Any]:
    """
    Memory of the processes ``pids`` (see the module's docstring).

    Keys: ``pids`` (those read), ``pss_bytes`` (sum of ``Pss``), ``shm_bytes`` (allocated size of the shared-memory
    files these processes map or hold open, plus every file under ``store_dirs``, each counted once),
    ``footprint_bytes`` (``Pss_Anon + Pss_Shmem`` with the PSS of the mapped shared memory replaced by ``shm_bytes``),
    and ``complete`` (False if a process exited while it was read), ``n_processes``, ``pss_anon_shmem_bytes``,
    ``shm_mapped_pss_bytes``, ``per_process_pss_kib``.
    """
    files: dict[tuple[int, int], int] = {}
    pss = anon_shmem = mapped = 0
    per_process: dict[str, dict[str, int]] = {}
    read: list[int] = []
    complete = True
    for pid in pids:
        mapped_kib = _shm_usage(pid, files)  # the mappings first: an exiting process loses them first
        rollup = rollup_kib(pid)
        if mapped_kib is None or "Pss" not in rollup:
            complete = False
            continue
        pss += rollup.get("Pss", 0)
        anon_shmem += rollup.get("Pss_Anon", 0) + rollup.get("Pss_Shmem", 0)
        mapped += mapped_kib
        per_process[str(pid)] = rollup
        read.append(pid)
    for store_dir in store_dirs:
        for root, _, names in os.walk(store_dir):
            for name in names:
                found = _file_key(os.path.join(root, name))
                if found is not None:
                    files[found[0]] = found[1]
    shm = sum(files.values())
    return {
        "pids": read,
        "pss_bytes": pss * 1024,
        "shm_bytes": shm,
        "footprint_bytes": (anon_shmem - mapped) * 1024 + shm,
        "complete": complete,
        "n_processes": len(read),
        "pss_anon_shmem_bytes": anon_shmem * 1024,
        "shm_mapped_pss_bytes": mapped * 1024,
        "per_process_pss_kib": per_process,
    }


def tree_snapshot(root_pid: int, store_dirs: Sequence[str] = ()) -> dict[str, Any]:
    """
    :func:`snapshot` of ``root_pid`` and all its descendants. Taken again (up to 3 times) if the processes changed
    while it was read: a process forked meanwhile (a DataLoader worker starting) would be missed, and its memory with it.
    """
    pids = [root_pid] + descendants(root_pid)
    for _ in range(3):
        snap = snapshot(pids, store_dirs)
        now = [root_pid] + descendants(root_pid)
        if sorted(now) == sorted(pids):
            break
        pids = now
    return snap


class PeakSampler:
    """
    A thread sampling :func:`tree_snapshot` of ``root_pid`` (default: this process) every ``interval`` seconds,
    keeping the sample of the largest ``footprint_bytes``. ``store_dirs`` may be a callable returning the directories
    (called at each sample: a store's directory may appear later). :meth:`stop` (or leaving the ``with`` block, which
    sets ``result``) returns that sample plus ``samples``, the number of samples taken.
    """

    def __init__(self, root_pid: int | None = None, store_dirs: StoreDirs = (), interval: float = 0.2) -> None:
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.store_dirs = store_dirs
        self.interval = interval
        self.result: dict[str, Any] | None = None
        self._best: dict[str, Any] | None = None
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _dirs(self) -> list[str]:
        dirs = self.store_dirs() if callable(self.store_dirs) else self.store_dirs
        return [str(d) for d in (dirs or ()) if d and os.path.isdir(d)]

    def sample(self) -> dict[str, Any]:
        """Take one sample now (and keep it if it is the largest)."""
        snap = tree_snapshot(self.root_pid, self._dirs())
        with self._lock:
            self._count += 1
            if self._best is None or snap["footprint_bytes"] > self._best["footprint_bytes"]:
                self._best = snap
        return snap

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except OSError:
                pass
            if self._stop.wait(self.interval):
                return

    def start(self) -> PeakSampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="PeakSampler", daemon=True)
            self._thread.start()
        return self

    def peak(self) -> dict[str, Any]:
        """The largest sample so far (``{}`` if none yet) plus ``samples``, without stopping."""
        with self._lock:
            return dict(self._best or {}, samples=self._count)

    def stop(self) -> dict[str, Any]:
        """Stop the thread; return the largest sample plus ``samples`` (one sample is taken if none was)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._count == 0:
            self.sample()
        self.result = self.peak()
        return self.result

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
