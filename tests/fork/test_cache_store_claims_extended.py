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
The tests of PR 03's claims that do not fit its exported ``test_cache_store_claims.py``: a hit computes nothing, a
compute error releases the claim, a recursive compute of the same key, and a claim file that nobody holds.
"""

from __future__ import annotations

import errno
import os
import threading
import unittest
import warnings
from unittest import mock

from tests.layer import test_cache_store_claims as layer_tests  # not its test class, which pytest would run here again
from tests.layer.test_cache_store_claims import needs_store


@needs_store
class TestClaimsExtended(unittest.TestCase):
    setUp, new_store, claims = (
        layer_tests.TestClaims.setUp,
        layer_tests.TestClaims.new_store,
        layer_tests.TestClaims.claims,
    )

    def test_no_room_no_claims(self):
        """Past the reserve, an item is not stored: every thread that misses it computes it at once, none waits."""
        store = self.new_store(reserve=2**62)
        started, go = threading.Barrier(2, timeout=30), []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads = [
                threading.Thread(target=lambda: go.append(store.get_or_compute("k", started.wait))) for _ in "ab"
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        self.assertEqual(sorted(go), [0, 1])  # both computed it, at once (a waiter would break the barrier)
        self.assertEqual(len([w for w in caught if "past the budget" in str(w.message)]), 1)
        self.assertIsNone(store.get("k"))

    def test_hit_does_not_compute(self):
        store = self.new_store()
        store.put("k", 1)
        self.assertEqual(store.get_or_compute("k", lambda: 1 / 0), 1)

    def test_compute_error_propagates_and_releases_claim(self):
        store = self.new_store()
        with self.assertRaises(ZeroDivisionError):
            store.get_or_compute("k", lambda: 1 / 0)
        got = (self.claims(store), store.get("k"), store.get_or_compute("k", lambda: 2), store.get("k"))
        self.assertEqual(got, ([], None, 2, 2))  # released: computed and stored the next time
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with mock.patch.object(os, "pwrite", side_effect=OSError(errno.ENOSPC, "No space left")):
                self.assertEqual(store.get_or_compute("full", lambda: 3), 3)  # computed, not stored: a fault
        self.assertEqual((self.claims(store), store.get("full")), ([], None))

    def test_recursive_compute_of_same_key(self):
        store = self.new_store(claim_timeout=10)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a thread does not wait for its own claim, which would time out and warn
            self.assertEqual(store.get_or_compute("k", lambda: store.get_or_compute("k", lambda: 7) + 1), 8)
        self.assertEqual(store.get("k"), 8)

    def test_claim_file_without_holder_is_free(self):
        store = self.new_store(claim_timeout=10)
        os.makedirs(os.path.join(store.path, ".claims"), mode=0o700, exist_ok=True)
        open(os.path.join(store.path, ".claims", "k.claim"), "w").close()  # e.g. left by a process killed meanwhile
        self.assertEqual(store.get_or_compute("k", lambda: "computed"), "computed")
        self.assertEqual((store.get("k"), self.claims(store)), ("computed", []))


if __name__ == "__main__":
    unittest.main()
