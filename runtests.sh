#!/usr/bin/env bash
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
#
# The test and developer entry point of the MONAI shared-cache fork, with MONAI's flag names.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}
BUILD="$PY build_backend/monai_sharedcache_build.py"
TREE=build/tree

usage() {
    cat <<'USAGE'
usage: ./runtests.sh [--unittests] [--quick] [--mode MODE] [--codeformat] [--docs] [--export-patch]
                     [--upstream-tests DIR] [--upstream-ci DIR] [--build] [--clean] [-h]

  --unittests     lay out the patched tree if needed and run every test against it (multi-process ones included);
                  installs what requirements-dev.txt lists if it is missing (install torch for your machine first)
  --quick         with --unittests: skip the slow tests (sets QUICKTEST=True, as MONAI's CI does)
  --mode MODE     with --unittests: default, spawn (every process starts its children with spawn, as on macOS and
                  Windows), nofcntl (also a Python where `import fcntl` fails, as on Windows; see tests/modes/), or
                  series (the package's tests, tests/layer/, and the series' own, on MONAI 1.6.1 with the upstream
                  series alone: no fork patch, as a user who installs the package on such a MONAI has it)
  --codeformat    black (120), isort, flake8 and mypy on the overlay, build backend, tests and patched files
  --docs          build the Sphinx docs with warnings as errors (docs/build/html) and run every recipe of the tutorials companion
  --export-patch  write the upstream PR series: dist/pr/NN-<slug>.patch and dist/pr/NN-<slug>.md (docs/pr/series.ini)
  --upstream-tests DIR
                  run MONAI's own dataset tests, from a checkout of MONAI's repository at DIR, unchanged against
                  the laid-out tree in a scratch directory outside the repo (every tests/data/test_*dataset*.py,
                  test_sampler_dist.py) with unittest, as MONAI runs them; prints each file's summary
  --upstream-ci DIR
                  lay the PR series onto MONAI's layout (DIR's tests/ and docs/ with 1.6.1's monai/) in a scratch
                  directory, PR by PR, as MONAI's CI would take it: sizes, forbidden tokens, MONAI's flake8
                  configuration and plugins, every new test file with unittest and QUICKTEST=True, default, spawn
                  and nofcntl; a line per PR and per file (build_backend/upstream_ci.py); with -- --wheel weekly,
                  onto MONAI's development branch (the newest monai-weekly wheel) instead of the 1.6.1 release
  --build         build the wheel and sdist into dist/
  --clean         remove build/, dist/ and caches
  -h, --help      this help

Extra arguments after -- go to pytest, e.g. ./runtests.sh --unittests -- -k hash_as_key
(with --upstream-ci, to build_backend/upstream_ci.py, e.g. -- --wheel weekly)
USAGE
}

unittests=0 quick=0 codeformat=0 docs=0 export=0 build=0 clean=0 upstream="" upstream_ci="" mode=default
extra=()
[ $# -eq 0 ] && { usage; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --unittests) unittests=1 ;;
        --quick) quick=1 ;;
        --mode) shift; mode="${1:?--mode needs default, spawn or nofcntl}" ;;
        --upstream-ci) shift; upstream_ci="${1:?--upstream-ci needs the path of a MONAI checkout}" ;;
        --codeformat) codeformat=1 ;;
        --docs) docs=1 ;;
        --export-patch) export=1 ;;
        --upstream-tests) shift; upstream="${1:?--upstream-tests needs the path of a MONAI checkout}" ;;
        --build) build=1 ;;
        --clean) clean=1 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

ensure_deps() {
    # install requirements-dev.txt only if something is missing, so an existing torch is kept
    if ! $PY - "$@" <<'PYCHECK' 2>/dev/null; then
import importlib.util, sys
mods = sys.argv[1:]
sys.exit(any(importlib.util.find_spec(m) is None for m in mods))
PYCHECK
        echo "runtests.sh: installing requirements-dev.txt"
        $PY -m pip install -q --disable-pip-version-check -r requirements-dev.txt
    fi
}

layout() {
    $BUILD layout "$TREE" --if-stale
}

if [ $clean -eq 1 ]; then
    rm -rf build dist .pytest_cache .mypy_cache docs/build
    find . -name __pycache__ -type d -prune -exec rm -rf {} +
    echo "cleaned"
fi

if [ $build -eq 1 ]; then
    ensure_deps build
    $PY -m build --outdir dist .
fi

if [ $codeformat -eq 1 ]; then
    ensure_deps black isort flake8 mypy
    layout
    # the upstream files our patches change, as paths inside the laid-out tree
    patched=$($PY - <<'PYFILES'
import sys
sys.path.insert(0, "build_backend")
import monai_sharedcache_build as b
files = set()
for p in b.all_patches():
    files.update(fp.path for fp in b.parse_patch(p.read_text(), p.name))
print(" ".join(sorted(files)))
PYFILES
)
    overlay=$(find $(ls -d monai monai_sharedcache 2>/dev/null) -name "*.py" | sort)  # no monai/ overlay now
    # our Python files: what git tracks or would track (generated output is git-ignored)
    if git rev-parse --git-dir >/dev/null 2>&1; then
        ours=$(git ls-files --cached --others --exclude-standard -- '*.py' |
            while read -r f; do [ -f "$f" ] && echo "$f"; done)
    else
        ours=$(find monai build_backend tests benchmarks examples docs -name '*.py' -not -path '*/output/*' \
            -not -path '*/build/*' -not -path 'examples/data/*' 2>/dev/null)
    fi
    tree_patched=$(for f in $patched; do printf '%s ' "$TREE/$f"; done)
    echo "== black";  $PY -m black --check --quiet --line-length 120 $ours $tree_patched
    echo "== isort";  $PY -m isort --check-only --quiet --settings-path setup.cfg $ours $tree_patched
    # MONAI's flake8 configuration and plugins (setup.cfg), on our files and on the upstream files we patch
    echo "== flake8"; $PY -m flake8 --config setup.cfg $ours $tree_patched
    # mypy inside the laid-out package, so that the overlay is checked against the real upstream modules
    # the overlay modules that later patches change are in both lists: each once
    echo "== mypy";   (cd "$TREE" && $PY -m mypy --config-file ../../setup.cfg $(printf '%s\n' $overlay $patched | sort -u))
    $PY -m mypy --config-file setup.cfg build_backend
    echo "codeformat: ok"
fi

if [ $docs -eq 1 ]; then
    ensure_deps sphinx
    layout
    PYTHONPATH="$PWD/$TREE" $PY -m sphinx -W --keep-going -q -b html docs/source docs/build/html
    echo "docs: built docs/build/html; running every recipe of the tutorials companion"
    $PY tutorials/run_recipes.py
fi

if [ $export -eq 1 ]; then
    layout
    $BUILD export-patch
fi

if [ -n "$upstream_ci" ]; then
    ensure_deps torch numpy parameterized
    $PY build_backend/upstream_ci.py "$upstream_ci" ${extra[@]+"${extra[@]}"}
    exit $?
fi

if [ -n "$upstream" ]; then
    ensure_deps torch numpy pytest pytest_timeout parameterized nibabel xxhash
    layout
    [ -d "$upstream/tests/data" ] || { echo "no tests/data in $upstream: not a MONAI checkout" >&2; exit 2; }
    # what MONAI's dataset tests import beyond ours (CSV, LMDB, ignite), as the checkout's requirements-dev.txt pins it;
    # lmdb below 2: with lmdb 2 and later, pristine 1.6.1's LMDBDataset tests fail too ("already open in this process")
    if ! $PY -c "import pandas, ignite, lmdb, sys; sys.exit(int(lmdb.__version__.split('.')[0]) >= 2)" 2>/dev/null; then
        pins=$(grep -Ei '^(pandas|pytorch-ignite)([<>=!~ ;]|$)' "$upstream/requirements-dev.txt" | sed 's/[[:space:]]*#.*//')
        pins="$pins lmdb<2"
        echo "runtests.sh: installing what MONAI's dataset tests need:" $pins
        # shellcheck disable=SC2086
        $PY -m pip install -q --disable-pip-version-check $pins
    fi
    scratch=$(mktemp -d) repo=$PWD
    trap 'rm -rf "$scratch"' EXIT
    cp -r "$upstream/tests" "$scratch/tests"  # a copy outside the repo: MONAI's tests are never committed here
    status=0
    # with unittest, as MONAI's own runner does (pytest would also collect helpers named test_*)
    for f in $(cd "$scratch" && ls tests/data/test_*dataset*.py tests/data/test_sampler_dist.py | sort -u); do
        module=${f%.py}
        out=$(cd "$scratch" && PYTHONPATH="$repo/$TREE:$scratch" timeout 1800 $PY -m unittest "${module//\//.}" 2>&1) ||
            status=1
        echo "$f: $(echo "$out" | grep -E '^Ran [0-9]+ test' | tail -n 1); $(echo "$out" | tail -n 1)"
    done
    exit $status
fi

if [ $unittests -eq 1 ]; then
    ensure_deps torch numpy pytest pytest_timeout parameterized nibabel pydicom tqdm xxhash
    layout
    args=(-p no:cacheprovider --timeout=900)
    [ $quick -eq 1 ] && export QUICKTEST=True
    case "$mode" in
        default) modepath="" ;;
        series) # MONAI 1.6.1 + the series + the package, without patches/fork/: the package needs no more than that
            $BUILD pristine build/series --upto fork- >/dev/null
            TREE=build/series modepath=""
            args+=(--ignore=tests/fork)  # the fork's wheel's tests import names that the series alone has not
            export MONAI_SHAREDCACHE_TEST_MODE=series ;;
        spawn|nofcntl) modepath="$PWD/tests/modes/$mode:"; export MONAI_SHAREDCACHE_TEST_MODE=$mode ;;
        *) echo "unknown --mode $mode: default, spawn or nofcntl" >&2; exit 2 ;;
    esac
    echo "runtests.sh: unittests, mode $mode${QUICKTEST:+, QUICKTEST=$QUICKTEST}"
    PYTHONPATH="$modepath$PWD/$TREE${PYTHONPATH:+:$PYTHONPATH}" $PY -m pytest "${args[@]}" tests "${extra[@]}"
fi
