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
The store under load and faults (Linux; run with ``PYTHONPATH=build/tree``):

- ``writers``: puts at the cap of a store of 20,000 items, by 1 and by 4 processes at once: the slowest process's
  time for 100 puts, and the scans of the store that they made;
- ``redteam``: 6 processes for ``--seconds`` on 32 shared keys of a store whose cap holds 8 items: 4 writers that
  put, get, discard and clear, and check every item they read (its key and a CRC of its bytes), a reader that
  keeps its items mapped for a while, and a killer that SIGKILLs a writer at random and starts another. Then: the
  wrong items read, the files left once the store is opened again, and the count against the files.

Prints one JSON line per part; ``benchmarks/README.md`` quotes a run.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import zlib
from typing import Any

import torch

from monai_sharedcache import SharedCacheStore, persist

MIB = 2**20
CTX = multiprocessing.get_context("fork")


def _put_at_the_cap(path: str, start: Any, results: Any) -> None:
    scans = []
    items = persist.items
    persist.items = lambda at: (scans.append(1), items(at))[1]  # the scan of the store's directory, counted
    store = SharedCacheStore(path)
    start.wait(300)
    began = time.perf_counter()
    for i in range(100):
        store.put(f"{os.getpid()}-{i}", b"y" * 512)
    results.put((time.perf_counter() - began, len(scans)))


def writers(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in (1, 4):
        store = SharedCacheStore(root=root, max_bytes=20_000 * 560, reserve=0)
        for i in range(20_000):
            store.put(f"fill-{i}", b"x" * 512)
        start, results = CTX.Event(), CTX.Queue()
        procs = [CTX.Process(target=_put_at_the_cap, args=(store.path, start, results)) for _ in range(n)]
        for p in procs:
            p.start()
        start.set()
        got = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        out[f"{n} writers"] = {"slowest_s": round(max(t for t, _ in got), 3), "scans": sum(s for _, s in got)}
        store.close()
    out["ratio"] = round(out["4 writers"]["slowest_s"] / out["1 writers"]["slowest_s"], 2)
    return out


def _item(key: str, writer: int, size: int) -> dict:
    body = torch.randint(0, 255, (size,), dtype=torch.uint8)
    return {"key": key, "writer": writer, "crc": zlib.crc32(body.numpy().tobytes()), "body": body}


def _wrong(key: str, item: Any) -> bool:
    """Whether ``item``, read under ``key``, is not an item written under it, whole."""
    if item is None:
        return False
    return item["key"] != key or zlib.crc32(item["body"].numpy().tobytes()) != item["crc"]


def _writer(path: str, writer: int, keys: list[str], size: int, stop: Any, bad: Any, ops: Any) -> None:
    faulthandler.register(signal.SIGUSR1)  # its stack, if it hangs
    store, rng = SharedCacheStore(path), random.Random(writer)
    while not stop.is_set():
        key, roll = rng.choice(keys), rng.random()
        if roll < 0.45:
            store.put(key, _item(key, writer, size))
        elif roll < 0.9:
            if _wrong(key, store.get(key)):
                with bad.get_lock():
                    bad.value += 1
        elif roll < 0.995:
            store.discard([key])
        else:
            store.clear()
        with ops.get_lock():
            ops.value += 1


def _reader(path: str, keys: list[str], stop: Any, bad: Any) -> None:
    faulthandler.register(signal.SIGUSR1)
    store, rng = SharedCacheStore(path), random.Random(99)
    while not stop.is_set():
        held = [(k, store.get(k)) for k in rng.sample(keys, 8)]  # mapped while held
        if any(_wrong(k, item) for k, item in held):
            with bad.get_lock():
                bad.value += 1
        time.sleep(rng.uniform(0.05, 0.5))


def redteam(root: str, seconds: float, size: int = MIB) -> dict[str, Any]:
    keys = [f"key-{i}" for i in range(32)]
    store = SharedCacheStore(root=root, max_bytes=8 * (size + 4096), reserve=0)
    stop, bad, ops = CTX.Event(), CTX.Value("i", 0), CTX.Value("i", 0)
    start = lambda w: CTX.Process(target=_writer, args=(store.path, w, keys, size, stop, bad, ops))  # noqa: E731
    procs = [start(w) for w in range(4)]
    reader = CTX.Process(target=_reader, args=(store.path, keys, stop, bad))
    for p in [*procs, reader]:
        p.start()
    rng, kills, deadline, w = random.Random(7), 0, time.monotonic() + seconds, 4
    while time.monotonic() < deadline:  # the killer
        time.sleep(rng.uniform(0.2, 1.5))
        victim = rng.randrange(len(procs))
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(60)
        procs[victim] = start(w)
        procs[victim].start()
        kills, w = kills + 1, w + 1
    stop.set()
    hung = 0
    for p in [*procs, reader]:
        p.join(120)
        if p.is_alive():  # a deadlock: its stack on stderr, then it goes
            hung += 1
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1)
            p.kill()
            p.join(60)
    again = SharedCacheStore(store.path)  # a next user: it cleans what the killed left
    again.close()
    left = {d: os.listdir(os.path.join(store.path, d)) for d in (".tmp", ".claims")}
    on_disk = sum(os.path.getsize(os.path.join(store.path, n)) for n in os.listdir(store.path) if n.endswith(".item"))
    aside = os.path.join(store.path, ".aside")
    pinned = sum(os.path.getsize(os.path.join(aside, n)) for n in os.listdir(aside)) if os.path.isdir(aside) else 0
    counted = store.stats()["nbytes"]
    store.close()
    return {
        "seconds": seconds,
        "operations": ops.value,
        "sigkills": kills,
        "wrong_items": bad.value,
        "hung": hung,
        "left": {d: len(n) for d, n in left.items()},
        "counted_bytes": counted,
        "bytes_on_disk": on_disk + pinned,
        "max_bytes": store.max_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="writers,redteam", help="among writers,redteam")
    parser.add_argument("--seconds", type=float, default=300.0, help="length of the red-team run")
    parser.add_argument("--root", default="/dev/shm", help="where the stores are made")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-faults-", dir=args.root)
    try:
        for part in args.parts.split(","):
            result = writers(root) if part == "writers" else redteam(root, args.seconds)
            print(json.dumps({part: result}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
