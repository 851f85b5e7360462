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
The machine the benchmark ran on: cores, memory, load, and the kernel's huge-page settings for shared memory
(``uname -r``, ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` and ``hugepages-*/shmem_enabled``, and the
mount options of the store roots from ``/proc/mounts``, e.g. ``huge=`` of ``/dev/shm``). Standard library only.
"""

from __future__ import annotations

import glob
import os
import platform
from collections.abc import Sequence
from typing import Any

_THP = "/sys/kernel/mm/transparent_hugepage"


def machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in load],
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def _selected(path: str) -> str:
    """The bracketed (current) value of a sysfs setting such as ``always [never] ...``; ``n/a`` if unreadable."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return "n/a"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text or "n/a"


def mount_of(path: str) -> dict[str, str]:
    """The entry of ``/proc/mounts`` whose mount point holds ``path`` (the longest match): point, type, options."""
    real = os.path.realpath(path)
    best: dict[str, str] = {}
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return {"path": path, "error": "no /proc/mounts"}
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.get("mount_point", "")):  # the last of equal mounts is the visible one
            best = {"mount_point": point, "fstype": parts[2], "options": parts[3]}
    return {"path": path, **best} if best else {"path": path, "error": "not found in /proc/mounts"}


def hugepage_settings(store_roots: Sequence[str]) -> dict[str, Any]:
    """The kernel's huge-page settings for shared memory and the mounts of ``store_roots``."""
    found = {}
    for path in glob.glob(f"{_THP}/hugepages-*/shmem_enabled"):
        size = os.path.basename(os.path.dirname(path))[len("hugepages-") :]  # e.g. "2048kB"
        found[size] = _selected(path)

    def kib(size: str) -> int:
        digits = "".join(c for c in size if c.isdigit())
        return int(digits) if digits else 0

    sizes = {size: found[size] for size in sorted(found, key=kib)}
    return {
        "kernel": platform.release(),
        "shmem_enabled": _selected(f"{_THP}/shmem_enabled"),
        "per_size_shmem_enabled": sizes,
        "mounts": [mount_of(root) for root in dict.fromkeys(store_roots)],
    }


def hugepage_lines(settings: dict[str, Any]) -> list[str]:
    """The huge-page settings as report lines."""
    lines = [
        f"kernel {settings.get('kernel', 'n/a')}; transparent huge pages for shmem: "
        f"shmem_enabled [{settings.get('shmem_enabled', 'n/a')}]"
    ]
    sizes = settings.get("per_size_shmem_enabled") or {}
    if sizes:
        lines.append("  per size (hugepages-*/shmem_enabled): " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    for m in settings.get("mounts", []):
        if "error" in m:
            lines.append(f"  store root {m['path']}: {m['error']}")
            continue
        options = m["options"].split(",")
        default = "no huge= option" if m["fstype"] == "tmpfs" else "not tmpfs"
        huge = next((o for o in options if o.startswith("huge=")), default)
        lines.append(f"  store root {m['path']}: {m['fstype']} on {m['mount_point']}, {huge} ({m['options']})")
    return lines
