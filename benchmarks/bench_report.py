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
The report: the printed text, ``results.md`` / ``results.json`` (the rows that the PR descriptions read, the two
tables, the runs' spread, the kernel's floor of a first read, the many-items test, the breakdown of a hit, the
huge-page settings, other sections' lines, the targets) and ``bench_cache.png``.

The two tables: per hit and fill, and DataLoader epochs and memory. Path 5b (the portable store) is in the first table
only; its "x floor" is to the floor timed in its own job. The figure: the store's hit and first-read ratios to the
floor in each run of the hits section, with its fast path and without it (portable), with the 1.5x targets and the
kernel's floor of a first read; the per-hit time of each path; and the memory of the DataLoader epochs, when
measured. Every axis starts at zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bench_persistent
import bench_rows
from bench_common import ALL_PATHS, HIT_PATHS, MIB, PATHS, TARGETS, expected_nbytes, fmt, md_table, plain_table
from bench_machine import hugepage_lines
from bench_summary import fork_runs

_COLORS = {
    n: "tab:green" if n.startswith("store") else "tab:gray" if n.startswith("private") else "tab:red" for n in ALL_PATHS
}


def ms(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


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


def small_lines(raw: dict[str, Any]) -> list[str]:
    if "small" not in raw:
        return []
    small = raw["small"]
    if not small or isinstance(small.get("error"), str):
        return [f"small items: job error: {small.get('error', 'not run')}"]
    lines = [f"small-item job: RLIMIT_NOFILE soft limit {small['nofile_limit'][0]}"]
    for key in ("small", "mapped"):
        s = small[key]
        if s.get("error"):
            lines.append(f"  {s['n']:,} x {s['item_bytes'] // 1024} KiB: ERROR {s['error']}")
            continue
        lines.append(
            f"  {s['n']:,} x {s['item_bytes'] // 1024} KiB items: fill {s['fill_s']:.1f} s, "
            f"median hit of the first 1,000 {s['hit_first_s'] * 1e6:.0f} us, of the last 1,000 "
            f"{s['hit_last_s'] * 1e6:.0f} us (ratio {s['hit_last_s'] / s['hit_first_s']:.2f}; in the sequential pass "
            f"{s['seq_hit_first_s'] * 1e6:.0f} -> {s['seq_hit_last_s'] * 1e6:.0f} us, fill "
            f"{s['fill_first_s'] * 1e6:.0f} -> {s['fill_last_s'] * 1e6:.0f} us), all kept alive: "
            f"{s['open_fds_with_items_alive']} "
            f"open fds, values correct: {s['correct']}, warnings: {len(s['warnings'])}"
        )
    return lines


def breakdown_lines(raw: dict[str, Any]) -> list[str]:
    """The breakdown of a hit, in the first run: the floor and the store, with its fast path and without it."""
    b: dict[str, Any] = {}
    for key in ("micro_fork", "micro_portable"):
        result = raw.get(key)
        for path, steps in (result.get("breakdown") or {}).items() if isinstance(result, dict) else ():
            b.setdefault(path, steps)  # the floor of the full-stack job
    if not b:
        return []
    lines = ["hit breakdown (median ms; minor page faults; first run; store_portable: MONAI_CACHE_FAST_PATH=0):"]
    for path, steps in b.items():
        parts = [f"{k} {v * 1e3:.3f}" for k, v in steps.items() if not k.endswith("faults")]
        faults = [f"{k.replace(' faults', '')} {v:.0f}" for k, v in steps.items() if k.endswith("faults")]
        lines.append(f"  {path}: " + ", ".join(parts))
        lines.append(f"  {'':{len(path)}}  faults: " + ", ".join(faults))
    return lines


def runs_lines(summary: dict[str, Any]) -> list[str]:
    """The ratios to the floor of each run of the hits section, with their median and spread."""
    runs = summary.get("runs", {})
    series = runs.get("series") or {}
    if not series:
        return []
    if runs["n"] == 1:
        lines = [
            "hits section: 1 run; ratio to the floor of the same job (the store with its fast path; 'portable': "
            "without it)"
        ]
    else:
        lines = [
            f"hits section: {runs['n']} runs, each in fresh subprocesses (the store with its fast path; without it, "
            "'portable'); ratio to the floor of the same job: "
            "median (min..max): each run"
        ]
    width = max(len(label) for label in series)
    for label, s in series.items():
        if len(s["values"]) == 1:
            lines.append(f"  {label:{width}}  {s['median']:.2f}")
            continue
        each = ", ".join(f"{v:.2f}" for v in s["values"])
        lines.append(f"  {label:{width}}  {s['median']:.2f} ({s['min']:.2f}..{s['max']:.2f}): {each}")
    return lines


def kernel_lines(summary: dict[str, Any]) -> list[str]:
    """The kernel's floor of a first read (medians over the runs), next to the first read."""
    lines: list[str] = []
    for name in ("store", "store_root"):
        p = summary["paths"].get(name, {})
        if not any(k.startswith("kernel_") for k in p):
            continue
        if not lines:
            lines.append(
                "kernel floor of a first read (the store's item file; medians, ratio to the floor timed in between):"
            )
        short = ALL_PATHS[name]["short"]
        if p.get("kernel_error"):
            lines.append(f"  {short}: n/a ({p['kernel_error']})")
            continue
        touch, pages, faults = (p.get(f"kernel_{k}") for k in ("touch_x_floor", "crop_pages", "touch_minflt"))
        touch_text = (
            f"{(p.get('kernel_touch_s') or 0) * 1e3:.2f} ms = {touch:.2f}x floor "
            f"({fmt(pages, ',.0f')} pages of the crop, {fmt(faults, '.0f')} faults)"
            if touch is not None
            else f"n/a ({p.get('kernel_touch_error')})"
        )
        lines.append(f"  {short}: open + mmap + touch the crop's pages + munmap: {touch_text}")
        if touch is not None and "first_read_x_floor" in p:
            lines.append(
                f"  {' ' * len(short)}  first read {p['first_read_x_floor']:.2f}x floor; floor + touch = "
                f"{1 + touch:.2f}x: the least a first read through a fresh mapping can cost"
            )
    return lines


def notes(summary: dict[str, Any], cfg: dict[str, Any], raw: dict[str, Any] | None = None) -> list[str]:
    """Informative ratios that are not targets, and warnings about what was measured."""
    lines = []
    if raw is not None and any(r.get("info", {}).get("fast_path") is False for r in fork_runs(raw)):
        lines.append("WARNING  path 5 ran without the store's fast path (monai_sharedcache._pool.ENABLED is False)")
    p = summary["paths"].get("store_portable", {})
    if p.get("floor_vs_full_job_floor") is not None:
        lines.append(
            f"INFO  path 5b is timed in a job of its own: its floor / the floor of path 5's job = "
            f"{p['floor_vs_full_job_floor']:.2f} (median over the runs; about 1 when the load did not change)"
        )
    if cfg["shape"] != [240, 240, 155]:
        lines.append(
            "NOTE  items smaller than 4x240x240x155: the copies the store avoids are cheap, so the speed-up targets "
            "(calibrated for the full-size item) may fail; judge the targets on a full run"
        )
    p = summary["paths"].get("store_root", {})
    if "first_read_x_floor" in p:
        lines.append(
            f"INFO  {ALL_PATHS['store_root']['short']}: first read of an item in a process (new file, nothing kept "
            f"from earlier reads) vs floor: {p['first_read_x_floor']:.2f}x ({p['first_read_minflt']:.0f} page faults)"
        )
    return lines


def _job_infos(raw: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(raw key, info)`` of every job that reported its ``info`` (the ddp section's result has none)."""
    out = []
    for key, value in raw.items():
        for one in value if isinstance(value, list) else [value]:
            info = one.get("info") if isinstance(one, dict) else None
            if isinstance(info, dict):
                out.append((key, info))
    return out


def header_lines(
    cfg: dict[str, Any], machine: dict[str, Any], raw: dict[str, Any], summary: dict[str, Any], version: str = "n/a"
) -> list[str]:
    """The report's first lines: the item, the loader, the sections; the machine, the versions, the fast path."""
    one_copy = next((p["one_copy_bytes"] for p in summary["paths"].values() if "one_copy_bytes" in p), 0)
    shape = "x".join(str(s) for s in [4, *cfg["shape"]])
    roi = "x".join(str(s) for s in cfg["roi"])
    item_mib = (summary["item_nbytes"] or expected_nbytes(cfg["shape"])) / MIB
    infos = _job_infos(raw)
    # the fork's jobs report whether the store's fast path was on (None: the upstream tree, which has none)
    fork = [(k, i) for k, i in infos if i.get("fast_path") is not None]
    full = [i for k, i in fork if not k.startswith("micro_portable")]
    portable = [i for k, i in fork if k.startswith("micro_portable")]
    upstream = [i for _, i in infos if "fast_path" not in i or i["fast_path"] is None]
    fork_version = full[0]["monai_version"] if full else portable[0]["monai_version"] if portable else version
    upstream_version = upstream[0].get("monai_version", "n/a") if upstream else "n/a"
    sha = (full or portable)[0].get("store_sha256", "n/a") if fork else "n/a"
    fast_text = "not reported" if not full else "on" if all(i["fast_path"] for i in full) else "OFF (not available)"
    off_text = ""
    if portable:
        off = "off" if not any(i["fast_path"] for i in portable) else "ON (MONAI_CACHE_FAST_PATH=0 not honoured)"
        off_text = f", {off} in path 5b's"
    loader = (
        f"2 workers, K={cfg['items']} items, batch 1, one copy = {one_copy / MIB:.0f} MiB" if one_copy else "not run"
    )
    return [
        f"item: image {shape} float32 + label 1x{'x'.join(map(str, cfg['shape']))} uint8 MetaTensors "
        f"({item_mib:.1f} MiB), random crop {roi} + torch.stack copy; {cfg['reps']} timed hits per path; "
        f"DataLoader: {loader}; sections: {','.join(cfg['sections'])}; hits runs: {cfg['runs']}",
        f"machine: {machine['cpus']} cores, {machine['mem_total_gib']} GiB, shared with other jobs "
        f"(load average {machine['loadavg'][0]} at start, {machine['loadavg_end'][0]} at end); "
        f"monai {fork_version} (fork) vs {upstream_version} (upstream); fork store modules sha256 {sha}; "
        f"the store's Linux fast path: {fast_text} in the fork's jobs{off_text}",
    ]


def _measured(rows: list[list[str]]) -> bool:
    return any(len(r) > 1 and r[1] != "skipped/error" for r in rows)


def _sections(
    raw: dict[str, Any], summary: dict[str, Any], extra: dict[str, list[str]]
) -> list[tuple[str, str, list[str]]]:
    """The report's parts: (markdown title, plain-text title, lines); a part without lines is left out."""
    head1, rows1, head2, rows2 = tables(summary)
    return [
        (
            "Per hit and fill",
            "per hit (read + crop + collate copy, median over the runs) and fill (first compute + store of one item)",
            [plain_table(head1, rows1)] if _measured(rows1) else [],
        ),
        ("Runs of the hits section", "", runs_lines(summary)),
        ("Kernel floor of a first read", "", kernel_lines(summary)),
        (
            "DataLoader epochs and memory",
            "DataLoader, 2 workers: epochs (persistent workers); memory of main + children during a warm epoch "
            "(median)",
            [plain_table(head2, rows2)] if _measured(rows2) else [],
        ),
        ("Many small items", "", small_lines(raw)),
        ("Hit breakdown", "", breakdown_lines(raw)),
        *[(title, "", lines) for title, lines in extra.items()],
    ]


def machine_line(machine: dict[str, Any]) -> str:
    """The machine in one line: cores, RAM, kernel."""
    kernel = machine.get("hugepages", {}).get("kernel") or machine.get("platform", "n/a")
    return f"{machine.get('cpus')} cores, {machine.get('mem_total_gib')} GiB RAM, Linux {kernel}"


def _rows_md(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| row | measure | value | target | |", "|---|---|---:|---|---|"]
    for rid, r in rows.items():
        verdict = "" if r["pass"] is None else "pass" if r["pass"] else "**miss**"
        lines.append(f"| `{rid}` | {r['label']} | {r['value']} | {r['target'] or ''} | {verdict} |")
    return lines


def _rows_text(rows: dict[str, dict[str, Any]]) -> list[str]:
    width = max((len(rid) for rid in rows), default=0)
    lines = []
    for rid, r in rows.items():
        verdict = "" if r["pass"] is None else "  PASS" if r["pass"] else "  FAIL"
        target = f" ({r['target']})" if r["target"] else ""
        lines.append(f"  {rid:{width}}  {r['value']}{target}{verdict}  [{r['label']}]")
    return lines


def write(
    out_dir: Path,
    meta: dict[str, str],
    cfg: dict[str, Any],
    machine: dict[str, Any],
    raw: dict[str, Any],
    summary: dict[str, Any],
    extra: dict[str, list[str]],
    elapsed: float,
) -> str:
    """
    Write ``results.md`` and ``results.json`` to ``out_dir``; return the text to print. ``meta``: the run's ``date``
    (ISO 8601, UTC, of its start), ``version`` (the fork's ``monai.__version__``) and ``command``. ``extra``: more
    parts (title: lines), e.g. the ddp section's.

    ``results.json`` is what the PR descriptions read: ``{"date", "version", "command", "machine" (one line),
    "rows" (see ``bench_rows``)}``, and everything else under ``"report"`` (config, machine, summary, raw results).
    """
    command = meta["command"].strip()
    rows = bench_rows.rows(summary, raw, cfg)
    header = header_lines(cfg, machine, raw, summary, meta["version"])
    huge = hugepage_lines(machine.get("hugepages", {}))
    head1, rows1, head2, rows2 = tables(summary)
    parts = _sections(raw, summary, extra)
    target_lines = [f"  {c['line']}" for c in summary["checks"]] + [f"  {x}" for x in notes(summary, cfg, raw)]
    text = [*header, *huge]
    for _, title, lines in parts:
        if lines:
            text += ["", *([title] if title else []), *lines]
    if rows:
        text += ["", f"rows of results.json (run of {meta['date']}, monai {meta['version']}):", *_rows_text(rows)]
    text += ["", "TARGETS (ratios measured in this run):", *target_lines, f"\ntotal time {elapsed:.0f} s"]

    md = ["# CacheDataset runtime cache benchmark", "", f"`{command}`", ""]
    md += [f"- date: {meta['date']}", f"- version: `{meta['version']}`", f"- machine: {machine_line(machine)}", ""]
    if rows:
        md += [*_rows_md(rows), ""]
    md += [*[f"- {h}" for h in header]]
    md += ["", "## Kernel huge pages (shmem)", "", *[f"    {line}" for line in huge]]
    for title, _, lines in parts:
        if not lines:
            continue
        md += ["", f"## {title}", ""]
        if title == "Per hit and fill":
            md.append(md_table(head1, rows1))
        elif title == "DataLoader epochs and memory":
            md.append(md_table(head2, rows2))
        elif title == bench_persistent.TITLE and isinstance(raw.get("persistent"), dict):
            md += bench_persistent.markdown_lines(raw["persistent"])
        else:
            md += [f"    {line}" for line in lines]
    md += ["", "## Targets", "", *[f"- **{c['status']}** {c['line'][6:]}" for c in summary["checks"]]]
    md += [f"- {line}" for line in notes(summary, cfg, raw)]
    md += ["", f"Total time {elapsed:.0f} s.", ""]
    (out_dir / "results.md").write_text("\n".join(md))
    report = {"config": cfg, "machine": machine, "summary": summary, "raw": raw, "elapsed_s": elapsed}
    results = {
        "date": meta["date"],
        "version": meta["version"],
        "command": command,
        "machine": machine_line(machine),
        "rows": rows,
        "report": report,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return "\n".join(text)


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
