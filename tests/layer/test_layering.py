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
The layering of the fork: MONAI with the series (what goes upstream) never imports the package (``monai_sharedcache``),
the package uses only MONAI's public names and holds the whole store, and the fork's own patches of upstream files
(``patches/fork/``) wire the package in, importing it only at its first use.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "tree"
LAYER = "monai_sharedcache"
sys.path.insert(0, str(ROOT / "build_backend"))
import monai_sharedcache_build as build  # noqa: E402


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


def module_level_layer_imports(path: Path) -> list[str]:
    """The imports of the layer that run when ``path`` is imported (outside any function)."""
    found, tree = [], ast.parse(path.read_text(encoding="utf-8"))
    lazy = {
        id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if id(node) not in lazy and isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == LAYER]
    return found


def wiring() -> set[str]:
    """The upstream files that the fork's own patches change: the only ones that may import the layer."""
    return {
        fp.path for p in build.patch_files(ROOT / build.FORK_PATCHES) for fp in build.parse_patch(p.read_text(), p.name)
    }


class TestLayering(unittest.TestCase):
    def setUp(self) -> None:
        if not (TREE / LAYER).is_dir():
            self.skipTest("no laid-out tree (./runtests.sh lays it out)")

    def test_core_never_imports_the_layer(self):
        """
        The series (its patches and new modules) never names the layer; in the fork's tree, only the files of the
        fork's own patches import it, and only inside functions, so that ``import monai`` does not load it.
        """
        series = list(build.patch_files(ROOT / build.PATCHES)) + sorted((ROOT / "monai").rglob("*.py"))
        self.assertEqual([p.name for p in series if LAYER in p.read_text(encoding="utf-8")], [])
        wired = wiring()
        self.assertIn("monai/data/__init__.py", wired)
        files = sorted(p for p in (TREE / "monai").rglob("*.py") if p.relative_to(TREE).as_posix() not in wired)
        self.assertGreater(len(files), 100)
        self.assertEqual([b for f in files for b in layer_imports(f)], [])
        for rel in ("monai/data/__init__.py", "monai/data/dataset.py"):
            self.assertTrue(layer_imports(TREE / rel), rel)  # the wiring is there, and the check sees it
        for rel in sorted(wired):
            self.assertEqual(module_level_layer_imports(TREE / rel), [])

    def test_the_check_sees_an_import_at_module_level(self):
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp, "probe_layering.py")
            probe.write_text("import monai_sharedcache\n\n\ndef f():\n    from monai_sharedcache import keys\n")
            self.assertEqual(module_level_layer_imports(probe), ["probe_layering.py: monai_sharedcache"])

    def test_layer_uses_public_core_names_only(self):
        layer = sorted((ROOT / LAYER).rglob("*.py"))
        self.assertTrue(layer)
        self.assertEqual([b for f in layer for b in private_core_names(f)], [])

    def test_the_store_is_the_packages_alone(self):
        """No module of the store is under ``monai/`` of the repository, nor imported from MONAI by the package."""
        moved = ("cache_store.py", "shared_cache.py", "_cache_format.py", "_cache_locks.py")
        self.assertEqual([p for p in (ROOT / "monai").rglob("*.py") if p.name in moved], [])
        fork_only = ("monai.data.cache_store", "monai.data.shared_cache")
        found = [
            f"{f.name}: {m}" for f in sorted((ROOT / LAYER).rglob("*.py")) for m, _ in imports(f) if m in fork_only
        ]
        self.assertEqual(found, [])

    def test_the_check_sees_a_private_name(self):
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp, "probe_layering.py")
            probe.write_text("from monai.data import _cache_locks\nfrom monai.data.cache_store import _attach\n")
            self.assertEqual(len(private_core_names(probe)), 2)

    def test_monai_data_gives_the_layers_names_at_first_use(self):
        """``import monai`` imports nothing of the layer; ``monai.data``'s names are then the layer's classes."""
        code = (
            "import sys, monai, monai.data\n"
            "monai.data.CacheDataset([1, 2], monai.transforms.Compose([]))\n"  # an eager cache: no keys of the fork
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
