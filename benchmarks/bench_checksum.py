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
What the checksums of a persistent store on a disk cost (``PYTHONPATH=build/tree python benchmarks/bench_checksum.py
[--small] [--reps 15]``), on the item of ``bench_cache.py`` (a dict of two MetaTensors, 145 MiB; 9.6 MiB with
``--small``), in one process:

1. each checksum that ``monai_sharedcache.checksum`` could use (zlib's CRC-32, hashlib's blake2b, xxhash's XXH3-64),
   over the item file, in the page cache: the median time and throughput of ``--reps`` runs;
2. the first read of the item in a run (a new session of the store: read + 96³ random crop + collate-like copy), as
   the persistent section's restart times it, through two persistent stores in ``benchmarks/output/checksum``: the
   fork's store, which checks the item's bytes at that read, and the same store with the check turned off (the
   core's ``verified``, as before the checksums); interleaved round by round, each first in every other round. Every
   round closes and opens both stores, so each read is the first of a session, through a fresh mapping.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import hit, inputs, standalone, transforms  # noqa: E402


def _algorithms(path: str, reps: int) -> None:
    algorithms = {"crc32 (zlib)": zlib.crc32, "blake2b (hashlib)": lambda b: hashlib.blake2b(b).digest()}
    try:
        import xxhash

        algorithms["xxh3_64 (xxhash)"] = xxhash.xxh3_64_intdigest
    except ImportError:
        print("  xxhash is not installed: not measured")
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        for name, fn in algorithms.items():
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn(m)
                times.append(time.perf_counter() - start)
            med = statistics.median(times)
            print(f"  {name:18s} {med * 1e3:8.2f} ms  {size / med / 1e9:6.2f} GB/s  ({size / 2**20:.0f} MiB)")


def main() -> None:
    args, shape, roi = standalone(__doc__.splitlines()[1], 15)
    from monai.data import CacheDataset, SharedCacheStore, cache_store

    class Unchecked(SharedCacheStore):
        verified = cache_store.SharedCacheStore.verified  # the core's: no check

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")
    tr, _ = transforms(roi, False)
    data = inputs({"data_dir": os.path.join(here, "data"), "shape": shape}, 1)
    base = os.path.join(here, "checksum")
    shutil.rmtree(base, ignore_errors=True)
    kinds = {"checked": SharedCacheStore, "unchecked": Unchecked}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    try:
        for r in range(1 + args.reps):
            for name in names if r % 2 else names[::-1]:  # each first in every other round: no order bias
                store = kinds[name](os.path.join(base, name), persistent=True)  # a new session: a first read
                ds = CacheDataset(data, tr, runtime_cache=store, progress=False)
                start = time.perf_counter()
                hit(ds, 0)
                if r >= 1:  # the first round computes and writes the item
                    times[name].append(time.perf_counter() - start)
                store.close()
        (item,) = [n for n in os.listdir(os.path.join(base, "checked")) if n.endswith(".item")]
        print("checksums of the item file, in the page cache (medians):")
        _algorithms(os.path.join(base, "checked", item), args.reps)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"first read of the item in a run + crop + copy, {args.reps} interleaved rounds, medians:")
    for name, ms in med.items():
        print(f"  {name:10s} {ms:7.2f} ms")
    print(f"  checked / unchecked: {med['checked'] / med['unchecked']:.3f}x")


if __name__ == "__main__":
    main()
