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

from __future__ import annotations

import os
import tempfile
import unittest
from multiprocessing import Manager

from parameterized import parameterized
from torch.utils.data import DataLoader  # batch_size=None: the items as they are

from monai.data import CacheDataset
from monai.transforms import Compose, Transform


class Load(Transform):
    """Deterministic: appends each input that it computes to the file ``log``."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, x):
        with open(self.log, "a") as f:
            f.write(f"{x['id']}\n")
        return {"id": x["id"], "loaded": True}


class TestCacheDatasetHashAsKeyRuntimeCache(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.log = os.path.join(tmp.name, "log")

    def computed(self) -> list[int]:
        with open(self.log) as f:
            return sorted(int(x) for x in f.read().split())

    @parameterized.expand([(True,), ("thread",), ("process",), ("proxy",)])
    def test_duplicates_load_the_input_asked_for(self, mode):
        """#5633: with ``data=[a, a, b]``, item 2 was computed from ``data[1]``, and cached as ``b``'s item."""
        cache = mode
        if mode == "proxy":
            manager = Manager()
            self.addCleanup(manager.shutdown)
            cache = manager.list([None] * 3)
        data = [{"id": 1}, {"id": 1}, {"id": 5}, {"id": 7}, {"id": 5}]
        ds = CacheDataset(data, Compose([Load(self.log)]), hash_as_key=True, runtime_cache=cache)
        workers = 0 if mode in (True, "thread") else 2  # a list is private to the process that fills it
        loader = DataLoader(ds, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
        for _ in range(2):
            self.assertEqual([d["id"] for d in loader], [1, 1, 5, 7, 5])
        if workers:  # workers that miss one item at once may both compute it
            self.assertEqual(sorted(set(self.computed())), [1, 5, 7])
        else:
            self.assertEqual(self.computed(), [1, 5, 7])


if __name__ == "__main__":
    unittest.main()
