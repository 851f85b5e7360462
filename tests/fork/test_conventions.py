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
"""MONAI's conventions in what the series exports: napoleon's sections, self-contained tests, private helpers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "build_backend"))
import monai_sharedcache_build as build  # noqa: E402

# the section headers napoleon's Google style knows (sphinx.ext.napoleon.docstring.GoogleDocstring)
NAPOLEON = {
    "Args", "Arguments", "Attention", "Attributes", "Caution", "Danger", "Error", "Example", "Examples", "Hint",
    "Important", "Keyword Args", "Keyword Arguments", "Methods", "Note", "Notes", "Other Parameters", "Parameters",
    "Receive", "Receives", "Return", "Returns", "Raise", "Raises", "References", "See Also", "Tip", "Todo", "Warning",
    "Warnings", "Warn", "Warns", "Yield", "Yields",
}  # fmt: skip
SECTION = re.compile(r"^\s*([A-Z][A-Za-z]*(?: [A-Za-z]+)?):\s*$")
HEADER = "# Copyright (c) MONAI Consortium\n# Licensed under the Apache License, Version 2.0"


def docstrings(path: Path) -> list[tuple[str, str]]:
    """(where, docstring) of the module and of every class and function of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((f"{path.name}:{getattr(node, 'name', '<module>')}", doc))
    return found


def unknown_sections(doc: str) -> list[str]:
    """Lines of ``doc`` that look like a Google-style section header that napoleon does not know."""
    return [m.group(1) for m in map(SECTION.match, doc.splitlines()) if m and m.group(1) not in NAPOLEON]


class TestConventions(unittest.TestCase):
    def test_docstring_sections_are_napoleons(self):
        """Every docstring of the overlay and of the exported tests uses only sections that napoleon knows."""
        files = [
            ROOT / f for f in build._overlay_files(ROOT) + build._overlay_files(ROOT, build.LAYER) if f.suffix == ".py"
        ]
        files += [ROOT / "tests" / t for st in build.read_series() for t in st.tests]
        bad = [f"{where}: {name}" for f in files for where, doc in docstrings(f) for name in unknown_sections(doc)]
        self.assertEqual(bad, [])

    def test_patched_docstrings_too(self):
        """The docstrings that the patches add to upstream files (CacheDataset's methods)."""
        tree = ROOT / "build" / "tree"
        if not (tree / "monai").is_dir():
            self.skipTest("no laid-out tree (./runtests.sh lays it out)")
        patches = [p.read_text() for p in build.patch_files(ROOT / build.PATCHES)]
        changed = {fp.path for text in patches for fp in build.parse_patch(text, "patch")}
        added = "".join(ln[1:] for text in patches for ln in text.splitlines(True) if ln[:1] == "+" and ln[:3] != "+++")
        bad = []
        for rel in sorted(changed):
            for where, doc in docstrings(tree / rel):
                bad += [f"{where}: {n}" for n in unknown_sections(doc) if f"{n}:" in added]
        self.assertEqual(bad, [])

    def test_the_check_sees_a_custom_section(self):
        self.assertEqual(unknown_sections("Text.\n\nFaults:\n    what happens\n\nArgs:\n    x: y\n"), ["Faults"])

    def test_exported_tests_are_self_contained(self):
        """Exported tests import only what MONAI's CI has: monai, torch, numpy, parameterized, stdlib, tests.test_utils."""
        allowed = {"monai", "torch", "numpy", "parameterized", "__future__"} | set(sys.stdlib_module_names)
        for st in build.read_series():
            for name in st.tests:
                tree = ast.parse((ROOT / "tests" / name).read_text(encoding="utf-8"))
                for node in ast.walk(tree):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    mods += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    for mod in mods:
                        top = mod.split(".")[0]
                        ok = top in allowed or mod == "tests.test_utils"
                        self.assertTrue(ok, f"{name} imports {mod}, which MONAI's tests/data cannot")

    def test_no_test_class_is_imported_into_another_test_module(self):
        """pytest runs a ``Test*`` class that a test module imports as that module's own: every test of it twice."""
        for path in sorted((ROOT / "tests").rglob("test_*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1].startswith("test_"):
                    names = [a.asname or a.name for a in node.names if (a.asname or a.name).startswith("Test")]
                    self.assertEqual(names, [], f"{path.relative_to(ROOT)} imports {names}: import the module")

    def test_headers_and_private_helpers(self):
        overlay = [f for f in build._overlay_files(ROOT) if f.suffix == ".py"]
        public = sorted(f.name for f in overlay if not f.name.startswith("_"))
        self.assertEqual(public, [])  # the store and its helpers are the package's (monai_sharedcache)
        package = sorted((ROOT / "monai_sharedcache").glob("*.py"))
        for path in [ROOT / f for f in overlay] + package + list((ROOT / "tests").rglob("*.py")):
            self.assertTrue(path.read_text(encoding="utf-8").startswith(HEADER), f"{path}: no MONAI license header")
        for path in (ROOT / f for f in overlay if not f.name.startswith("_")):
            self.assertIn("__all__", path.read_text(encoding="utf-8"), path)

    def test_runtests_help_is_printed_as_written(self):
        """``./runtests.sh --help`` prints its text unchanged: no shell expansion of its backquotes, nothing on stderr."""
        out = subprocess.run(
            ["bash", str(ROOT / "runtests.sh"), "--help"], capture_output=True, text=True, timeout=60, check=False
        )
        self.assertEqual((out.returncode, out.stderr), (0, ""))
        self.assertIn("(also a Python where `import fcntl` fails, as on Windows;", out.stdout)


if __name__ == "__main__":
    unittest.main()
