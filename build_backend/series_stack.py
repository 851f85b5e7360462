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
A developer's tool: edit the patch series as a git stack, so that a change to an early PR flows into the later ones
by git's three-way merges instead of hand-edited context.

    python3 build_backend/series_stack.py init DIR    # DIR: upstream, then the overlay, then one commit per patch
    (cd DIR && git rebase -i ...)                      # edit any commit; resolve what conflicts
    python3 build_backend/series_stack.py export DIR  # write the overlay and patches/ back (descriptions kept)

An overlay module is written as it is at the last patch of the stage that adds it (``docs/pr/series.ini``), and that
stage's patches do not diff it.
"""

import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import monai_sharedcache_build as b  # noqa: E402

SRC = Path(__file__).resolve().parent.parent
REPO = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("build/stack")


def git(*args: str) -> str:
    cmd = ["git", "-C", str(REPO), "-c", "user.name=stack", "-c", "user.email=stack@invalid", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def init() -> None:
    shutil.rmtree(REPO, ignore_errors=True)
    b.unpack_upstream(b.find_upstream_wheel(), REPO)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "upstream")
    for rel in b._overlay_files(SRC):
        (REPO / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SRC / rel, REPO / rel)
    git("add", "-A")
    git("commit", "-qm", "overlay")
    for patch in b.patch_files(SRC / b.PATCHES):
        b.apply_patch(REPO, patch)
        git("add", "-A")
        git("commit", "-qm", patch.name)


def export() -> None:
    commits = [line.split(" ", 1) for line in git("log", "--format=%H %s", "--reverse").splitlines() if line]
    if commits[1][1] != "overlay":
        raise SystemExit("the second commit of the stack must be the overlay")
    stages = b.read_series(SRC)
    by_name = {name: h for h, name in commits[2:]}
    owner = {rel: (st.patches[-1] if st.patches else None) for st in stages for rel in st.overlay}
    stage_of = {p: st for st in stages for p in st.patches}
    for rel in b._overlay_files(SRC):
        at = by_name.get(owner.get(str(rel)) or "") or commits[1][0]
        (SRC / rel).write_text(git("show", f"{at}:{rel}"))
    for h, name in commits[2:]:
        patch = SRC / b.PATCHES / name
        header, diffs = b._strip_header(patch.read_text())
        order = [fp.path for fp in b.parse_patch(diffs, name)]
        files = [f for f in git("diff", "--name-only", f"{h}~1", h).splitlines() if f]
        files = sorted(files, key=lambda f: order.index(f) if f in order else len(order))

        def show(commit: str, rel: str) -> str:
            try:
                return git("show", f"{commit}:{rel}")
            except subprocess.CalledProcessError:
                return ""

        parts = [b.make_patch(f, show(f"{h}~1", f), show(h, f)) for f in files if f not in stage_of[name].overlay]
        if header + "".join(parts) != patch.read_text():
            patch.write_text(header + "".join(parts))
            print("wrote", patch.name)


if __name__ == "__main__":
    {"init": init, "export": export}[sys.argv[1]]()
