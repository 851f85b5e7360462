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
In-tree PEP 517 build backend of the MONAI shared-cache fork (standard library only).

The repository holds only our own work: new modules under ``monai/`` (the overlay) and unified diffs of upstream
files under ``patches/``. This backend lays the pinned upstream release wheel, the overlay and the patches together
into one complete ``monai`` wheel whose version is ``<upstream>+sharedcache.<N>``.

It is also a small developer CLI (``python build_backend/monai_sharedcache_build.py -h``): lay the patched tree out,
regenerate a patch from an edited file (quilt-style), and export one git-format patch against upstream.
"""

from __future__ import annotations

import argparse
import base64
import csv
import difflib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------------------
# Pins. Bump FORK_BUILD whenever the built code changes: pip does not reinstall a version it already has.
UPSTREAM_VERSION = "1.6.1"
UPSTREAM_WHEEL = f"monai-{UPSTREAM_VERSION}-py3-none-any.whl"
UPSTREAM_SHA256 = "dbd3b1dd309e752e0477ed73fde03b92f80ac74bfb8a8c4260f018b5d6ab2b0b"
FORK_BUILD = 29
LAYER_REQUIRES = "xxhash>=3.0"
VERSION = f"{UPSTREAM_VERSION}+sharedcache.{FORK_BUILD}"

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = "monai"
PATCHES = "patches"
# The fork's own layer, never proposed upstream: a second top-level package of the wheel, laid out after the whole
# series, and the patches of upstream files that wire it in (applied after the series, named fork-NNNN-*.patch)
LAYER = "monai_sharedcache"
FORK_PATCHES = "patches/fork"
CONFIG_KEY = "upstream-wheel"  # pip install . --config-settings upstream-wheel=/path/to/monai-1.6.1-py3-none-any.whl
ENV_WHEEL = "MONAI_UPSTREAM_WHEEL"
ENV_CACHE = "MONAI_SHAREDCACHE_CACHE_DIR"
SDIST_MEMBERS = ("pyproject.toml", "README.md", "CHANGELOG.md", "build_backend", OVERLAY, LAYER, PATCHES)
# 2026-01-01T00:00:00Z, used for every archive member unless SOURCE_DATE_EPOCH says otherwise
DEFAULT_EPOCH = 1767225600


class BuildError(RuntimeError):
    """A build step failed; the message says which input is at fault and what to do."""


# ---------------------------------------------------------------------------------------------------------------------
# The pinned upstream wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(path: Path, origin: str) -> Path:
    if not path.is_file():
        raise BuildError(f"upstream wheel from {origin} does not exist: {path}")
    digest = _sha256(path)
    if digest != UPSTREAM_SHA256:
        raise BuildError(
            f"sha256 mismatch for the upstream wheel from {origin}: {path}\n"
            f"  expected {UPSTREAM_SHA256} (pinned {UPSTREAM_WHEEL})\n  got      {digest}\n"
            "Refusing to build from an unverified upstream. Remove or replace the file."
        )
    return path


def cache_dir() -> Path:
    """The local cache of downloaded upstream wheels."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "monai-sharedcache"


def _pip_download(dest: Path) -> Path:
    """Download the pinned wheel with pip, hash-checked; works inside pip's isolated build environment too."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "upstream.txt"
        # `===` matches the release only; a plain `==` would also match our own local version 1.6.1+sharedcache.N
        req.write_text(f"monai==={UPSTREAM_VERSION} --hash=sha256:{UPSTREAM_SHA256}\n")
        args = ["-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:"]
        args += ["--disable-pip-version-check", "-q", "-d", tmp, "-r", str(req)]
        pythons = [sys.executable, getattr(sys, "_base_executable", sys.executable)]
        errors = []
        for python in dict.fromkeys(pythons):
            proc = subprocess.run([python, *args], env=env, capture_output=True, text=True)
            got = Path(tmp) / UPSTREAM_WHEEL
            if proc.returncode == 0 and got.is_file():
                dest.mkdir(parents=True, exist_ok=True)
                part = dest / f".{UPSTREAM_WHEEL}.{os.getpid()}.part"
                shutil.copyfile(got, part)
                os.replace(part, dest / UPSTREAM_WHEEL)
                return dest / UPSTREAM_WHEEL
            errors.append(f"{python} -m pip download: exit {proc.returncode}\n{proc.stderr.strip()[-2000:]}")
    raise BuildError(
        f"could not download {UPSTREAM_WHEEL} from the package index.\n"
        + "\n".join(errors)
        + f"\nOffline? Pass the wheel with --config-settings {CONFIG_KEY}=PATH or the {ENV_WHEEL} environment variable."
    )


def find_upstream_wheel(config_settings: dict | None = None) -> Path:
    """
    Locate the pinned upstream wheel and verify its sha256.

    Order: the ``upstream-wheel`` config setting, the ``MONAI_UPSTREAM_WHEEL`` environment variable, the local cache,
    then ``pip download``. A file that does not match the pinned sha256 is a hard error wherever it came from.
    """
    value = (config_settings or {}).get(CONFIG_KEY)
    if value:
        return _verified(Path(str(value)), f"--config-settings {CONFIG_KEY}")
    if os.environ.get(ENV_WHEEL):
        return _verified(Path(os.environ[ENV_WHEEL]), f"${ENV_WHEEL}")
    cached = cache_dir() / UPSTREAM_WHEEL
    if cached.is_file():
        return _verified(cached, f"the local cache {cache_dir()}")
    return _verified(_pip_download(cache_dir()), "pip download")


# ---------------------------------------------------------------------------------------------------------------------
# A strict unified-diff applier: every context and removed line must match exactly where the hunk says.

_HEADER_LINE = re.compile(r"^--- ", re.M)  # the first file header of a patch; what comes before is its description
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class FilePatch:
    """The hunks of one file in a unified diff."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.hunks: list[tuple[int, list[str], list[str]]] = []  # (old start, old lines, new lines)

    @property
    def path(self) -> str:
        name = self.new if self.new != "/dev/null" else self.old
        return name[2:] if name[:2] in ("a/", "b/") else name


def _strip_name(line: str) -> str:
    return line[4:].split("\t")[0].strip()


def parse_patch(text: str, patch_name: str) -> list[FilePatch]:
    """Parse a unified diff (git or plain) into file patches."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_name(line), _strip_name(lines[i + 1])))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise BuildError(f"{patch_name}: hunk before any file header at line {i + 1}")
            n_old = int(m.group(2) if m.group(2) is not None else 1)
            n_new = int(m.group(4) if m.group(4) is not None else 1)
            old_lines: list[str] = []
            new_lines: list[str] = []
            prev_tag = " "
            i += 1
            while i < len(lines) and (len(old_lines) < n_old or len(new_lines) < n_new or lines[i].startswith("\\")):
                body = lines[i]
                tag, content = body[:1], body[1:]
                if tag == "\\":  # "\ No newline at end of file": the previous line has no newline
                    for side, kept in ((old_lines, prev_tag != "+"), (new_lines, prev_tag != "-")):
                        if kept and side:
                            side[-1] = side[-1].rstrip("\n")
                elif tag in (" ", "\n"):
                    content = content if tag == " " else "\n"
                    old_lines.append(content)
                    new_lines.append(content)
                elif tag == "-":
                    old_lines.append(content)
                elif tag == "+":
                    new_lines.append(content)
                else:
                    raise BuildError(f"{patch_name}: malformed hunk line {i + 1}: {body!r}")
                prev_tag = tag if tag in "+-" else prev_tag if tag == "\\" else " "
                i += 1
            if len(old_lines) != n_old or len(new_lines) != n_new:
                raise BuildError(f"{patch_name}: truncated hunk {line.strip()!r} for {files[-1].path}")
            files[-1].hunks.append((int(m.group(1)), old_lines, new_lines))
            continue
        i += 1
    if not files:
        raise BuildError(f"{patch_name}: no file headers found; is it a unified diff?")
    return files


def _find_hunk(src: list[str], old_lines: list[str], at: int, pos: int) -> int | None:
    """Where ``old_lines`` stand in ``src``: at ``at``, else at the nearest offset, never before ``pos``; no fuzz."""
    n = len(old_lines)
    for offset in range(len(src) + 1):
        for cand in (at - offset, at + offset) if offset else (at,):
            if pos <= cand <= len(src) - n and src[cand : cand + n] == old_lines:
                return cand
    return None


def apply_file_patch(fp: FilePatch, original: str | None, patch_name: str) -> str | None:
    """
    Apply one file's hunks to ``original``: every context and removed line must match exactly, at the stated line or
    shifted by whole lines (as ``git apply`` allows), never with fuzz. Return the new text, ``None`` if deleted.
    """
    src = [] if original is None else original.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # index into src of the next line not yet copied
    for n, (start, old_lines, new_lines) in enumerate(fp.hunks, 1):
        at = max(start - 1, 0) if old_lines else start  # a pure insertion hunk "-k,0" inserts after line k
        found_at = _find_hunk(src, old_lines, at, pos) if old_lines else (at if pos <= at <= len(src) else None)
        if found_at is None:
            found = src[at : at + len(old_lines)]
            first_bad = next((k for k, (a, b) in enumerate(zip(found, old_lines)) if a != b), len(found))
            expected = old_lines[first_bad] if first_bad < len(old_lines) else "<end of file>"
            actual = found[first_bad] if first_bad < len(found) else "<end of file>"
            raise BuildError(
                f"patch {patch_name} does not apply to {fp.path}: hunk #{n} (@@ -{start},{len(old_lines)} @@) "
                f"expects at line {at + first_bad + 1}:\n  {expected!r}\nbut the file has:\n  {actual!r}\n"
                "(nor anywhere after the previous hunk). The file has drifted; refresh the patch (see README: "
                "'Editing an upstream file')."
            )
        out.extend(src[pos:found_at])
        out.extend(new_lines)
        pos = found_at + len(old_lines)
    out.extend(src[pos:])
    if fp.new == "/dev/null":
        return None
    return "".join(out)


def patch_files(patches_dir: Path) -> list[Path]:
    """The patch series, in the order it is applied."""
    return sorted(p for p in patches_dir.glob("*.patch") if p.is_file())


def all_patches(src_root: Path = ROOT) -> list[Path]:
    """Every patch the build applies: the upstream series, then the fork's (``fork-`` sorts after the digits)."""
    return patch_files(src_root / PATCHES) + patch_files(src_root / FORK_PATCHES)


def apply_patch(tree: Path, patch: Path) -> list[str]:
    """Apply ``patch`` to ``tree`` strictly; all files are checked before any is written. Returns the paths."""
    results = {}
    for fp in parse_patch(patch.read_text(encoding="utf-8"), patch.name):
        target = tree / fp.path
        original = target.read_text(encoding="utf-8") if fp.old != "/dev/null" else None
        if original is None and target.exists():
            raise BuildError(f"patch {patch.name} creates {fp.path}, which already exists upstream")
        if fp.old != "/dev/null" and not target.is_file():
            raise BuildError(f"patch {patch.name} changes {fp.path}, which is neither upstream nor in the overlay")
        results[fp.path] = apply_file_patch(fp, original, patch.name)
    for rel, text in results.items():
        if text is None:
            (tree / rel).unlink()
        else:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(text, encoding="utf-8")
    return list(results)


def make_patch(path: str, before: str, after: str) -> str:
    """A unified diff of one file, in the form ``apply_patch`` reads and ``git apply`` accepts."""
    for name, text in (("original", before), ("edited", after)):
        if text and not text.endswith("\n"):
            raise BuildError(f"{path}: the {name} text must end with a newline")
    diff = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=3
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in diff)


# ---------------------------------------------------------------------------------------------------------------------
# Laying out the patched tree


def _overlay_files(src_root: Path, top: str = OVERLAY) -> list[Path]:
    base = src_root / top
    if not base.is_dir():
        return []
    files = []
    for p in sorted(base.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
            files.append(p.relative_to(src_root))
    return files


def unpack_upstream(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.startswith("/") or ".." in Path(name).parts:
                raise BuildError(f"unsafe path in the upstream wheel: {name}")
        zf.extractall(dest)


def set_version(tree: Path) -> None:
    """Write the fork version into ``monai/_version.py`` and the METADATA of the dist-info."""
    vfile = tree / "monai" / "_version.py"
    text = vfile.read_text(encoding="utf-8")
    old = f'"version": "{UPSTREAM_VERSION}"'
    if text.count(old) != 1:
        raise BuildError(f"monai/_version.py: expected exactly one {old!r}; upstream changed its version file")
    vfile.write_text(text.replace(old, f'"version": "{VERSION}"'), encoding="utf-8")
    old_info = tree / f"monai-{UPSTREAM_VERSION}.dist-info"
    new_info = tree / f"monai-{VERSION}.dist-info"
    if old_info.is_dir():
        old_info.rename(new_info)
    meta = new_info / "METADATA"
    text = meta.read_text(encoding="utf-8")
    if f"\nVersion: {UPSTREAM_VERSION}\n" not in text:
        raise BuildError("METADATA: no 'Version:' line for the pinned upstream version")
    text = text.replace(f"\nVersion: {UPSTREAM_VERSION}\n", f"\nVersion: {VERSION}\n", 1)
    if "\nRequires-Dist: torch" not in text:
        raise BuildError("METADATA: no 'Requires-Dist: torch' line to put the layer's requirements after")
    # the layer's checksums of items on a disk (monai_sharedcache.checksum); without it, CRC-32, slower
    text = text.replace("\nRequires-Dist: torch", f"\nRequires-Dist: {LAYER_REQUIRES}\nRequires-Dist: torch", 1)
    meta.write_text(text, encoding="utf-8")
    wheel_file = new_info / "WHEEL"
    lines = [
        "Generator: monai-sharedcache-build" if ln.startswith("Generator:") else ln
        for ln in wheel_file.read_text(encoding="utf-8").splitlines()
    ]
    wheel_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (new_info / "RECORD").unlink(missing_ok=True)


def input_digest(src_root: Path = ROOT) -> str:
    """A digest of everything the built tree depends on; the developer loop rebuilds when it changes."""
    h = hashlib.sha256(f"{VERSION}:{UPSTREAM_SHA256}".encode())
    inputs = _overlay_files(src_root) + _overlay_files(src_root, LAYER)
    inputs += [p.relative_to(src_root) for p in all_patches(src_root)]
    inputs.append(Path(__file__).resolve().relative_to(src_root.resolve()))
    for rel in inputs:
        h.update(str(rel).encode() + b"\0" + (src_root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def _assemble(tree: Path, wheel: Path, src_root: Path = ROOT, upto: str | None = None) -> None:
    """
    Unpack upstream into ``tree``, add the overlay (the modules as the PR that adds them has them), then apply the
    patches in order, stopping before the patch named ``upto``: diffs of upstream files, and diffs by a later PR of
    an overlay module that an earlier PR added. The fork's layer comes with its own patches, after the whole series.
    """
    unpack_upstream(wheel, tree)
    layer = upto is None or upto.startswith("fork-")
    for rel in _overlay_files(src_root) + (_overlay_files(src_root, LAYER) if layer else []):
        target = tree / rel
        if target.exists():
            raise BuildError(f"overlay file {rel} would replace an upstream file; change upstream with a patch")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_root / rel, target)
    for patch in all_patches(src_root):
        if upto is not None and patch.name >= upto:
            break
        apply_patch(tree, patch)


def layout(dest: Path, config_settings: dict | None = None, src_root: Path = ROOT, wheel: Path | None = None) -> Path:
    """
    Lay upstream, the overlay and the patches out as a full package tree in ``dest`` (replaced if it exists).

    Returns ``dest``, which holds ``monai/`` and ``monai-<version>.dist-info/`` (without RECORD).
    """
    wheel = wheel or find_upstream_wheel(config_settings)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _assemble(tmp, wheel, src_root)
        set_version(tmp)
        (tmp / ".stamp").write_text(input_digest(src_root) + "\n")
        # swap the trees with two renames, so that a process importing from `dest` meanwhile hardly sees a gap
        old = dest.with_name(dest.name + f".old{os.getpid()}")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# ---------------------------------------------------------------------------------------------------------------------
# Archives


def _epoch() -> int:
    return int(os.environ.get("SOURCE_DATE_EPOCH", DEFAULT_EPOCH))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(tree: Path, wheel_directory: Path) -> str:
    """Zip a laid-out tree into a reproducible wheel with a correct RECORD; returns the file name."""
    dist_info = f"monai-{VERSION}.dist-info"
    files = sorted(
        p.relative_to(tree).as_posix()
        for p in tree.rglob("*")
        if p.is_file() and p.name != ".stamp" and "__pycache__" not in p.parts
    )
    files = [f for f in files if not f.startswith(dist_info + "/")] + [f for f in files if f.startswith(dist_info)]
    date_time = time.gmtime(max(_epoch(), 315532800))[:6]
    name = f"monai-{VERSION}-py3-none-any.whl"
    out = Path(wheel_directory) / name
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:

        def add(arcname: str, data: bytes) -> None:
            info = zipfile.ZipInfo(arcname, date_time=date_time)  # type: ignore[arg-type]
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data, compresslevel=9)

        for rel in files:
            data = (tree / rel).read_bytes()
            writer.writerow([rel, _record_hash(data), len(data)])
            add(rel, data)
        writer.writerow([f"{dist_info}/RECORD", "", ""])
        add(f"{dist_info}/RECORD", record.getvalue().encode())
    return name


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if "__pycache__" in info.name.split("/") or info.name.endswith((".pyc", ".pyo")):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = _epoch()
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def pkg_info() -> str:
    return (
        "Metadata-Version: 2.1\nName: monai\n"
        f"Version: {VERSION}\nSummary: MONAI {UPSTREAM_VERSION} with a shared, checked CacheDataset runtime cache\n"
        "License: Apache-2.0\nRequires-Python: >=3.10\n"
    )


# ---------------------------------------------------------------------------------------------------------------------
# PEP 517 hooks


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings: dict | None = None) -> list[str]:
    return []


def build_wheel(
    wheel_directory: str, config_settings: dict | None = None, metadata_directory: str | None = None
) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        tree = layout(Path(tmp) / "tree", config_settings)
        return write_wheel(tree, Path(wheel_directory))


def build_sdist(sdist_directory: str, config_settings: dict | None = None) -> str:
    base = f"monai-{VERSION}"
    name = f"{base}.tar.gz"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        members: list[Path] = []
        for entry in SDIST_MEMBERS:
            path = ROOT / entry
            if path.is_dir():
                members.extend(p for p in path.rglob("*") if p.is_file())
            elif path.is_file():
                members.append(path)
        for p in sorted(members, key=lambda q: q.relative_to(ROOT).as_posix()):
            tf.add(p, arcname=f"{base}/{p.relative_to(ROOT).as_posix()}", recursive=False, filter=_tar_filter)
        data = pkg_info().encode()
        info = _tar_filter(tarfile.TarInfo(f"{base}/PKG-INFO"))
        assert info is not None
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with open(Path(sdist_directory) / name, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
            gz.write(raw.getvalue())
    return name


# ---------------------------------------------------------------------------------------------------------------------
# Developer CLI


def pristine(dest: Path, upto: Path | None = None, src_root: Path = ROOT) -> Path:
    """
    Unpack upstream into ``dest``; with ``upto``, also add the overlay and apply the patches that come before it (the
    tree that the patch ``upto`` applies to). Without ``upto``, upstream alone.
    """
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if upto is None:
        unpack_upstream(find_upstream_wheel(), dest)
    else:
        _assemble(dest, find_upstream_wheel(), src_root, upto=upto.name)
    return dest


def refresh(patch: Path, tree: Path, files: list[str] | None = None, src_root: Path = ROOT) -> str:
    """
    Regenerate ``patch`` from the edited files in the laid-out ``tree`` (like ``quilt refresh``).

    The new patch holds, for each file (those the patch already touches, plus ``files``), the diff between upstream
    with the earlier patches applied and the file as it is now in ``tree``. In the laid-out tree, a file that a later
    patch also touches is refused, because its edit could not be told apart: edit a tree that stops before the later
    patch instead (``pristine --upto``), then refresh the later patches in turn.
    """
    series = all_patches(src_root)
    # a new patch may hold only its description so far
    header, diffs = _strip_header(patch.read_text() if patch.is_file() else "")
    touched = [fp.path for fp in parse_patch(diffs, patch.name)] if diffs else []
    wanted = list(dict.fromkeys(touched + list(files or [])))
    if not wanted:
        raise BuildError(f"{patch.name}: name the upstream files it should change")
    # in the laid-out tree, the later patches are applied too: their edits could not be told apart from this one's
    later = [p for p in series if p.name > patch.name] if tree.resolve() == (ROOT / "build" / "tree").resolve() else []
    for p in later:
        clash = set(wanted) & {fp.path for fp in parse_patch(p.read_text(), p.name)}
        if clash:
            raise BuildError(f"{sorted(clash)} also changed by the later patch {p.name}; refresh that one instead")
    with tempfile.TemporaryDirectory() as tmp:
        base = pristine(Path(tmp) / "base", upto=patch, src_root=src_root)
        parts = []
        for rel in wanted:
            before = (base / rel).read_text(encoding="utf-8")
            if rel == "monai/_version.py":
                raise BuildError("monai/_version.py is written by the build; do not patch it")
            after = (tree / rel).read_text(encoding="utf-8")
            diff = make_patch(rel, before, after)
            if diff:
                parts.append(diff)
    patch.write_text(header + "".join(parts))
    return patch.name


SERIES = "docs/pr/series.ini"  # the upstream PR series: which patches, modules, tests and docs each PR holds
UPSTREAM_TEST_DIR = "tests/data"  # where MONAI keeps the tests of monai/data
FORK_TEST_DIR = "tests/fork"  # the fork's own tests: of the build, and those MONAI's CI could not run
TEST_UTILS = "test_utils.py"  # the fork's stand-in for MONAI's tests/test_utils.py (same names and meanings)
TUTORIALS = "tutorials"  # runnable recipes, exported as a companion for MONAI's tutorials repository
CODE_CAP, DOCS_CAP = 1000, 500  # changed lines of one PR: code and tests (monai/, tests/), and docs
SERIES_MONAI_CAP = 400  # lines that the whole series adds under monai/: MONAI's history sets the scale (issue 57)
MAX_PRS = 5
# what no line added under monai/ may hold: OS machinery belongs in the package (design.md, invariant 9)
OS_MACHINERY = re.compile(
    r"import (fcntl|mmap|ctypes)\b|\b(fcntl|mmap|ctypes)\.|\bflock\(|[gs]etxattr\(|[\"']/dev/shm|[\"']/proc/|"
    r"\bos\.open\(|statvfs\(|\bsyscall\(|\bioctl\(|userfaultfd|register_at_fork\(|O_DIRECTORY"
)
SIGNOFF_ENV = "MONAI_EXPORT_SIGNOFF"  # "Name <email>": who exports, when git's user.name and user.email are not it


def exporter(signoff: str | None = None, src_root: Path = ROOT) -> str:
    """
    Who signs the exported PRs off (MONAI's DCO check wants the submitter): ``signoff``, else ``$MONAI_EXPORT_SIGNOFF``,
    else ``git config user.name`` and ``user.email`` of the repository, as ``git commit -s`` would sign.

    Raises:
        BuildError: none of them gives a name and an email.
    """
    who = signoff or os.environ.get(SIGNOFF_ENV, "")
    if not who:

        def config(key: str) -> str:
            out = subprocess.run(["git", "config", key], cwd=src_root, capture_output=True, text=True)
            return out.stdout.strip()

        name, email = config("user.name"), config("user.email")
        who = f"{name} <{email}>" if name and email else ""
    if not re.fullmatch(r"[^<>\n]+ <[^<>@\s]+@[^<>\s]+>", who):
        raise BuildError(
            f"the export is signed off by whoever exports it, as 'Name <email>', got {who!r}: set git config "
            f"user.name and user.email, or pass --signoff 'Name <email>' (or ${SIGNOFF_ENV})"
        )
    return who


class Stage:
    """One pull request of the upstream series (a section of ``docs/pr/series.ini``)."""

    def __init__(self, name: str, fields: dict[str, str], number: int) -> None:
        self.name, self.number = name, number
        self.title = fields.get("title", name)
        self.patches, self.overlay, self.tests, self.fork_tests, self.docs = (
            fields.get(key, "").split() for key in ("patches", "overlay", "tests", "fork_tests", "docs")
        )
        # names that this PR adds: no earlier PR may mention them (one per line, literal text)
        self.provides = [ln.strip() for ln in fields.get("provides", "").splitlines() if ln.strip()]
        # tokens that must not appear in the lines this PR adds (one per line, literal text)
        self.forbids = [ln.strip() for ln in fields.get("forbids", "").splitlines() if ln.strip()]
        self.max_lines = int(fields["max_lines"]) if fields.get("max_lines") else None
        # the commit message of a PR whose patches carry none (a PR of new modules only), as What/Why paragraphs
        self.message = fields.get("message", "").strip()


def read_series(src_root: Path = ROOT) -> list[Stage]:
    """
    The PR series, in order. Every patch of ``patches/`` must be in exactly one stage, in the order of the series,
    every overlay module in exactly one, every exported test (``tests/test_*.py`` but the stand-in of MONAI's
    ``test_utils.py``) in exactly one, and every test of ``tests/fork/`` in at most one (the others test the build).
    """
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    if not parser.read(src_root / SERIES, encoding="utf-8"):
        raise BuildError(f"{SERIES} is missing")
    stages = [Stage(name, dict(parser[name]), n) for n, name in enumerate(parser.sections(), 1)]
    listed = [p for st in stages for p in st.patches]
    actual = [p.name for p in patch_files(src_root / PATCHES)]
    if listed != actual:
        raise BuildError(f"{SERIES} lists the patches {listed}, but patches/ holds {actual} (same files, same order)")
    overlay = sorted(str(p) for p in _overlay_files(src_root) if p.suffix == ".py")
    if sorted(m for st in stages for m in st.overlay) != overlay:
        raise BuildError(f"{SERIES}: the overlay modules of the stages must be exactly {overlay}")
    tests = sorted(p.name for p in (src_root / "tests").glob("test_*.py") if p.name != TEST_UTILS)
    if sorted(t for st in stages for t in st.tests) != tests:
        raise BuildError(f"{SERIES}: the exported tests of the stages must be exactly {tests}")
    fork = {p.name for p in (src_root / FORK_TEST_DIR).glob("test_*.py")}
    listed_fork = [t for st in stages for t in st.fork_tests]
    if len(set(listed_fork)) != len(listed_fork) or not set(listed_fork) <= fork:
        raise BuildError(f"{SERIES}: fork_tests must name files of {FORK_TEST_DIR}/, each in one stage at most")
    return stages


def _strip_header(text: str) -> tuple[str, str]:
    """Split a patch into its description and its diffs."""
    found = _HEADER_LINE.search(text)
    return (text[: found.start()], text[found.start() :]) if found else (text, "")


def _added_lines(diff: str) -> list[tuple[str, str]]:
    """``(path, line)`` of every line a unified diff adds."""
    out, path = [], ""
    for ln in diff.splitlines():
        if ln.startswith("+++ "):
            path = _strip_name(ln)[2:] if _strip_name(ln).startswith("b/") else _strip_name(ln)
        elif ln.startswith("+"):
            out.append((path, ln[1:]))
    return out


def _changed_lines(diff: str) -> dict[str, int]:
    """Changed (added or removed) lines of a diff: ``code`` (monai/, tests/) and ``docs`` (the rest)."""
    counts, path = {"code": 0, "docs": 0}, ""
    for ln in diff.splitlines():
        if ln.startswith(("+++ ", "--- ")):
            name = _strip_name(ln)
            path = name[2:] if name[:2] in ("a/", "b/") else (path if name == "/dev/null" else name)
        elif ln[:1] in "+-":
            counts["code" if path.startswith(("monai/", "tests/")) else "docs"] += 1
    return counts


def _without(src: Path, path: str, later: list[str], src_root: Path) -> str | None:
    """
    The docs file ``path`` (``src``: as the fork has it, with what later PRs change in it) as the PR that adds it has
    it: the hunks of the later PRs' docs diffs ``later`` that change it are taken back, last first; None if none does.
    """
    text = None
    for name in reversed(later):
        for fp in parse_patch(_strip_header((src_root / name).read_text(encoding="utf-8"))[1], name):
            if fp.path == path:
                back, shift = FilePatch(fp.new, fp.old), 0
                for start, old, new in fp.hunks:
                    back.hunks.append((start + shift - (0 if new else 1), new, old))
                    shift += len(new) - len(old)
                text = apply_file_patch(back, src.read_text(encoding="utf-8") if text is None else text, name) or ""
    return text


def export_series(out_dir: Path, src_root: Path = ROOT, signoff: str | None = None) -> list[Path]:
    """
    Write the upstream PR series into ``out_dir``: for each stage ``NN-<slug>.patch`` and ``NN-<slug>.md``, and
    ``series.json`` (the size and checks of each PR).

    A ``.patch`` is a plain ``git diff`` with the descriptions of its patches first: the stage's code and tests
    (at MONAI's test paths) and new docs files, against the unpacked upstream wheel with the earlier stages applied,
    then the stage's diffs of MONAI's own docs. Every patch applies with ``git apply`` after the ones before it:
    whole to MONAI's repository, and with ``--include='monai/*' --include='tests/*'`` to an unpacked wheel.

    Args:
        out_dir: where the PRs go.
        src_root: the repository to export.
        signoff: who signs the PRs off, as ``Name <email>``; by default :py:func:`exporter`'s answer.

    Raises:
        BuildError: no sign-off (see :py:func:`exporter`); a PR over its size caps, one that mentions a name that a
            later PR adds, adds a forbidden token, OS machinery or a private module under ``monai/``, exports a test
            that needs the fork's own test modules, or has no commit message (no patch header and no ``message`` in
            the series); more than ``MAX_PRS`` PRs or ``SERIES_MONAI_CAP`` lines added under ``monai/`` in all.
    """
    author = exporter(signoff, src_root)
    name, email = author[: author.index(" <")], author[author.index(" <") + 2 : -1]
    git = ["git", "-c", f"user.name={name}", "-c", f"user.email={email}"]
    git += ["-c", "commit.gpgsign=false", "-c", "core.autocrlf=false"]
    stages = read_series(src_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("[0-9][0-9]-*.patch"), *out_dir.glob("[0-9][0-9]-*.md")]:
        stale.unlink()  # the PRs of an earlier export, which another series may have named otherwise
    written, summary, monai_added = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        repo = pristine(Path(tmp) / "repo")
        for info in repo.glob("monai-*.dist-info"):
            shutil.rmtree(info)
        env = {**os.environ, "GIT_AUTHOR_DATE": f"{_epoch()} +0000", "GIT_COMMITTER_DATE": f"{_epoch()} +0000"}
        env.pop("GIT_DIR", None)
        env.pop("GIT_INDEX_FILE", None)

        def run(*args: str) -> str:
            return subprocess.run([*git, *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout

        run("init", "-q")
        run("add", "-A")
        run("commit", "-q", "-m", f"MONAI {UPSTREAM_VERSION}")
        for st in stages:
            descriptions, docs_diffs = [st.message] if st.message else [], []
            for rel in st.overlay:
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src_root / rel, repo / rel)
            for name in st.patches:
                apply_patch(repo, src_root / PATCHES / name)
                descriptions.append(_strip_header((src_root / PATCHES / name).read_text(encoding="utf-8"))[0])
            for name in st.tests:
                text = (src_root / "tests" / name).read_text(encoding="utf-8")
                if "tests.fork" in text or "from fork" in text:
                    raise BuildError(f"tests/{name} is exported but imports the fork's own tests/fork/")
                dest = repo / UPSTREAM_TEST_DIR / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text, encoding="utf-8")
            for rel in st.docs:
                src = src_root / rel
                if rel.startswith(PATCHES + "/"):
                    head, body = _strip_header(src.read_text(encoding="utf-8"))
                    descriptions.append(head)
                    # git's file header, as in the rest of the patch: git am and the diffstat count the file
                    docs_diffs.append(re.sub(r"(?m)^--- a/(\S+)$", r"diff --git a/\1 b/\1\n--- a/\1", body))
                    continue
                for f in sorted(src.rglob("*")) if src.is_dir() else [src]:
                    if f.is_file() and "__pycache__" not in f.parts:
                        dest = repo / f.relative_to(src_root)
                        if dest.exists():
                            raise BuildError(f"{SERIES}: {rel} would replace a file of upstream")
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        diffs = [d for other in stages[st.number :] for d in other.docs if d.startswith(PATCHES + "/")]
                        page = _without(f, str(f.relative_to(src_root)), diffs, src_root)
                        if page is None:
                            shutil.copyfile(f, dest)
                        else:
                            dest.write_text(page, encoding="utf-8")
            if not any(d.strip() for d in descriptions):
                raise BuildError(f"PR {st.name} has no commit message: none of its patches has a header; give it one")
            run("add", "-A")
            run("commit", "-q", "-m", st.title)
            diff = run("diff", "HEAD~1", "HEAD") + "".join(docs_diffs)
            sizes = _changed_lines(diff)
            changed = sizes["code"] + sizes["docs"]
            caps = [(sizes["code"], CODE_CAP, "code and tests"), (sizes["docs"], DOCS_CAP, "docs")]
            caps += [(changed, st.max_lines, "in all")] if st.max_lines is not None else []
            for value, cap, what in caps:
                if value > cap:
                    raise BuildError(f"PR {st.name} changes {value} lines of {what}, over its cap of {cap}")
            added = _added_lines(diff)
            for path, line in added:
                if path.startswith("monai/") and OS_MACHINERY.search(line.split("#", 1)[0]):
                    raise BuildError(
                        f"PR {st.name} adds OS machinery under monai/, which belongs in the package: {line}"
                    )
            new = [ln[len("+++ b/") :] for prev, ln in zip(diff.splitlines(), diff.splitlines()[1:])
                   if prev.startswith("--- /dev/null") and ln.startswith("+++ b/monai/")]  # fmt: skip
            private = [n for n in new if Path(n).name.startswith("_") and Path(n).name != "__init__.py"]
            if private:
                raise BuildError(f"PR {st.name} adds a private module under monai/: {private}")
            monai_added += sum(1 for path, _ in added if path.startswith("monai/"))
            later = [(name, other.name) for other in stages[st.number :] for name in other.provides]
            for path, line in added:
                for name, other in later:
                    if name in line:
                        raise BuildError(f"PR {st.name} mentions {name!r}, which only {other} adds: {path}: {line}")
                for token in st.forbids:
                    if token in line:
                        raise BuildError(f"PR {st.name} adds {token!r}, which it must not: {path}: {line}")
            stat = run("diff", "--stat=100", "HEAD~1", "HEAD").rstrip()
            for d in docs_diffs:
                for fp in parse_patch(d, st.name):
                    plus = sum(1 for path, _ in _added_lines(d) if path == fp.path)
                    stat += f"\n {fp.path} (MONAI's docs) | +{plus}"
            header = f"From: {author}\nSubject: [PATCH {st.number:02d}/{len(stages)}] {st.title}\n\n"
            patch_path = out_dir / f"{st.name}.patch"
            signed = f"\nSigned-off-by: {author}\n"  # MONAI's DCO check (CONTRIBUTING.md): the author's sign-off
            message = "\n".join(d.strip() + "\n" for d in descriptions) + signed
            patch_path.write_text(header + message + "\n" + diff)
            md = write_pr_description(out_dir / f"{st.name}.md", st, sizes, stat, src_root)
            written += [patch_path, md]
            summary.append({"name": st.name, "title": st.title, "code": sizes["code"], "docs": sizes["docs"],
                            "tests": st.tests, "fork_tests": st.fork_tests, "forbids": st.forbids})  # fmt: skip
    if len(stages) > MAX_PRS or monai_added > SERIES_MONAI_CAP:
        raise BuildError(
            f"the series has {len(stages)} PRs adding {monai_added} lines under monai/; at most {MAX_PRS} PRs and "
            f"{SERIES_MONAI_CAP} lines (a new capability goes into the package)"
        )
    (out_dir / "series.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return written


def write_pr_description(out: Path, st: Stage, sizes: dict[str, int], diffstat: str, src_root: Path = ROOT) -> Path:
    """Fill ``docs/pr/<stage>.md.in``: its title, size, the tests kept in the fork and the diffstat."""
    template = (src_root / "docs" / "pr" / f"{st.name}.md.in").read_text(encoding="utf-8")
    changed = sizes["code"] + sizes["docs"]
    size = f"{changed} changed lines ({sizes['code']} of code and tests, {sizes['docs']} of docs)"
    fork_tests = "\n".join(
        f"- `{FORK_TEST_DIR}/{name}`: {_module_summary(src_root / FORK_TEST_DIR / name)}" for name in st.fork_tests
    )
    values = {
        "{{VERSION}}": VERSION,
        "{{TITLE}}": st.title,
        "{{SIZE}}": size,
        "{{DIFFSTAT}}": diffstat,
        "{{FORK_TESTS}}": fork_tests or "none: every test of this PR runs in MONAI's CI.",
    }
    text = template
    for key, value in values.items():
        text = text.replace(key, value)
    out.write_text(text, encoding="utf-8")
    return out


def _module_summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line."""
    import ast

    doc = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip()
    return " ".join(doc.split("\n\n")[0].split()) if doc else path.name


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="monai_sharedcache_build.py",
        description=f"Build tools of the MONAI shared-cache fork ({VERSION} from upstream {UPSTREAM_WHEEL}).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("layout", help="lay the patched tree out (default: build/tree)")
    p.add_argument("dest", nargs="?", default=str(ROOT / "build" / "tree"))
    p.add_argument("--if-stale", action="store_true", help="only if the inputs changed since the last layout")
    p = sub.add_parser("pristine", help="unpack upstream, optionally with the patches before PATCH applied")
    p.add_argument("dest")
    p.add_argument("--upto", help="a patch file name of the series")
    p = sub.add_parser("refresh", help="regenerate a patch from the files edited in the laid-out tree")
    p.add_argument("patch", help="patches/NNNN-name.patch or patches/fork/fork-NNNN-name.patch (created if new)")
    p.add_argument("files", nargs="*", help="upstream files (monai/...) to add to the patch")
    p.add_argument("--tree", default=str(ROOT / "build" / "tree"))
    p = sub.add_parser("export-patch", help="write the upstream PR series (patches, descriptions) and the tutorials")
    p.add_argument("out", nargs="?", default=str(ROOT / "dist" / "pr"))
    p.add_argument("--signoff", help="'Name <email>' of who exports; default: git config user.name and user.email")
    sub.add_parser("wheel-path", help="print the verified upstream wheel path (downloads it if needed)")
    sub.add_parser("version", help="print the fork version")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "layout":
            dest = Path(args.dest)
            stamp = dest / ".stamp"
            if args.if_stale and stamp.is_file() and stamp.read_text().strip() == input_digest():
                return 0
            layout(dest)
            print(f"laid out {VERSION} in {dest}")
        elif args.cmd == "pristine":
            pristine(Path(args.dest), Path(args.upto) if args.upto else None)
            print(f"upstream {UPSTREAM_VERSION} in {args.dest}")
        elif args.cmd == "refresh":
            print("refreshed", refresh(Path(args.patch), Path(args.tree), args.files))
        elif args.cmd == "export-patch":
            for path in export_series(Path(args.out), signoff=args.signoff):
                print(path)
        elif args.cmd == "wheel-path":
            print(find_upstream_wheel())
        elif args.cmd == "version":
            print(VERSION)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
