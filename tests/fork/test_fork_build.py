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
"""Tests of the fork's build: the backend, the patch applier, the wheel, an install into a venv, the exported patch."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "build_backend"))
import monai_sharedcache_build as build  # noqa: E402

QUICK = os.environ.get("QUICKTEST", "").lower() == "true"
# set by `./runtests.sh --mode spawn|nofcntl`: what the build does depends on neither, so its slow tests run once
MODE = os.environ.get("MONAI_SHAREDCACHE_TEST_MODE", "")


class TestVersion(unittest.TestCase):
    def test_imported_monai_is_the_fork(self):
        import monai

        self.assertEqual(monai.__version__, build.VERSION)
        self.assertRegex(monai.__version__, r"^1\.6\.1\+sharedcache\.\d+$")
        from monai.data import CacheDataset, create_shared_cache  # noqa: F401


class TestPatchApplier(unittest.TestCase):
    ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))

    def test_round_trip(self):
        edited = self.ORIGINAL.replace("line 5\n", "line five\n").replace("line 18\n", "line 18\nnew\n")
        patch = build.make_patch("pkg/mod.py", self.ORIGINAL, edited)
        (fp,) = build.parse_patch(patch, "0001-x.patch")
        self.assertEqual(fp.path, "pkg/mod.py")
        self.assertEqual(build.apply_file_patch(fp, self.ORIGINAL, "0001-x.patch"), edited)

    def test_drifted_hunk_is_refused_a_shifted_one_applies(self):
        edited = self.ORIGINAL.replace("line 10\n", "line ten\n")
        patch = build.make_patch("pkg/mod.py", self.ORIGINAL, edited)
        (fp,) = build.parse_patch(patch, "0007-drift.patch")
        drifted = self.ORIGINAL.replace("line 9\n", "line nine (upstream changed)\n")
        with self.assertRaisesRegex(build.BuildError, r"0007-drift\.patch.*pkg/mod\.py.*hunk #1"):
            build.apply_file_patch(fp, drifted, "0007-drift.patch")
        moved = "extra\nmore\n" + self.ORIGINAL  # the same lines two further down: applied there, as git apply does
        self.assertEqual(build.apply_file_patch(fp, moved, "0007-drift.patch"), "extra\nmore\n" + edited)
        twice = self.ORIGINAL + self.ORIGINAL  # the nearest match wins, never fuzz
        self.assertEqual(build.apply_file_patch(fp, twice, "0007-drift.patch"), edited + self.ORIGINAL)

    def test_patch_series_names_the_failing_patch(self):
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            (tree / "pkg").mkdir()
            (tree / "pkg" / "mod.py").write_text(self.ORIGINAL)
            patch = tree / "0003-bad.patch"
            patch.write_text(build.make_patch("pkg/mod.py", self.ORIGINAL.replace("line 1\n", "x\n"), "y\n"))
            with self.assertRaisesRegex(build.BuildError, r"0003-bad\.patch does not apply to pkg/mod\.py"):
                build.apply_patch(tree, patch)
            self.assertEqual((tree / "pkg" / "mod.py").read_text(), self.ORIGINAL)  # nothing written

    def test_no_newline_at_eof(self):
        patch = (
            "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n"
            "\\ No newline at end of file\n"
        )
        (fp,) = build.parse_patch(patch, "p")
        self.assertEqual(build.apply_file_patch(fp, "a\nb", "p"), "a\nc")

    def test_series_applies_to_upstream_and_the_overlay(self):
        """Each patch applies to upstream with the overlay and the patches before it (``pristine --upto``)."""
        patches = build.patch_files(ROOT / build.PATCHES)
        with tempfile.TemporaryDirectory() as tmp:
            for patch in patches:
                tree = build.pristine(Path(tmp) / "t", upto=patch)
                self.assertTrue(build.apply_patch(tree, patch), patch.name)
        self.assertEqual(build._overlay_files(ROOT), [])  # the series adds no module under monai/


class TestUpstreamWheel(unittest.TestCase):
    def test_wrong_sha256_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            fake = Path(tmp) / build.UPSTREAM_WHEEL
            fake.write_bytes(b"not the release")
            with self.assertRaisesRegex(build.BuildError, "sha256 mismatch"):
                build.find_upstream_wheel({build.CONFIG_KEY: str(fake)})
            os.environ[build.ENV_WHEEL] = str(fake)
            try:
                with self.assertRaisesRegex(build.BuildError, "sha256 mismatch"):
                    build.find_upstream_wheel()
            finally:
                del os.environ[build.ENV_WHEEL]

    def test_config_setting_wins(self):
        wheel = build.find_upstream_wheel()
        self.assertEqual(build.find_upstream_wheel({build.CONFIG_KEY: str(wheel)}), wheel)


class TestArchives(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.wheel = Path(cls.tmp) / build.build_wheel(cls.tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_wheel_content_and_record(self):
        self.assertEqual(self.wheel.name, f"monai-{build.VERSION}-py3-none-any.whl")
        info = f"monai-{build.VERSION}.dist-info"
        with zipfile.ZipFile(self.wheel) as zf:
            names = set(zf.namelist())
            for f in ("monai_sharedcache/store.py", "monai_sharedcache/distributed.py"):
                self.assertIn(f, names)
            self.assertNotIn("monai/data/cache_store.py", names)  # upstream gets no store
            self.assertIn(f'"version": "{build.VERSION}"', zf.read("monai/_version.py").decode())
            self.assertIn(f"\nVersion: {build.VERSION}\n", zf.read(f"{info}/METADATA").decode())
            self.assertIn("def cache_key", zf.read("monai/data/dataset.py").decode())
            self.assertIn("def transforms_hashing", zf.read("monai_sharedcache/keys.py").decode())
            rows = list(csv.reader(io.StringIO(zf.read(f"{info}/RECORD").decode())))
            self.assertEqual({r[0] for r in rows}, names)
            for name, digest, size in rows:
                if name.endswith("RECORD"):
                    self.assertEqual((digest, size), ("", ""))
                    continue
                data = zf.read(name)
                self.assertEqual(build._record_hash(data), digest, name)
                self.assertEqual(int(size), len(data), name)
            self.assertFalse([n for n in names if "1.6.1.dist-info" in n or "__pycache__" in n])

    def test_reproducible(self):
        with tempfile.TemporaryDirectory() as tmp:
            again = Path(tmp) / build.build_wheel(tmp)
            self.assertEqual(again.read_bytes(), self.wheel.read_bytes())

    def test_sdist(self):
        name = build.build_sdist(self.tmp)
        with tarfile.open(Path(self.tmp) / name) as tf:
            names = tf.getnames()
        base = f"monai-{build.VERSION}"
        for member in (
            "PKG-INFO",
            "pyproject.toml",
            "build_backend/monai_sharedcache_build.py",
            "monai_sharedcache/store.py",
        ):
            self.assertIn(f"{base}/{member}", names)
        self.assertTrue(any(n.startswith(f"{base}/patches/") for n in names))


@unittest.skipIf(QUICK or MODE, "slow: builds and installs into a new venv (in the default run only)")
class TestInstall(unittest.TestCase):
    def test_pip_install_into_venv(self):
        """pip install --no-deps <checkout> into a new venv that sees this torch; import, run a CacheDataset, uninstall."""
        with tempfile.TemporaryDirectory() as tmp:
            venv = Path(tmp) / "venv"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            py = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            run = {"env": env, "capture_output": True, "text": True, "timeout": 600}
            where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
            purelib = Path(subprocess.run([py, "-c", where], **run).stdout.strip())
            # the torch of the interpreter that runs these tests, a venv's as a newcomer has it or a system one: its
            # site directories come after the new venv's own, as --system-site-packages would add the base's
            import site

            theirs = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
            (purelib / "outer-site.pth").write_text("".join(f"{p}\n" for p in theirs))
            src = Path(tmp) / "src"  # a copy without build/ output, as a fresh checkout has
            shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "dist", ".git", "__pycache__"))
            pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
            proc = subprocess.run([*pip, "install", "--no-deps", str(src)], **run)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            code = (
                "import monai, os; from monai.data import CacheDataset; from monai.transforms import Compose, Lambda\n"
                "ds = CacheDataset(list(range(6)), Compose([Lambda(lambda x: x * 2)]), runtime_cache='process')\n"
                "assert [ds[i] for i in range(6)] == [0, 2, 4, 6, 8, 10]\n"
                "assert os.path.dirname(monai.__file__).startswith(os.environ['VIRTUAL_ENV'])\n"
                "print(monai.__version__)"
            )
            proc = subprocess.run([py, "-c", code], **{**run, "env": {**env, "VIRTUAL_ENV": str(venv)}}, cwd=tmp)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertEqual(proc.stdout.strip(), build.VERSION)
            proc = subprocess.run([*pip, "uninstall", "-y", "monai"], **run)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertEqual([p.name for p in purelib.iterdir() if p.name.lower().startswith("monai")], [])


@unittest.skipIf(shutil.which("git") is None, "needs git")
class TestPRSeries(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.signoff = "A Tester <tester@example.org>"  # the test's own identity, as an exporter passes theirs
        cls.written = build.export_series(Path(cls.tmp) / "pr", signoff=cls.signoff)
        cls.stages = build.read_series()
        cls.summary = {row["name"]: row for row in json.loads((Path(cls.tmp) / "pr" / "series.json").read_text())}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_series_files(self):
        """Issue 57's rules: at most 5 PRs, 400 lines added under monai/ in all, no OS machinery, the exporter's sign-off."""
        names = [p.name for p in self.written]
        self.assertEqual(names, [f"{st.name}{ext}" for st in self.stages for ext in (".patch", ".md")])
        self.assertEqual([st.name[:3] for st in self.stages], [f"{n:02d}-" for n in range(1, len(self.stages) + 1)])
        self.assertLessEqual(len(self.stages), build.MAX_PRS)
        added = 0
        for st in self.stages:
            row = self.summary[st.name]
            self.assertLessEqual(row["code"], build.CODE_CAP, st.name)
            text = (Path(self.tmp) / "pr" / f"{st.name}.patch").read_text()
            self.assertTrue(text.startswith(f"From: {self.signoff}\n"), st.name)
            message = text.split("\n\n", 1)[1].split("\nSigned-off-by: ")[0]  # the commit message under the subject
            self.assertRegex(message, r"What: .+\n(.+\n)*\nWhy", st.name)
            self.assertIn(f"\nSigned-off-by: {self.signoff}\n\ndiff --git ", text)  # MONAI's DCO check
            self.assertNotIn("b/tests/fork/", text)  # the fork's own tests stay here
            self.assertNotIn("b/tests/test_utils.py", text)  # MONAI has its own
            self.assertNotIn("monai_sharedcache", text)  # upstream never names the package
            for fp in build.parse_patch(text[text.index("diff --git") :], st.name):
                if fp.path.startswith("monai/"):
                    self.assertNotEqual(fp.old, "/dev/null", f"{st.name} adds a module: {fp.path}")
            plus = [line for path, line in build._added_lines(text) if path.startswith("monai/")]
            added += len(plus)
            for line in plus:
                self.assertIsNone(build.OS_MACHINERY.search(line), f"{st.name}: {line}")
            md = (Path(self.tmp) / "pr" / f"{st.name}.md").read_text()
            self.assertIn("changed lines", md)
            self.assertNotIn("{{", md)
            self.assertNotIn("sharedcache", md)  # numbers and names of the fork's own builds never reach a PR
            for section in ("## What changes", "## Why", "## Tests", "## Diffstat"):
                self.assertIn(section, md, st.name)
        self.assertLessEqual(added, build.SERIES_MONAI_CAP)

    def test_no_signoff_no_export(self):
        """The export is signed off by whoever exports it, never by a made-up address: none known is an error."""
        with (
            mock.patch.dict(os.environ, {build.SIGNOFF_ENV: ""}),
            mock.patch.object(build.subprocess, "run", return_value=subprocess.CompletedProcess([], 1, "", "")),
        ):
            with self.assertRaisesRegex(build.BuildError, "signed off by whoever exports it"):
                build.exporter()
        self.assertEqual(build.exporter("A B <a@b.org>"), "A B <a@b.org>")
        with self.assertRaisesRegex(build.BuildError, "Name <email>"):
            build.exporter("nobody")

    def test_later_names_are_caught(self):
        """The export refuses a PR that mentions a name which only a later PR adds."""
        stages = build.read_series()
        later = next(st for st in stages if st.provides and st.number > 2)
        stages[0].provides = []
        with mock.patch.object(build, "read_series", return_value=stages):
            with tempfile.TemporaryDirectory() as tmp:
                bad = Path(tmp) / "src"
                shutil.copytree(ROOT, bad, ignore=shutil.ignore_patterns("build", "dist", ".git", "__pycache__"))
                first = bad / "patches" / stages[0].patches[0]
                text = first.read_text()
                first.write_text(
                    text.replace(
                        "+        # as a Python sequence", f"+        # {later.provides[0]}: as a Python sequence", 1
                    )
                )
                with self.assertRaisesRegex(
                    build.BuildError, f"mentions {later.provides[0]!r}, which only {later.name}"
                ):
                    build.export_series(Path(tmp) / "out", src_root=bad, signoff=self.signoff)

    @unittest.skipIf(QUICK or MODE, "slow: runs every stage's tests against its own tree (in the default run only)")
    def test_each_stage_applies_and_passes_its_tests(self):
        """
        Apply the PRs in turn to one unpacked upstream wheel; after each, lint the files of ``monai/`` it changes with
        MONAI's flake8 configuration (an import that only a later PR uses is caught at its stage), and run its exported
        tests there as MONAI's CI runs a PR: unittest in MONAI's layout (tests/data/, the stand-in of
        tests/test_utils.py), ``QUICKTEST=True``, but for the DistCall tests. The main pass runs every test, slow and
        fork-only ones included, against the whole series.
        """
        tree = Path(self.tmp) / "upstream"
        with zipfile.ZipFile(build.find_upstream_wheel()) as zf:
            zf.extractall(tree)
        (tree / "tests" / "data").mkdir(parents=True)
        for init in ("tests/__init__.py", "tests/data/__init__.py"):
            (tree / init).write_text("")
        shutil.copyfile(ROOT / "tests" / build.TEST_UTILS, tree / "tests" / build.TEST_UTILS)
        env = {**os.environ, "PYTHONPATH": str(tree), "QUICKTEST": "True"}
        for st in self.stages:
            patch = str(Path(self.tmp) / "pr" / f"{st.name}.patch")
            cmd = ["git", "apply", "--include=monai/*", "--include=tests/*", patch]
            proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
            self.assertEqual(proc.returncode, 0, f"{st.name}: {proc.stderr}")
            text = Path(patch).read_text()
            files = sorted({ln[6:] for ln in text.splitlines() if ln.startswith("+++ b/monai/") and ln.endswith(".py")})
            cmd = [sys.executable, "-m", "flake8", "--config", str(ROOT / "setup.cfg"), *files]
            proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600)
            self.assertEqual(proc.returncode, 0, f"{st.name}, MONAI's flake8: {proc.stdout}{proc.stderr}")
            # the DistCall tests (*_dist.py) run against the whole series in the series pass, and per PR in
            # --upstream-ci: 2 ranks each take a minute here, with little to tell between stages
            modules = [f"tests.data.{t[:-3]}" for t in st.tests if not t.endswith("_dist.py")]
            cmd = [sys.executable, "-m", "unittest", *modules]
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
            self.assertEqual(proc.returncode, 0, f"{st.name}: " + proc.stdout[-3000:] + proc.stderr[-6000:])
            self.assertRegex(proc.stderr, r"Ran [1-9]\d* test")
            code = "import monai.data, sys; sys.stdout.write(monai.data.__file__)"
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
            self.assertTrue(out.stdout.startswith(str(tree)), out.stdout + out.stderr)


if __name__ == "__main__":
    unittest.main()
