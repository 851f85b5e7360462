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
What the memory limit of this process's cgroup leaves, for a store on a memory-backed file system.

On ``tmpfs`` (``/dev/shm``, or a memory-backed ``emptyDir``) a store's pages count against the memory limit of the
process's cgroup, which the file system's free space does not show: a pod with ``--ipc=host`` could be killed for
memory while the store saw room. There the room is also what the cgroup's limit leaves (the least of the process's
cgroup and its ancestors: v2 ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes`` less
``memory.usage_in_bytes``), and the reserve is kept below that limit too.
"""

from __future__ import annotations

import os

MEMORY_FS = ("tmpfs", "ramfs")  # file systems whose pages are memory of the processes' cgroups
PROC_CGROUP, CGROUP_FS, MOUNTINFO = "/proc/self/cgroup", "/sys/fs/cgroup", "/proc/self/mountinfo"


def fs_type(path: str) -> str | None:
    """The type of the file system that holds ``path``, read from ``/proc/self/mountinfo``; ``None`` without it."""
    try:
        with open(MOUNTINFO) as f:
            mounts = [line.split(" - ", 1) for line in f.read().splitlines() if " - " in line]
    except OSError:  # not Linux
        return None
    real, best, kind = os.path.realpath(path), "", None
    for left, right in mounts:
        fields = left.split()
        point = fields[4].replace("\\040", " ") if len(fields) > 4 else ""
        if point and (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, right.split()[0] if right.split() else None
    return kind


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < 2**60 else None  # not "max", nor v1's "unlimited" (~2**63)


def _reclaimable(where: str, name: str) -> int:
    """The page cache of files that the kernel reclaims first (``name`` of ``memory.stat``), as kubelet subtracts."""
    try:
        with open(os.path.join(where, "memory.stat")) as f:
            found = [line.split()[1] for line in f if line.startswith(name + " ") and len(line.split()) == 2]
    except OSError:
        return 0
    return int(found[0]) if found and found[0].isdigit() else 0


def cgroup_room() -> tuple[int, int] | None:
    """
    The memory limit of this process's cgroup, or of the ancestor that leaves least, and what it leaves, in bytes;
    ``None`` without a limit, or off Linux. What it leaves counts as free the inactive page cache of files (input
    files read, say), which the kernel reclaims before it would fail the job; tmpfs items are not of that kind.
    """
    try:
        with open(PROC_CGROUP) as f:
            entries = [line.split(":", 2) for line in f.read().splitlines() if line.count(":") >= 2]
    except OSError:
        return None
    best: tuple[int, int] | None = None
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and not controllers:  # v2
            base, names = CGROUP_FS, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base = os.path.join(CGROUP_FS, "memory")
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor
            where = os.path.join(base, *parts[:depth])
            limit, used = _read_int(os.path.join(where, names[0])), _read_int(os.path.join(where, names[1]))
            if limit is not None and used is not None:
                used = max(0, used - _reclaimable(where, names[2]))
                if best is None or limit - used < best[1]:
                    best = limit, max(0, limit - used)
    return best
