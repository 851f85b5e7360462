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
The rows of ``results.json`` that the PR descriptions read (``build_backend/monai_sharedcache_build.py``,
``bench_table``; ``docs/pr/series.ini`` names them per PR): a dict from a row id to ``{"label", "value" (formatted,
with its unit), "target" (e.g. ``"<= 1.5x"``, or None), "pass" (True/False, None without a target or a value)}``.
A row whose section was not run is left out; a row of a section that ran but could not be measured says so. The
portable store is path 5b, measured with ``MONAI_CACHE_FAST_PATH=0``; its labels do not name the variable, which
only the fast path's PR adds.
"""

from __future__ import annotations

from typing import Any

from bench_common import PORTABLE, TARGETS

Row = dict[str, Any]

# how the labels name the two stores (PR 02's description shows the portable one, where no fast path exists yet)
FULL_STORE = "store with its Linux fast path (full stack)"
PORTABLE_STORE = "portable store (each read maps the item file afresh)"

_AT_MOST = {"hit_vs_floor", "first_read_vs_floor", "fill_ratio", "pss_ratio", "small_flat"}  # the others: at least
_UNMEASURED = "n/a (not measured: see the report)"


def _target(name: str) -> str:
    return f"{'<=' if name in _AT_MOST else '>='} {TARGETS[name]:g}x"


def _verdict(check: dict[str, Any] | None) -> bool | None:
    status = (check or {}).get("status")
    return True if status == "PASS" else False if status == "FAIL" else None


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return float(value) if ok else None


def _row(label: str, value: str | None, target: str | None = None, check: dict[str, Any] | None = None) -> Row:
    """A row; ``value`` None: not measured (no verdict)."""
    passed = _verdict(check) if value is not None and target is not None else None
    return {"label": label, "value": _UNMEASURED if value is None else value, "target": target, "pass": passed}


def rows(summary: dict[str, Any], raw: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Row]:
    """The rows of the sections that were run (``cfg["sections"]``)."""
    sections = set(cfg.get("sections", []))
    checks = {c["name"]: c for c in summary.get("checks", []) if isinstance(c, dict)}
    out: dict[str, Row] = {}
    if "hits" in sections:
        out.update(_hit_rows(summary, cfg, checks))
    if "epochs" in sections:
        value = _number(summary.get("paths", {}).get("store", {}).get("net_x_copy"))
        out["footprint"] = _row(
            "main + 2 DataLoader workers footprint (net) / one copy of the data, read through the store",
            None if value is None else f"{value:.2f}x one copy",
            _target("pss_ratio"),
            checks.get("pss_ratio"),
        )
    if "small" in sections:
        out["small_items"] = _small_row(raw, cfg, checks.get("small_flat"))
    if "ddp" in sections:
        out.update(_ddp_rows(raw.get("ddp")))
    if "persistent" in sections:
        out.update(_persist_rows(raw.get("persistent")))
    return out


def _hit_rows(summary: dict[str, Any], cfg: dict[str, Any], checks: dict[str, Any]) -> dict[str, Row]:
    paths = summary.get("paths", {})
    series = summary.get("runs", {}).get("series", {})
    n_runs = summary.get("runs", {}).get("n", 0)
    portable, full = PORTABLE_STORE, FULL_STORE
    out: dict[str, Row] = {}

    def over_runs(label: str) -> str | None:
        s = series.get(label)
        if not s:
            return None
        extra = f" (median of {len(s['values'])} runs, {s['min']:.2f}..{s['max']:.2f})" if n_runs > 1 else ""
        return f"{s['median']:.2f}x the floor{extra}"

    def stat(name: str, key: str, fmt: str) -> str | None:
        value = _number(paths.get(name, {}).get(key))
        return None if value is None else fmt.format(value)

    out["hit.full"] = _row(
        f"hit + crop / private no-copy floor, {full}",
        over_runs("store hit"),
        _target("hit_vs_floor"),
        checks.get("hit_vs_floor"),
    )
    out["first_read.full"] = _row(
        f"first read of an item + crop / floor, {full}",
        over_runs("store first read"),
        _target("first_read_vs_floor"),
        checks.get("first_read_vs_floor"),
    )
    out["hit.portable"] = _row(f"hit + crop / private no-copy floor, {portable}", over_runs("store portable hit"))
    out["first_read.portable"] = _row(
        f"first read of an item + crop / floor, {portable}", over_runs("store portable first read")
    )
    out["hit.full_vs_copy"] = _row(
        f"speed-up of the {full} against the private list with copy_cache=True",
        stat("store", "copy_speedup", "{:.1f}x faster"),
        _target("speedup_vs_copy"),
        checks.get("speedup_vs_copy"),
    )
    out["hit.portable_vs_copy"] = _row(
        f"speed-up of the {portable} against the private list with copy_cache=True",
        stat(PORTABLE, "copy_speedup", "{:.1f}x faster"),
        _target("portable_speedup_vs_copy"),
        checks.get("portable_speedup_vs_copy"),
    )
    if not cfg.get("skip_upstream"):
        upstream, store = (_number(paths.get(n, {}).get("hit_s")) for n in ("upstream_numpy", PORTABLE))
        out["hit.portable_vs_listproxy"] = _row(
            f"speed-up of the {portable} against upstream 1.6.1's ListProxy with numpy items",
            f"{upstream / store:.1f}x faster" if upstream is not None and store else None,
        )
    for rid, name, label in (
        ("faults.full", "store", f"minor page faults per hit, {full}"),
        ("faults.portable", PORTABLE, f"minor page faults per hit, {portable}"),
    ):
        value = _number(paths.get(name, {}).get("minflt_per_hit"))
        text = None if value is None else f"{value:,.0f} per hit" if value >= 10 else f"{value:.1f} per hit"
        out[rid] = _row(label, text)
    out["write"] = _row(
        "store write of an item / a plain os.write of the same bytes",
        stat("store", "fill_ratio", "{:.2f}x"),
        _target("fill_ratio"),
        checks.get("fill_ratio"),
    )
    return out


def _small_row(raw: dict[str, Any], cfg: dict[str, Any], check: dict[str, Any] | None) -> Row:
    small: dict[str, Any] = raw["small"] if isinstance(raw.get("small"), dict) else {}
    s: dict[str, Any] = small["small"] if isinstance(small.get("small"), dict) else {}
    label = f"{int(cfg.get('n_small', 20000)):,} x 1 KiB items: hit time of the last 1,000 / the first 1,000"
    if not (s.get("hit_first_s") and s.get("hit_last_s")) or s.get("error"):
        why = str(s.get("error") or small.get("error") or "not measured").strip().splitlines()
        return _row(label, f"n/a ({why[-1][:160] if why else ''})", _target("small_flat"), check)
    soft = (small.get("nofile_limit") or [None])[0]
    value = f"{s['hit_last_s'] / s['hit_first_s']:.2f}x (ulimit -n {soft}, "
    value += f"{s.get('open_fds_with_items_alive')} open fds with all items alive, "
    value += "values correct)" if s.get("correct") else "WRONG values)"
    return _row(label, value, _target("small_flat"), check)


def _ddp_rows(ddp: Any) -> dict[str, Row]:
    """The lazy shared store against upstream's eager cache per rank (no target), and the ddp section's targets."""
    ddp = ddp if isinstance(ddp, dict) else {}
    variants, items = ddp.get("variants", {}), ddp.get("config", {}).get("items")
    checks = {c["name"]: c for c in ddp.get("checks", []) if isinstance(c, dict)}
    eager, lazy = variants.get("upstream_eager", {}), variants.get("shared_lazy", {})
    computed = first = foot = None
    if eager and lazy and "error" not in eager and "error" not in lazy:
        computed = f"{lazy['computations']} for {items} items"
        computed += ", once per node" if lazy["computations"] == items else ""
        computed += f" (upstream eager per rank: {eager['computations']})"
        first = f"{lazy['first_batch_s'] / eager['first_batch_s']:.2f}x"
        foot = f"{lazy['peak']['footprint_bytes'] / eager['peak']['footprint_bytes']:.2f}x"
    out = {
        "ddp.computed": _row("DDP: computations of the cached transforms, lazy shared store, all ranks", computed),
        "ddp.first_batch": _row("DDP: time to first batch, lazy shared store / upstream eager per rank", first),
        "ddp.footprint": _row("DDP: peak footprint, lazy shared store / upstream eager per rank", foot),
    }
    for rid, name, label in (
        (
            "ddp.fill_first_batch",
            "ttfb_ratio",
            "DDP: time to first batch, shared store + fill() / upstream eager per rank",
        ),
        (
            "ddp.fill_footprint",
            "footprint_ratio",
            "DDP: peak footprint, shared store + fill() / upstream eager per rank",
        ),
    ):
        check = checks.get(name, {})
        value, limit = _number(check.get("value")), _number(check.get("limit"))
        target = f"<= {limit:g}x" if limit is not None else None
        out[rid] = _row(label, None if value is None else f"{value:.2f}x", target, check)
    return out


def _persist_rows(result: Any) -> dict[str, Row]:
    """The persistent section (``bench_persistent.py``): restart, reads, fill and the dataset over the budget."""
    result = result if isinstance(result, dict) else {}
    summary = result.get("summary", {})
    c = summary.get("contenders", {})
    disk, pd, lmdb, shm = (c.get(k, {}) for k in ("store_disk", "persistentdataset", "lmdb", "store_shm"))
    checks = {k["name"]: k for k in result.get("checks", []) if isinstance(k, dict)}
    n = result.get("config", {}).get("n")
    store = "persistent store on the local disk"

    def others(key: str, fmt: str) -> str:
        parts = []
        for name, label in (("persistentdataset", "PersistentDataset"), ("lmdb", "LMDBDataset"), ("store_shm", "shm")):
            value = c.get(name, {}).get(key)
            parts.append(f"{label} {'n/a' if value is None else fmt.format(value)}")
        return "; ".join(parts)

    computed = first = read_pd = read_lmdb = fill = over = None
    if disk.get("restart_computed") is not None:
        computed = f"{disk['restart_computed']} for {n} items ({others('restart_computed', '{}')})"
    if disk.get("restart_ratio") is not None:
        first = (
            f"{disk['restart_ratio']:.3f}x ({disk['restart_first_batch_s'] * 1e3:.0f} ms vs "
            f"{disk['first_batch_s'] * 1e3:.0f} ms; {others('restart_ratio', '{:.3f}x')})"
        )
    if disk.get("read_s") and pd.get("read_s"):
        read_pd = (
            f"{pd['read_s'] / disk['read_s']:.1f}x faster ({disk['read_s'] * 1e3:.2f} vs {pd['read_s'] * 1e3:.1f} ms)"
        )
    if disk.get("read_s") and lmdb.get("read_s"):
        read_lmdb = f"{lmdb['read_s'] / disk['read_s']:.1f}x faster ({disk['read_s'] * 1e3:.2f} vs {lmdb['read_s'] * 1e3:.1f} ms)"
    if disk.get("fill_s") and pd.get("fill_s"):
        fill = f"{disk['fill_s'] / pd['fill_s']:.2f}x ({disk['fill_s']:.2f} s vs {pd['fill_s']:.2f} s for {n} items)"
    budget = summary.get("budget", {})
    b_disk, b_shm = budget.get("store_disk", {}), budget.get("budget_shm", {})
    if b_disk.get("epochs") and b_shm.get("epochs"):

        def per_epoch(b: dict[str, Any]) -> str:
            return "/".join(str(e["computed"]) for e in b["epochs"])

        def secs(b: dict[str, Any]) -> str:
            return "/".join(f"{e['s']:.2f}" for e in b["epochs"])

        over = (
            f"{per_epoch(b_disk)} vs {per_epoch(b_shm)} per epoch for {n} items "
            f"(epochs {secs(b_disk)} s vs {secs(b_shm)} s)"
        )
    out = {}
    for rid, name, label, value in (
        ("persist.restart_computed", "restart_computed", f"{store}: computations on restart (a new process)", computed),
        (
            "persist.restart_first_batch",
            "restart_first_batch",
            f"{store}: restart time to first batch / the first run's",
            first,
        ),
        (
            "persist.read_vs_persistentdataset",
            "read_vs_persistentdataset",
            f"{store}: warm read + crop + copy, speed-up vs PersistentDataset",
            read_pd,
        ),
    ):
        check = checks.get(name, {})
        limit = _number(check.get("limit"))
        target = None
        if limit is not None:
            target = "== 0" if name == "restart_computed" else f"{'<=' if name == 'restart_first_batch' else '>='} "
            target += "" if name == "restart_computed" else f"{limit:g}x"
        out[rid] = _row(label, value, target, check)
    out["persist.read_vs_lmdb"] = _row(f"{store}: warm read + crop + copy, speed-up vs LMDBDataset", read_lmdb)
    out["persist.read_vs_floor"] = _row(
        f"{store}: warm read + crop + copy / private no-copy floor",
        None if disk.get("read_x_floor") is None else f"{disk['read_x_floor']:.2f}x the floor",
    )
    out["persist.fill"] = _row(f"first run's fill (compute + store every item), {store} / PersistentDataset", fill)
    out["persist.over_budget"] = _row(
        "dataset twice the memory budget: computations per warm epoch (restart), disk store vs /dev/shm store "
        "with max_bytes = half",
        over,
    )
    if shm.get("restart_computed") is not None and "read_s" in shm:
        out["persist.shm_read_vs_floor"] = _row(
            "persistent store on /dev/shm: warm read + crop + copy / private no-copy floor",
            f"{shm['read_x_floor']:.2f}x the floor",
        )
    return out
