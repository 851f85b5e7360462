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
The fork's stand-in for MONAI's ``tests/test_utils.py``: the helpers that the exported tests use, with MONAI's names
and meanings, so that a test imports ``from tests.test_utils import ...`` here and in MONAI's repository alike. The
PR series does not carry this file: there, the tests import MONAI's own. Written for the fork, not copied: it also
bounds every wait (a rank that hangs is killed after ``timeout``), as the fork's tests must.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import queue
import shutil
import sys
import tempfile
import traceback
import unittest
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from monai.utils import optional_import

__all__ = ["DistCall", "DistTestCase", "SkipIfNoModule", "skip_if_darwin", "skip_if_quick", "skip_if_windows"]


def _is_quick() -> bool:
    return os.environ.get("QUICKTEST", "").lower() == "true"  # as MONAI reads it


def skip_if_quick(obj: Any) -> Any:
    """Skip a slow test when the environment variable ``QUICKTEST`` is ``true``."""
    return unittest.skipIf(_is_quick(), "Skipping slow tests")(obj)


def skip_if_windows(obj: Any) -> Any:
    """Skip a test on Windows."""
    return unittest.skipIf(sys.platform == "win32", "Skipping tests on Windows")(obj)


def skip_if_darwin(obj: Any) -> Any:
    """Skip a test on macOS."""
    return unittest.skipIf(sys.platform == "darwin", "Skipping tests on macOS/Darwin")(obj)


class SkipIfNoModule:
    """Skip a test if the optional module ``module_name`` cannot be imported."""

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        self.module_missing = not optional_import(module_name)[1]

    def __call__(self, obj: Any) -> Any:
        return unittest.skipIf(self.module_missing, f"optional module not present: {self.module_name}")(obj)


class DistTestCase(unittest.TestCase):
    """A test case that pickles without its outcome, so that :py:class:`DistCall` can send it to the ranks."""

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_outcome"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


_ORIGINALS: dict[str, Callable] = {}  # the undecorated test methods, by module and name, for the ranks to call


def _rank_main(test: str, rank: int, world: int, init: str, backend: str, timeout: float, call: tuple, results) -> None:
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    module, _, name = test.rpartition(".")
    try:
        importlib.import_module(module)  # decorating registers the original again in this process
        span = datetime.timedelta(seconds=timeout)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=span)
        try:
            _ORIGINALS[test](*call[0], **call[1])
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, traceback.format_exc()))


class DistCall:
    """
    Run a test method of a :py:class:`DistTestCase` in ``nproc_per_node`` new processes (``method``, spawn by
    default) with ``torch.distributed`` initialized (gloo, or nccl with enough GPUs), ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE`` set; the test fails if any rank fails. ``timeout`` is the process group's; every rank is also
    killed, and the test fails, if the ranks have not finished within a few times that.
    """

    def __init__(
        self, nnodes: int = 1, nproc_per_node: int = 1, timeout: float = 60, backend: str | None = None, **kwargs: Any
    ) -> None:
        if nnodes != 1 or nproc_per_node < 1:
            raise ValueError(f"the fork's DistCall runs one node of >= 1 processes, got {nnodes} x {nproc_per_node}")
        self.nproc, self.timeout, self.method = int(nproc_per_node), float(timeout), kwargs.get("method", "spawn")
        gpus = torch.cuda.is_available() and torch.cuda.device_count() >= self.nproc
        self.backend = backend or ("nccl" if gpus and dist.is_nccl_available() else "gloo")

    def __call__(self, obj: Callable) -> Callable:
        if not dist.is_available():
            return unittest.skip("torch.distributed is not available")(obj)
        test = f"{obj.__module__}.{obj.__name__}"
        _ORIGINALS[test] = obj

        @functools.wraps(obj)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            ctx = mp.get_context(self.method)
            tmp = tempfile.mkdtemp()
            results = ctx.Queue()
            init = "file://" + os.path.join(tmp, "rendezvous").replace(os.sep, "/")
            how = (self.nproc, init, self.backend, self.timeout, (args, kwargs), results)
            procs = [ctx.Process(target=_rank_main, args=(test, rank, *how)) for rank in range(self.nproc)]
            try:
                for p in procs:
                    p.start()
                errors = {}
                for _ in procs:
                    try:
                        rank, error = results.get(timeout=4 * self.timeout + 120)
                    except queue.Empty:
                        raise AssertionError(f"the ranks of {obj.__name__} did not finish in time") from None
                    errors[rank] = error
                for p in procs:
                    p.join(60)
                failed = [f"rank {r}: {e}" for r, e in sorted(errors.items()) if e]
                if failed:
                    raise AssertionError("Distributed call failed:\n" + "\n".join(failed))
            finally:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                        p.join(60)
                results.close()
                shutil.rmtree(tmp, ignore_errors=True)

        return wrapper
