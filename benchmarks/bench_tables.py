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
The two tables of the report (per hit and fill; DataLoader epochs and memory), as plain text and as markdown. Path 5b
(the portable store) is in the first table only; its "x floor" is to the floor timed in its own job.
"""

from __future__ import annotations

from typing import Any

from bench_common import ALL_PATHS, HIT_PATHS, MIB, PATHS


def ms(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def tables(summary: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    paths = summary["paths"]
    head1 = [
        "path",
        "hit ms",
        "x floor",
        "1st read ms",
        "1st x floor",
        "store speed-up",
        "deepcopy/hit",
        "faults/hit",
        "compute ms",
        "fill ms",
        "write ms",
        "plain ms",
        "fill ratio",
    ]
    head2 = ["path", "cold epoch s", "warm epoch s", "x floor", "procs", "PSS MiB", "shm MiB", "footprint MiB"]
    head2 += ["net MiB", "x copy", "peak x copy", "samples"]
    rows1, rows2 = [], []
    b = summary.get("baseline")
    if b:
        rows2.append(
            [
                "0. baseline: no cache, one pre-made crop",
                fmt(b["cold_epoch_s"]),
                fmt(b["warm_epoch_s"], ".3f"),
                "",
                str(b["n_processes"]),
                fmt(b["pss_bytes"] / MIB, ".0f"),
                fmt(b["shm_bytes"] / MIB, ".0f"),
                fmt(b["footprint_bytes"] / MIB, ".0f"),
                "(runtime)",
                "",
                "",
                str(b["memory_samples"]),
            ]
        )
    store_hit = paths.get("store", {}).get("hit_s")
    for name, spec in ALL_PATHS.items():
        p = paths.get(name)
        if not p:
            if name in PATHS or name in HIT_PATHS:
                rows1.append([spec["label"], "skipped/error"] + [""] * (len(head1) - 2))
            if name in PATHS:
                rows2.append([spec["label"], "skipped/error"] + [""] * (len(head2) - 2))
            continue
        if "hit_s" in p:
            speed = p["hit_s"] / store_hit if store_hit else None
            rows1.append(
                [
                    spec["label"],
                    ms(p["hit_s"]),
                    fmt(p["hit_x_floor"]),
                    ms(p["first_read_s"]) if "first_read_s" in p else "-",
                    fmt(p["first_read_x_floor"]) if "first_read_s" in p else "-",
                    fmt(speed, ".1f", "x") if name != "store" else "1x",
                    fmt(p["deepcopies_per_hit"], ".0f"),
                    fmt(p["minflt_per_hit"], ".0f"),
                    ms(p["compute_s"]),
                    ms(p["fill_s"]),
                    ms(p["write_s"]),
                    ms(p["plain_write_s"]),
                    fmt(p["fill_ratio"]),
                ]
            )
        else:
            rows1.append([spec["label"], "skipped/error"] + [""] * (len(head1) - 2))
        if "warm_epoch_s" in p:
            rows2.append(
                [
                    spec["label"],
                    fmt(p["cold_epoch_s"]),
                    fmt(p["warm_epoch_s"], ".3f"),
                    fmt(p.get("warm_x_floor")),
                    str(p["n_processes"]),
                    fmt(p["pss_bytes"] / MIB, ".0f"),
                    fmt(p["shm_bytes"] / MIB, ".0f"),
                    fmt(p["footprint_bytes"] / MIB, ".0f"),
                    fmt(p.get("net_bytes", float("nan")) / MIB, ".0f"),
                    fmt(p.get("net_x_copy"), ".3f"),
                    fmt(p.get("net_peak_x_copy"), ".3f"),
                    str(p["memory_samples"]),
                ]
            )
        elif name in PATHS:
            rows2.append([spec["label"], "skipped/error"] + [""] * (len(head2) - 2))
    return head1, rows1, head2, rows2


def plain_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
