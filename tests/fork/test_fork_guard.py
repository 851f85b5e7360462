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
The guard: no file of the repository outside ``patches/`` may share 8 or more consecutive non-blank lines with a file
of the pinned upstream wheel, so that upstream code is never committed by accident.

Lines are compared stripped of surrounding white space. The only exemption is the MONAI Consortium license header,
which every new MONAI file carries by convention.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import unittest
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "build_backend"))
import monai_sharedcache_build as build  # noqa: E402

WINDOW = 8
LICENSE_HEADER = [
    "# Copyright (c) MONAI Consortium",
    '# Licensed under the Apache License, Version 2.0 (the "License");',
    "# you may not use this file except in compliance with the License.",
    "# You may obtain a copy of the License at",
    "#     http://www.apache.org/licenses/LICENSE-2.0",
    "# Unless required by applicable law or agreed to in writing, software",
    '# distributed under the License is distributed on an "AS IS" BASIS,',
    "# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.",
    "# See the License for the specific language governing permissions and",
    "# limitations under the License.",
]
HEADER = [line.strip() for line in LICENSE_HEADER]


def normalized(text: str) -> list[tuple[int, str]]:
    """(line number, stripped line) of the non-blank lines, without the license header."""
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    out, i = [], 0
    while i < len(lines):
        if [s for _, s in lines[i : i + len(HEADER)]] == HEADER:
            i += len(HEADER)
            continue
        out.append(lines[i])
        i += 1
    return out


def windows(lines: list[tuple[int, str]]):
    for i in range(len(lines) - WINDOW + 1):
        chunk = "\n".join(s for _, s in lines[i : i + WINDOW])
        yield lines[i][0], hashlib.sha1(chunk.encode()).digest()


def upstream_windows(wheel: Path) -> dict[bytes, str]:
    found: dict[bytes, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            try:
                text = zf.read(name).decode("utf-8")
            except UnicodeDecodeError:
                continue
            for _, h in windows(normalized(text)):
                found.setdefault(h, name)
    return found


def our_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        files = [ROOT / f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): every file but build output
        files = [p for p in ROOT.rglob("*") if p.is_file() and not {"build", "dist", ".git"} & set(p.parts)]
    return [f for f in files if f.is_file() and f.relative_to(ROOT).parts[0] != build.PATCHES]


def scan(files: list[Path], upstream: dict[bytes, str]) -> list[str]:
    hits = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for line, h in windows(normalized(text)):
            if h in upstream:
                hits.append(f"{f.relative_to(ROOT)}:{line} shares {WINDOW}+ lines with upstream {upstream[h]}")
                break
    return hits


class TestUpstreamGuard(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.upstream = upstream_windows(build.find_upstream_wheel())

    def test_no_upstream_code_outside_patches(self):
        files = our_files()
        self.assertGreater(len(files), 5)
        hits = scan(files, self.upstream)
        self.assertEqual(hits, [], "upstream MONAI code found outside patches/:\n" + "\n".join(hits))

    def test_guard_catches_a_copy(self):
        """The guard is not blind: eight lines of an upstream module, re-indented, are found."""
        with zipfile.ZipFile(build.find_upstream_wheel()) as zf:
            text = zf.read("monai/data/dataset.py").decode()
        lines = [line for line in text.splitlines() if line.strip()][200:208]
        tmp = ROOT / "build" / "guard_probe.py"
        tmp.parent.mkdir(exist_ok=True)
        tmp.write_text("\n".join("    " + line for line in lines) + "\n")
        try:
            self.assertEqual(len(scan([tmp], self.upstream)), 1)
        finally:
            os.unlink(tmp)

    def test_license_header_is_exempt(self):
        self.assertEqual(normalized("\n".join(LICENSE_HEADER) + "\nx = 1\n"), [(11, "x = 1")])


if __name__ == "__main__":
    unittest.main()
