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
``./runtests.sh --upstream-ci DIR``: take the PR series as MONAI's CI would, on a checkout of MONAI's repository.

In a scratch directory outside the repository (nothing of MONAI's is ever written into it), MONAI's layout is made
from DIR's ``tests/``, ``docs/``, ``setup.cfg`` and ``requirements-dev.txt`` with the pinned 1.6.1 release's
``monai/``. Then each PR of ``dist/pr`` (exported afresh) is applied in turn with ``git apply``, and for each one:

- its size (changed lines of code and tests, and of docs) against the caps, and the tokens it must not add;
- MONAI's code format as its ``codeformat`` job checks it: black (DIR's ``pyproject.toml``), isort and flake8 (DIR's
  ``setup.cfg``, with the plugins that DIR's ``requirements-dev.txt`` pins), installed in a venv of the scratch
  directory, on every Python file the PR adds or changes, and MONAI's mypy configuration on its files under ``monai/``
  (what mypy says of other files is upstream's);
- every test file the PR adds, with ``python -m unittest tests.data.<module>`` and ``QUICKTEST=True``, as MONAI's
  ``quick-py3`` job runs it, three ways: the default start method, spawn (macOS, Windows), and a Python without
  ``fcntl`` (Windows), through ``tests/modes/``.
After the last PR, every test file of the series runs again the three ways. One line per PR, per check and per file;
the exit status is 1 if anything failed.

``--wheel weekly`` (or the path of a wheel) takes ``monai/`` from MONAI's development branch instead of the pinned
release: the newest ``monai-weekly`` wheel on the package index, which is where the series has to apply once it is
proposed. Such a wheel is a test input, never a build input: the fork itself builds from the pinned release only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import monai_sharedcache_build as build  # noqa: E402

MODES = ("default", "spawn", "nofcntl")
LINT_PACKAGES = re.compile(r"^(flake8\S*|pep8-naming\S*|black\S*|isort\S*|mypy\S*)")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _sizes(numstat: str) -> tuple[int, int]:
    """Changed lines (added and removed) of code and tests, and of docs, from ``git apply --numstat``."""
    code = docs = 0
    for line in numstat.splitlines():
        added, removed, name = line.split("\t", 2)
        changed = sum(int(n) for n in (added, removed) if n.isdigit())
        if name.startswith(("monai/", "tests/")):
            code += changed
        elif name.startswith("docs/"):
            docs += changed
    return code, docs


def weekly_wheel(dest: Path) -> Path:
    """The newest ``monai-weekly`` wheel (MONAI's development branch, built weekly), downloaded into ``dest``."""
    args = ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q"]
    proc = _run([sys.executable, *args, "-d", str(dest), "monai-weekly"], timeout=900)
    wheels = sorted(dest.glob("monai_weekly-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise SystemExit(f"cannot download monai-weekly from the package index: {proc.stderr.strip()[-2000:]}")
    return wheels[-1]


def make_layout(checkout: Path, scratch: Path, upstream: Path | None = None) -> Path:
    """
    MONAI's layout in ``scratch/repo``: the checkout's tests, docs and configuration with the ``monai/`` of the
    wheel ``upstream``, by default the pinned 1.6.1 release (verified by its sha256).
    """
    repo = scratch / "repo"
    repo.mkdir()
    for name in ("tests", "docs"):
        shutil.copytree(checkout / name, repo / name, ignore=shutil.ignore_patterns("__pycache__", "_build", "build"))
    for name in ("setup.cfg", "requirements-dev.txt", "pyproject.toml"):
        if (checkout / name).is_file():
            shutil.copyfile(checkout / name, repo / name)
    wheel = scratch / "wheel"
    upstream = upstream or build.find_upstream_wheel()
    build.unpack_upstream(upstream, wheel)
    shutil.copytree(wheel / "monai", repo / "monai")
    print(f"MONAI's layout: tests and docs of {checkout}, monai/ of {upstream.name}")
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@invalid", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", f"{upstream.name} in MONAI's layout"]):
        _run(git + cmd, cwd=repo, check=True)
    return repo


def lint_python(checkout: Path, scratch: Path) -> str:
    """A venv with black, isort, flake8 and the flake8 plugins that MONAI's requirements-dev.txt pins; its python."""
    specs = []
    for line in (checkout / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if LINT_PACKAGES.match(line):
            specs.append(line)
    env_dir = scratch / "lint-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = str(env_dir / ("Scripts" if os.name == "nt" else "bin") / "python")
    proc = _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *specs], timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"cannot install MONAI's flake8 plugins {specs}: {proc.stderr[-2000:]}")
    code = "import black as b, isort as i, flake8 as f; print(b.__version__, i.__version__, f.__version__)"
    versions = "black {}, isort {}, flake8 {}".format(*_run([py, "-c", code]).stdout.split())
    plugins = " ".join(_run([py, "-m", "flake8", "--version"]).stdout.split("(", 1)[-1].split(")")[0].split())
    print(f"MONAI's pins {specs}: {versions} ({plugins})")
    return py


def run_tests(repo: Path, modules: list[str], label: str) -> bool:
    """Each test module with unittest and QUICKTEST=True, the three ways; a line for each."""
    ok = True
    for module in modules:
        for mode in MODES:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MONAI_SHAREDCACHE_TEST_MODE")}
            modes = [] if mode == "default" else [str(build.ROOT / "tests" / "modes" / mode)]
            env.update(QUICKTEST="True", PYTHONPATH=os.pathsep.join([*modes, str(repo)]))
            start = time.monotonic()
            try:
                proc = _run([sys.executable, "-m", "unittest", module], cwd=repo, env=env, timeout=3600)
                out = proc.stderr
                ran = re.findall(r"^Ran (\d+) tests?", out, re.M)
                verdict = (out.strip().splitlines() or ["no output"])[-1]
                good = proc.returncode == 0 and bool(ran) and verdict.startswith("OK")
            except subprocess.TimeoutExpired:
                ran, verdict, good, out = [], "TIMEOUT after 3600 s", False, ""
            ok &= good
            print(
                f"  {label} {module} [{mode}]: ran {ran[-1] if ran else 0}, {verdict} ({time.monotonic() - start:.0f} s)"
            )
            if not good:
                print("    " + "\n    ".join(out.strip().splitlines()[-40:]))
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else None)
    parser.add_argument("checkout", help="a checkout of MONAI's repository (tests/, docs/, setup.cfg)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory and print its path")
    parser.add_argument(
        "--wheel",
        help="take monai/ from this wheel instead of the pinned release; 'weekly' downloads the newest monai-weekly",
    )
    args = parser.parse_args(argv)
    checkout = Path(args.checkout).resolve()
    if not (checkout / "tests").is_dir() or not (checkout / "setup.cfg").is_file():
        print(f"{checkout} is not a checkout of MONAI's repository (no tests/ or setup.cfg)", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="monai-upstream-ci-"))
    if str(scratch).startswith(str(build.ROOT)):
        raise SystemExit("the scratch directory must be outside the repository")
    ok = True
    try:
        pr_dir = scratch / "pr"
        build.export_series(pr_dir)
        summary = {row["name"]: row for row in json.loads((pr_dir / "series.json").read_text())}
        upstream = None
        if args.wheel == "weekly":
            upstream = weekly_wheel(scratch / "weekly")
        elif args.wheel:
            upstream = Path(args.wheel).resolve()
            if not upstream.is_file() or upstream.suffix != ".whl":
                print(f"--wheel: {upstream} is not a wheel file; give a path or 'weekly'", file=sys.stderr)
                return 2
        repo = make_layout(checkout, scratch, upstream)
        lint = lint_python(checkout, scratch)
        all_modules: list[str] = []
        for st in build.read_series():
            patch = pr_dir / f"{st.name}.patch"
            stat = _run(["git", "apply", "--numstat", str(patch)], cwd=repo)
            applied = _run(["git", "apply", str(patch)], cwd=repo)
            code, docs = _sizes(stat.stdout)  # measured on MONAI's layout, not taken from the export's own count
            sizes = f"{code} lines of code and tests (cap {build.CODE_CAP}), {docs} of docs (cap {build.DOCS_CAP})"
            if st.max_lines is not None:
                sizes += f", {code + docs} in all (cap {st.max_lines})"
            good = applied.returncode == 0 and code <= build.CODE_CAP and docs <= build.DOCS_CAP
            good &= st.max_lines is None or code + docs <= st.max_lines
            if (code, docs) != (summary[st.name]["code"], summary[st.name]["docs"]):
                sizes += f" (the export counted {summary[st.name]['code']} and {summary[st.name]['docs']})"
            print(f"PR {st.name}: {'applies' if applied.returncode == 0 else 'DOES NOT APPLY'}; {sizes}")
            if applied.returncode != 0:
                print("  " + applied.stderr.strip())
                ok = False
                break
            added = [ln[1:] for ln in patch.read_text().splitlines() if ln.startswith("+") and not ln.startswith("+++")]
            bad = [t for t in st.forbids if any(t in ln for ln in added)]
            print(f"  forbidden tokens {st.forbids or '(none)'}: {'found ' + str(bad) if bad else 'none added'}")
            files = [ln.split("\t")[-1] for ln in stat.stdout.splitlines()]
            py_files = [f for f in files if f.endswith(".py") and (repo / f).is_file()]
            problems = []
            for tool in (["black", "--check", "--quiet"], ["isort", "--check-only", "--quiet"], ["flake8"]):
                proc = _run([lint, "-m", *tool, *py_files], cwd=repo) if py_files else None
                if proc is not None and proc.returncode != 0:
                    problems += [f"{tool[0]}: {ln}" for ln in (proc.stdout + proc.stderr).strip().splitlines()]
            code_files = [f for f in py_files if f.startswith("monai/")]
            if code_files:
                cmd = [lint, "-m", "mypy", "--config-file", "setup.cfg", "--python-executable", sys.executable]
                out = _run([*cmd, *code_files], cwd=repo).stdout
                problems += [f"mypy: {ln}" for ln in out.splitlines() if ln.split(":")[0] in code_files]
            verdict = "clean" if not problems else "PROBLEMS"
            print(f"  black, isort, flake8, mypy (MONAI's configuration) on {len(py_files)} files: {verdict}")
            for line in problems:
                print("    " + line)
            modules = [f"tests.data.{t[:-3]}" for t in st.tests]
            all_modules += modules
            good &= not bad and not problems and run_tests(repo, modules, f"PR {st.name[:2]}")
            ok &= good
        if ok:
            print("the full series:")
            ok &= run_tests(repo, all_modules, "all")
    finally:
        if args.keep:
            print(f"scratch directory kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print("upstream-ci: " + ("every PR applies, is within its caps, lint-clean and green" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
