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
``bench_cache.png``: the store's hit and first-read ratios to the floor in each run of the hits section, with its fast
path and without it (portable), with the 1.5x targets and the kernel's floor of a first read; the per-hit time of
each path; and the memory of the DataLoader epochs, when measured. Every axis starts at zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench_common import ALL_PATHS, MIB, PATHS, TARGETS

_COLORS = {
    n: "tab:green" if n.startswith("store") else "tab:gray" if n.startswith("private") else "tab:red" for n in ALL_PATHS
}


def _runs_panel(ax: Any, summary: dict[str, Any]) -> None:
    series = summary["runs"]["series"]
    styles = {
        "store hit": ("tab:green", "o", "-"),
        "store first read": ("tab:blue", "s", "-"),
        "store-root hit": ("tab:olive", "o", "--"),
        "store-root first read": ("tab:cyan", "s", "--"),
        "store portable hit": ("tab:orange", "o", "-."),
        "store portable first read": ("tab:brown", "s", "-."),
    }
    top = 0.0
    for label, (color, marker, line) in styles.items():
        s = series.get(label)
        if not s:
            continue
        x = list(range(1, len(s["values"]) + 1))
        ax.plot(x, s["values"], color=color, marker=marker, linestyle=line, label=f"{label} (median {s['median']:.2f})")
        top = max(top, *s["values"])
    kernel = series.get("store kernel touch")
    if kernel:  # the least a first read through a fresh mapping can cost: the floor + the kernel's faults
        x = list(range(1, len(kernel["values"]) + 1))
        values = [1 + v for v in kernel["values"]]
        ax.plot(x, values, color="tab:purple", marker="^", linestyle=":", label="floor + kernel (mmap, fault crop)")
        top = max(top, *values)
    hit_t, first_t = TARGETS["hit_vs_floor"], TARGETS["first_read_vs_floor"]
    if hit_t == first_t:
        ax.axhline(hit_t, color="tab:red", linestyle="--", linewidth=1, label=f"{hit_t:g}x targets (hit, first read)")
    else:
        ax.axhline(hit_t, color="tab:green", linestyle="--", linewidth=1, label=f"{hit_t:g}x hit target")
        ax.axhline(first_t, color="tab:blue", linestyle="--", linewidth=1, label=f"{first_t:g}x first-read target")
    ax.axhline(1.0, color="k", linewidth=0.8)
    n = summary["runs"]["n"]
    ax.set_xlim(0.5, n + 0.5)
    ax.set_xticks(range(1, n + 1))
    ax.set_ylim(0, max(top, hit_t, first_t) * 1.15)
    ax.set_xlabel("run of the hits section")
    ax.set_ylabel("ratio to the floor (private no-copy hit)")
    ax.set_title("store hit and first read, per run (portable: MONAI_CACHE_FAST_PATH=0)")
    ax.legend(fontsize=7, loc="best")


def _hits_panel(ax: Any, summary: dict[str, Any], names: list[str]) -> None:
    hits = [summary["paths"][n]["hit_s"] * 1e3 for n in names]
    ax.barh(range(len(names)), hits, color=[_COLORS[n] for n in names])
    ax.set_yticks(range(len(names)), [ALL_PATHS[n]["short"] for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(hits) * 1.25)
    ax.set_xlabel("ms per hit (read + crop + copy)")
    ax.set_title("per-hit time (median)")
    for i, v in enumerate(hits):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)


def _memory_panel(ax: Any, summary: dict[str, Any], mem: list[str]) -> None:
    vals = [summary["paths"][n]["net_bytes"] / MIB for n in mem]
    ax.bar(range(len(mem)), vals, color=[_COLORS[n] for n in mem])
    one = summary["paths"][mem[0]]["one_copy_bytes"] / MIB
    ax.axhline(one, color="k", linestyle="--", linewidth=1, label="one copy of the data")
    ax.axhline(one * TARGETS["pss_ratio"], color="tab:green", linestyle=":", linewidth=1, label="1.15x target")
    ax.set_xticks(range(len(mem)), [PATHS[n]["short"] for n in mem], rotation=20, ha="right")
    ax.set_ylim(0, max(*vals, one * TARGETS["pss_ratio"]) * 1.15)
    ax.set_ylabel("MiB (PSS + shared-memory files - baseline)")
    ax.set_title("main + 2 workers memory, warm epoch (median)")
    ax.legend(fontsize=8)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)


def plot(summary: dict[str, Any], path: Path) -> str | None:
    """Write the figure to ``path``; return why not (``None`` if written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no plot ({err}); pip install matplotlib"
    names = [n for n in ALL_PATHS if "hit_s" in summary["paths"].get(n, {})]
    mem = [n for n in PATHS if "net_bytes" in summary["paths"].get(n, {})]
    panels = [
        p for p, ok in (("runs", bool(summary["runs"]["series"])), ("hits", bool(names)), ("mem", bool(mem))) if ok
    ]
    if not panels:
        return "no plot: nothing measured"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "runs":
            _runs_panel(ax, summary)
        elif panel == "hits":
            _hits_panel(ax, summary, names)
        else:
            _memory_panel(ax, summary, mem)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
