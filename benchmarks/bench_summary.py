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
From the raw job results to the summary: medians and ratios per path, the ratios of each run of the hits section
(``--runs``) with their median and spread, the kernel's floor of a first read, and the targets (PASS/FAIL/SKIP).
"""

from __future__ import annotations

from typing import Any

from bench_common import FAST_PATH_ENV, PATHS, PORTABLE, TARGETS, median
from bench_hits import kernel_summary

# the per-run ratios to the floor: (series name, path, key of the path's stats)
SERIES = tuple(
    (f"{prefix} {label}", path, key)
    for path, prefix in (("store", "store"), ("store_root", "store-root"))
    for label, key in (
        ("hit", "hit_x_floor"),
        ("first read", "first_read_x_floor"),
        ("kernel touch", "kernel_touch_x_floor"),
    )
) + (
    ("store portable hit", PORTABLE, "hit_x_floor"),
    ("store portable first read", PORTABLE, "first_read_x_floor"),
)


def _runs_of(raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    runs = [raw.get(key, {}), *raw.get(f"{key}_extra_runs", [])]
    return [r for r in runs if isinstance(r, dict) and "paths" in r]


def fork_runs(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The results of the ``micro_fork`` runs (``--runs``, the store with its fast path) that did not fail."""
    return _runs_of(raw, "micro_fork")


def portable_runs(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The results of the ``micro_portable`` runs (the store without its fast path) that did not fail."""
    return _runs_of(raw, "micro_portable")


def hit_runs(raw: dict[str, Any]) -> list[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """The (full stack, portable) results of each run of the hits section, paired by run number."""
    full = {r.get("run") or i + 1: r for i, r in enumerate(fork_runs(raw))}
    portable = {r.get("run") or i + 1: r for i, r in enumerate(portable_runs(raw))}
    return [(full.get(n), portable.get(n)) for n in sorted(set(full) | set(portable))]


def _path_stats(p: dict[str, Any]) -> dict[str, Any]:
    """Medians of the raw timings of one path in one job."""
    out = {
        "hit_s": median(p["hit_s"]),
        "hit_min_s": min(p["hit_s"]),
        "fill_s": median(p["fill_s"]),
        "write_s": median(p["write_s"]),
        "plain_write_s": median(p["plain_write_s"]),
        "minflt_per_hit": p["minflt_per_hit"],
        "deepcopies_per_hit": p["deepcopies_per_hit"],
        "compute_s": median(p["compute_s"]),
    }
    out["fill_ratio"] = out["write_s"] / out["plain_write_s"]
    if "first_read_s" in p:
        out["first_read_s"] = median(p["first_read_s"])
        out["first_read_x_floor"] = median(p["first_read_s"]) / median(p["first_read_floor_s"])
        out["first_read_minflt"] = p["first_read_minflt"]
    return out


def _job_stats(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The stats of each path of one ``micro_fork`` job, with its ratios to the floor and to copy_cache=True of the
    same job."""
    paths = {name: _path_stats(p) for name, p in result["paths"].items()}
    floor = paths.get("private_nocopy", {}).get("hit_s", float("nan"))
    copy = paths.get("private_copy", {}).get("hit_s")
    for name, p in paths.items():
        p["hit_x_floor"] = p["hit_s"] / floor
        p["floor_s"] = floor
        if copy and not name.startswith("private"):
            p["copy_speedup"] = copy / p["hit_s"]  # how much faster than the private list with copy_cache=True
    for name, res in (result.get("kernel_floor") or {}).items():
        k = kernel_summary(res)
        if name in paths:
            paths[name].update({f"kernel_{key}": value for key, value in k.items()})
    return paths


def _run_stats(full: dict[str, Any] | None, portable: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """
    The stats of one run of the hits section: the paths of its full-stack job, and path 5b from its portable job,
    whose ratios are to the floor and to copy_cache=True timed in that job (its floor and copy paths are left out).
    """
    paths = _job_stats(full) if full else {}
    if portable:
        own = _job_stats(portable)
        if PORTABLE in own:
            paths[PORTABLE] = own[PORTABLE]
            if "private_nocopy" in paths:  # the two jobs' floors, as a check of the machine's load between them
                paths[PORTABLE]["floor_vs_full_job_floor"] = own[PORTABLE]["floor_s"] / paths["private_nocopy"]["hit_s"]
    return paths


def _merge(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per path and key, the median over the runs of the numbers (the other values of the first run)."""
    merged: dict[str, dict[str, Any]] = {}
    for stats in runs:
        for name, p in stats.items():
            for key, value in p.items():
                merged.setdefault(name, {}).setdefault(key, []).append(value)
    out: dict[str, dict[str, Any]] = {}
    for name, p in merged.items():
        out[name] = {}
        for key, values in p.items():
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
            out[name][key] = median(numbers) if numbers else values[0]
    return out


def spread(values: list[float]) -> dict[str, Any]:
    return {"values": values, "median": median(values), "min": min(values), "max": max(values)}


def _runs_summary(per_run: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    series: dict[str, Any] = {}
    for label, path, key in SERIES:
        values = [run[path][key] for run in per_run if run.get(path, {}).get(key) is not None]
        if values:
            series[label] = spread(values)
    return {"n": len(per_run), "series": series}


def _epochs(raw: dict[str, Any], paths: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Memory: the median (and the peak) of the samples of the warm epoch; net = footprint less the baseline's."""
    base = raw.get("epoch_baseline", {})
    runtime: dict[str, int] = {}
    summary_base: dict[str, Any] = {}
    if "memory_median" in base:  # the runtime: the baseline's footprint less its one pre-made item
        runtime = {s: base[f"memory_{s}"]["footprint_bytes"] - base["one_copy_bytes"] for s in ("median", "peak")}
        mid = base["memory_median"]
        summary_base = {
            "cold_epoch_s": base["cold_epoch_s"],
            "warm_epoch_s": median(base["warm_epoch_s"]),
            "n_processes": mid["n_processes"],
            "pss_bytes": mid["pss_bytes"],
            "shm_bytes": mid["shm_bytes"],
            "footprint_bytes": mid["footprint_bytes"],
            "runtime_bytes": runtime["median"],
            "memory_samples": base["memory_valid_samples"],
        }
    for name in PATHS:
        ep = raw.get(f"epoch_{name}")
        if not ep or "error" in ep:
            continue
        p = paths.setdefault(name, {})
        mid = ep["memory_median"]
        p["cold_epoch_s"] = ep["cold_epoch_s"]
        p["warm_epoch_s"] = median(ep["warm_epoch_s"])
        for key in ("n_processes", "pss_bytes", "shm_bytes", "footprint_bytes"):
            p[key] = mid[key]
        p["one_copy_bytes"] = ep["one_copy_bytes"]
        p["memory_samples"] = ep["memory_valid_samples"]
        if runtime:
            p["net_bytes"] = mid["footprint_bytes"] - runtime["median"]
            p["net_x_copy"] = p["net_bytes"] / ep["one_copy_bytes"]
            p["net_peak_bytes"] = ep["memory_peak"]["footprint_bytes"] - runtime["peak"]
            p["net_peak_x_copy"] = p["net_peak_bytes"] / ep["one_copy_bytes"]
    for p in paths.values():
        if "warm_epoch_s" in p and "warm_epoch_s" in paths.get("private_nocopy", {}):
            p["warm_x_floor"] = p["warm_epoch_s"] / paths["private_nocopy"]["warm_epoch_s"]
    return summary_base


def summarize(raw: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios, the runs' spread and the targets from the raw job results."""
    runs = [*fork_runs(raw), *portable_runs(raw)]
    per_run = [_run_stats(full, portable) for full, portable in hit_runs(raw)]
    paths = _merge(per_run)
    item_nbytes = next((r.get("item_nbytes") for r in runs if r.get("item_nbytes")), None)
    floor = paths.get("private_nocopy", {}).get("hit_s", float("nan"))
    for name, p in raw.get("micro_upstream", {}).get("paths", {}).items():
        paths[name] = _path_stats(p)
        paths[name]["hit_x_floor"] = paths[name]["hit_s"] / floor
    summary_base = _epochs(raw, paths)
    summary = {"paths": paths, "baseline": summary_base, "item_nbytes": item_nbytes}
    summary["runs"] = _runs_summary(per_run)
    summary["checks"] = checks(summary, raw, cfg)
    return summary


def checks(summary: dict[str, Any], raw: dict[str, Any], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, as PASS/FAIL (SKIP when what they need was not run)."""
    paths = summary["paths"]
    series = summary["runs"]["series"]
    n_runs = summary["runs"]["n"]
    out: list[dict[str, Any]] = []

    def ratio(a: str, b: str) -> float | None:
        if a in paths and b in paths and "hit_s" in paths[a] and "hit_s" in paths[b]:
            return float(paths[a]["hit_s"] / paths[b]["hit_s"])
        return None

    def check(name: str, desc: str, value: float | None, at_most: bool, unit: str = "x") -> None:
        limit = TARGETS[name]
        if value is None or value != value:
            status = "SKIP"
        else:
            status = "PASS" if (value <= limit if at_most else value >= limit) else "FAIL"
        sign = "<=" if at_most else ">="
        shown = "n/a" if value is None or value != value else f"{value:.2f}{unit}"
        out.append({"name": name, "status": status, "value": value, "limit": limit, "text": desc, "shown": shown})
        out[-1]["line"] = f"{status}  {desc}: {shown} ({sign} {limit:g}{unit})"

    def over_runs(label: str) -> tuple[str, float | None]:
        s = series.get(label)
        if not s:
            return "", None
        if n_runs < 2:
            return "", s["median"]
        return f", median of {len(s['values'])} runs ({s['min']:.2f}..{s['max']:.2f})", s["median"]

    def over(name: str, key: str) -> tuple[str, float | None]:
        value = paths.get(name, {}).get(key)
        return (f", median of {n_runs} runs" if n_runs > 1 and value is not None else ""), value

    text, value = over_runs("store hit")
    check("hit_vs_floor", f"store (full stack) hit+crop vs private no-copy floor{text}", value, True)
    text, value = over_runs("store first read")
    check("first_read_vs_floor", f"store (full stack) first read of an item + crop vs floor{text}", value, True)
    text, value = over("store", "copy_speedup")
    check("speedup_vs_copy", f"store (full stack) speed-up vs private copy_cache=True{text}", value, False)
    text, value = over(PORTABLE, "copy_speedup")
    desc = f"portable store ({FAST_PATH_ENV}=0) speed-up vs private copy_cache=True timed in its job{text}"
    check("portable_speedup_vs_copy", desc, value, False)
    desc = "store (full stack) speed-up vs upstream ListProxy numpy items"
    check("speedup_vs_upstream_numpy", desc, ratio("upstream_numpy", "store"), False)
    desc = "store write vs plain os.write of the same bytes"
    check("fill_ratio", desc, paths.get("store", {}).get("fill_ratio"), True)
    desc = "main + 2 workers footprint (net, median of the warm-epoch samples) vs one copy"
    check("pss_ratio", desc, paths.get("store", {}).get("net_x_copy"), True)
    small = raw.get("small", {})
    s = small.get("small", {}) if isinstance(small, dict) else {}
    flat = None
    if s and not s.get("error") and s.get("correct") and not s.get("warnings") and s.get("hit_first_s"):
        flat = s["hit_last_s"] / s["hit_first_s"]
    desc = f"{cfg['n_small']:,} small items, ulimit -n 1024: no error, last/first 1,000 hit time"
    check("small_flat", desc, flat if s else None, True)
    if s and flat is None:
        out[-1]["status"] = "FAIL"
        out[-1]["line"] = "FAIL" + out[-1]["line"][4:] + f" [error: {s.get('error') or s.get('warnings')}]"
    return out
