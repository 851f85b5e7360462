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
