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
The passes of ``./runtests.sh --unittests --mode spawn|nofcntl`` run only the tests whose behaviour can differ there;
``--mode series`` runs the package's tests and the series' own (not ``tests/fork/``) on MONAI with the series alone. The
no-``fcntl`` pass runs every test but those below (``_EVERY_MODE``), which start no process and use no store, or pin the
start method of each process they start, and but the tests of containers (``_CONTAINERS``) in other modes than
``"process"``: they use no store, so they run there as in the default pass (and, those of workers, in the spawn pass).
The spawn pass runs only the tests in ``_SPAWN``: the series' tests whose DataLoader workers take the default start
method (MONAI's CI runs them on macOS and Windows, where it is spawn), and one test for each way that a process of the
default start method uses the store: a worker that reads it, one that writes past its cap, one that claims, a killed
creator, a persistent store filled by workers, a small ``/dev/shm``. The list was taken by running every test with
``forkserver`` as the default start method and recording the class of each process started (a process of a pinned
context is a ``ForkProcess`` or ``SpawnProcess``, one of the default context is not), then keeping one test per path:
the others of those paths (mounts, PID namespaces, killed writers of a persistent store) differ from them only in what
the default pass tests with fork. Add a test here if it starts such a process on a new path. The series pass leaves the
package's tests that build no dataset (``_TREE_INDEPENDENT``) to the default pass: they run the same code on either
tree, and the default pass leaves the package's tests of keys across interpreter runs (``_ACROSS_RUNS``) to the series
pass. Not for MONAI's CI: this file is not exported.
"""

from __future__ import annotations

import os

import pytest

_EVERY_MODE = (
    "tests/fork/test_fork_build.py",  # the build and the series: no process of the cache
    "tests/fork/test_fork_guard.py",
    "tests/fork/test_conventions.py",
    "tests/layer/test_layering.py",  # the layering: reads sources, and imports monai in one interpreter
    "tests/layer/test_keys.py",  # keys: in-process, and interpreters started by subprocess
    "tests/layer/test_digests.py",  # interpreters started by subprocess, no DataLoader worker
    "tests/layer/test_keys_extended.py",  # interpreters started by subprocess, no DataLoader worker
    "tests/fork/test_runtime_cache_extended.py::TestSizing::test_concurrent_resize",  # fork if it can; a ListProxy
)
# the tests of containers (lists, ListProxy, threads): the series' and the fork's
_CONTAINERS = ("tests/test_", "tests/fork/test_runtime_cache_extended.py")
_SPAWN = (
    "tests/fork/test_store_extended.py::TestLifetime::test_killed_participant_does_not_keep_store",
    "tests/fork/test_store_extended.py::TestLifetime::test_live_participant_in_other_process_keeps_store",
    "tests/layer/test_persistent_extended.py::TestPersistentRuns::test_reads_set_access_times_on_noatime_mounts",
    "tests/layer/test_persistent_extended.py::TestPersistentRuns::test_run_killed_mid_fill",
    "tests/fork/test_store_small_shm.py::TestSmallDevShm::test_every_epoch_completes_with_correct_items",
    "tests/layer/test_cache_store_claims.py::TestClaims::test_killed_claimant_releases_claim_at_once",
    "tests/layer/test_cache_store_claims.py::TestClaims::test_processes_compute_each_key_once",
    "tests/layer/test_cache_store.py::TestLeftovers::test_killed_creator_removed_at_once",
    "tests/layer/test_cache_store.py::TestLeftovers::test_store_in_use_kept",
    "tests/layer/test_cache_store.py::TestLeftovers::test_temp_files_of_writers",
    "tests/layer/test_max_bytes.py::TestMaxBytes::test_cap_refuses_past_max_bytes",
    "tests/layer/test_persistent.py::TestPersistentStore::test_two_runs_of_a_dataset_1",
    # an empty ListProxy (#5633's crash); its other lengths differ in the main process only
    "tests/test_cachedataset_runtime_cache_size.py::TestCacheDatasetRuntimeCacheSize::test_resized_and_read_by_workers_3",
    "tests/test_cachedataset_hash_as_key_runtime_cache.py",
    "tests/test_cachedataset_set_data_runtime_cache.py::TestCacheDatasetSetDataRuntimeCache::test_set_data_resyncs",
    "tests/test_cachedataset_keyed_runtime_cache.py::TestCacheDatasetKeyedRuntimeCache::test_manager_dict_in_workers",
    "tests/fork/test_runtime_cache_extended.py::TestWorkerWarning::test_worker_warning_from_a_real_worker",
    "tests/layer/test_create_shared_cache.py::TestCreateSharedCache::test_without_a_process_group_a_local_store",
)

# the series' tests of what the fork's wheel does otherwise, on purpose: its containers' slots hold (key, item), so an
# item that the user put in a slot is never served, and a read-only container is refused at once, with a TypeError
# (tests/fork/test_runtime_cache_extended.py tests that instead)
_FORK_DIFFERS = (
    "tests/test_cachedataset_runtime_cache_size.py::TestCacheDatasetRuntimeCacheSize::test_filled_read_only",
    "tests/test_cachedataset_set_data_runtime_cache.py::TestCacheDatasetSetDataRuntimeCache::test_read_only_container",
    # and a keyed cache without hash_transform gets the package's exact keys instead of a ValueError
    "tests/test_cachedataset_keyed_runtime_cache.py::TestCacheDatasetKeyedRuntimeCache::test_needs_hash_transform",
)


# the package's tests that build no dataset: they run the same code on either tree, so the series pass leaves them to
# the default one
_TREE_INDEPENDENT = (
    "tests/layer/test_cache_store.py",
    "tests/layer/test_cache_store_claims.py",
    "tests/layer/test_fast_path.py",
    "tests/layer/test_max_bytes.py",
    "tests/layer/test_memory_limit.py",
    "tests/layer/test_store_faults.py",
)


# the package's tests of keys across interpreter runs: their scripts pass the store's hash_func and hash_transform, so
# the keys are the same on either tree; the series pass runs them, where the package meets upstream's CacheDataset
_ACROSS_RUNS = (
    "tests/layer/test_keys_extended.py::TestKeysAcrossRuns",
    "tests/layer/test_digests.py::TestDigestsAcrossRuns",
    "tests/layer/test_real_pipelines.py::TestAcrossRuns",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = os.environ.get("MONAI_SHAREDCACHE_TEST_MODE", "")
    keep, drop = [], []
    for item in items:  # node ids are relative to the repository (runtests.sh runs pytest there)
        if mode == "series":  # MONAI with the series alone: the package's tests and the series', not the fork's
            runs = not item.nodeid.startswith(("tests/fork/",) + _TREE_INDEPENDENT)
        elif item.nodeid.startswith(_FORK_DIFFERS + _ACROSS_RUNS):
            runs = False
        elif mode not in ("spawn", "nofcntl"):
            runs = True
        elif mode == "spawn":
            runs = item.nodeid.startswith(_SPAWN)
        else:  # the tests of containers use a store only as the fork's runtime_cache="process"
            containers = item.nodeid.startswith(_CONTAINERS)
            runs = not item.nodeid.startswith(_EVERY_MODE) and (not containers or "process" in item.nodeid)
        (keep if runs else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
