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
The passes of ``./runtests.sh --unittests --mode spawn|nofcntl`` run only the tests whose behaviour can differ there:
what starts processes with the default start method, and what uses the store (or its fallback without ``fcntl``).
The tests below behave the same in every mode, so they run in the default pass alone (the file, or the file's
``::Class``): they start no process, or pin the start method of each one they start and use no store.
Not for MONAI's CI: this file is not exported.
"""

from __future__ import annotations

import os

import pytest

_EVERY_MODE = (
    "tests/fork/test_fork_build.py",  # the build and the series: no process of the cache
    "tests/fork/test_fork_guard.py",
    "tests/fork/test_conventions.py",
    "tests/test_cachedataset_keys.py",  # keys: in-process, and interpreters started by subprocess
    "tests/fork/test_keys_extended.py",  # interpreters started by subprocess, no DataLoader worker
    "tests/fork/test_runtime_cache_extended.py::TestSizing::test_concurrent_resize",  # fork if it can; a ListProxy
)
_SPAWN_ALSO = (
    # DataLoader workers under each start method by parameter, ranks by torch's spawn; no store (nofcntl differs:
    # "process" is then a Manager list)
    "tests/fork/test_runtime_cache_extended.py::TestSizing::test_dataloader",
    "tests/fork/test_runtime_cache_extended.py::TestNeverWrongOrStale",
    "tests/fork/test_runtime_cache_extended.py::TestFaults",
    "tests/fork/test_runtime_cache_extended.py::TestDistributed",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = os.environ.get("MONAI_SHAREDCACHE_TEST_MODE", "")
    if mode not in ("spawn", "nofcntl"):
        return
    skip = _EVERY_MODE + (_SPAWN_ALSO if mode == "spawn" else ())
    keep, drop = [], []
    for item in items:  # node ids are relative to the repository (runtests.sh runs pytest there)
        (drop if item.nodeid.startswith(skip) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
