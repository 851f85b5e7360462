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
The layering of the fork: the core (what the series proposes upstream) never imports the layer (``monai_sharedcache``),
the layer uses only the core's public names, and the fork's ``monai.data`` gives the layer's names, imported only at
their first use.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "tree"
LAYER = "monai_sharedcache"
WIRING = "monai/data/__init__.py"  # the fork's own patch (patches/fork/) gives the layer's names here, and only here


def imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every import in ``path`` (``name`` is empty for ``import module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def private_core_names(path: Path) -> list[str]:
    """The private names of ``monai`` that ``path`` imports: a module or a name that starts with an underscore."""
    bad = []
    for module, name in imports(path):
        if module.split(".")[0] != "monai":
            continue
        parts = module.split(".") + ([name] if name else [])
        bad += [f"{path.name}: {module} {name}".strip() for part in parts if part.startswith("_")][:1]
    return bad


def layer_imports(path: Path) -> list[str]:
    return [f"{path}: {module}" for module, _ in imports(path) if module.split(".")[0] == LAYER]


class TestLayering(unittest.TestCase):
    def setUp(self) -> None:
        if not (TREE / LAYER).is_dir():
            self.skipTest("no laid-out tree (./runtests.sh lays it out)")

    def test_core_never_imports_the_layer(self):
        """No module of ``monai`` imports ``monai_sharedcache``, but the fork's wiring of the names of ``monai.data``."""
        files = sorted(p for p in (TREE / "monai").rglob("*.py") if p.relative_to(TREE).as_posix() != WIRING)
        self.assertGreater(len(files), 100)
        self.assertEqual([b for f in files for b in layer_imports(f)], [])
        self.assertTrue(layer_imports(TREE / WIRING))  # the wiring is there, and the check sees it

    def test_layer_uses_public_core_names_only(self):
        layer = sorted((ROOT / LAYER).rglob("*.py"))
        self.assertTrue(layer)
        self.assertEqual([b for f in layer for b in private_core_names(f)], [])

    def test_the_check_sees_a_private_name(self):
        probe = ROOT / "build" / "probe_layering.py"
        probe.write_text("from monai.data import _cache_locks\nfrom monai.data.cache_store import _attach\n")
        try:
            self.assertEqual(len(private_core_names(probe)), 2)
        finally:
            probe.unlink()

    def test_monai_data_gives_the_layers_names_at_first_use(self):
        """``import monai`` imports nothing of the layer; ``monai.data``'s names are then the layer's classes."""
        code = (
            "import sys, monai, monai.data\n"
            "before = 'monai_sharedcache' in sys.modules\n"
            "from monai.data import SharedCacheStore, create_shared_cache\n"
            "import monai_sharedcache\n"
            "print(before, SharedCacheStore is monai_sharedcache.SharedCacheStore,\n"
            "      create_shared_cache is monai_sharedcache.create_shared_cache)\n"
            "try:\n"
            "    monai.data.NoSuchName\n"
            "except AttributeError as e:\n"
            "    print(e)\n"
        )
        env_path = str(TREE)
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        lines = out.stdout.strip().splitlines()
        self.assertEqual(lines[0], "False True True")
        self.assertIn("has no attribute 'NoSuchName'", lines[1])


if __name__ == "__main__":
    unittest.main()
