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
One runtime cache per node for the ranks of a distributed job: :py:func:`create_shared_cache`, the one collective
call of the package.
"""

from __future__ import annotations

import numbers
import os
import socket
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from monai_sharedcache import budget
from monai_sharedcache.store import SharedCacheStore

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["create_shared_cache"]

NODE_ID_ENV = "MONAI_CACHE_NODE_ID"

_OK, _ERROR = "ok", "error"


def _object_collectives_on_cpu(group: ProcessGroup | None) -> bool:
    """Whether ``all_gather_object`` over ``group`` runs on the CPU (a ``cpu:`` backend such as gloo)."""
    try:
        config = str(dist.get_backend_config(group))
    except Exception:
        return False
    return any(part.strip().startswith("cpu:") for part in config.split(","))


def _exchange_group(group: ProcessGroup | None, timeout: float | None) -> tuple[ProcessGroup | None, bool]:
    """The group to exchange over, and whether it was made here (to destroy after use). Collective."""
    span = None if timeout is None else timedelta(seconds=timeout)
    if group is None or group is dist.GroupMember.WORLD:
        if timeout is None and _object_collectives_on_cpu(group):
            return group, False
        if dist.is_gloo_available():
            # every rank of the world is here to make one: it needs no GPU, and bounds every wait by `timeout`
            return dist.new_group(backend="gloo", timeout=span), True
        if timeout is not None:
            raise ValueError("create_shared_cache: `timeout` needs the gloo backend, which this PyTorch lacks.")
        return group, False  # object collectives on the current CUDA device, see the docstring
    if timeout is not None:
        # making a group would need the whole world: bound the wait for the ranks to arrive with a monitored barrier
        if str(dist.get_backend(group)) != "gloo":
            raise ValueError(
                f"create_shared_cache: `timeout` with a subgroup needs a gloo group, got backend "
                f"{dist.get_backend(group)!r}; pass a gloo subgroup, e.g. dist.new_group(ranks, backend='gloo', "
                "timeout=...), or group=None."
            )
        dist.monitored_barrier(group=group, timeout=span, wait_all_ranks=True)
    return group, False


def process_cpus() -> set[int]:
    """The CPUs this process may run on."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def share_of_cpus(mine: set[int], node: list[set[int]]) -> int:
    """The CPUs of the ``node``'s ranks divided evenly among them, at most this rank's ``mine``, at least 1."""
    return max(1, min(len(mine), len(set().union(*node)) // len(node)))


def _all_gather(obj: Any, group: ProcessGroup | None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _failures(nodes: list[str], outcomes: list[Any]) -> list[str]:
    return [f"rank {r} (node {nodes[r]!r}): {o[1]}" for r, o in enumerate(outcomes) if o and o[0] == _ERROR]


def create_shared_cache(
    group: ProcessGroup | None = None,
    *,
    root: str | os.PathLike | None = None,
    node_id: str | None = None,
    timeout: float | None = None,
    reserve: int | None = None,
    max_bytes: int | None = None,
    path: str | os.PathLike | None = None,
    persistent: bool = False,
) -> SharedCacheStore:
    """
    Create one :py:class:`~monai_sharedcache.SharedCacheStore` per node for the ranks of ``group``, to pass to
    ``CacheDataset(data, transform, runtime_cache=store, hash_func=store.hash_func,
    hash_transform=store.hash_transform)`` on every rank: the ranks of a node and their DataLoader
    workers share it, so every item is computed once per node and held once in its memory.

    The ranks exchange their node identities and CPUs (small objects over ``all_gather_object``; no data); the lowest
    rank of each node creates the node's store, the others join it by its path (a rank that cannot, where its creator
    had no room, say, makes one of its own after a warning), and a last exchange makes sure that every rank uses its
    store before any returns. The store is removed when the last rank of the node closes it or exits. Without an
    initialized process group, this is a new store of this process. With ``group=None`` and a GPU-only backend
    (nccl), or with a ``timeout``, the exchange runs over a short-lived gloo group.

    Warning:
        **This is a collective call**: every rank of ``group`` calls it once, in the same order relative to the
        group's other collective calls. ``CacheDataset`` never contacts other ranks (a dataset constructor that made
        hidden collective calls would deadlock as soon as ranks build their datasets in other orders: MONAI issues
        #5365 and #5630); this function is the one explicit place where the ranks agree on a cache.

    Args:
        group: the process group whose ranks share a store per node; ``None`` for the world.
        root: where each node's store is made (the lowest rank's value counts); see ``SharedCacheStore``.
        node_id: this process's node: ranks with the same identity share a store, so they must run on one machine.
            By default ``$MONAI_CACHE_NODE_ID``, else the host name.
        timeout: bound, in seconds, on every wait of the exchange (for a rank that never calls, say); ``None`` for
            the group's own. With a subgroup, which must then be a gloo group, a ``monitored_barrier`` waits that
            long for the ranks to arrive; the exchange after it waits as long as the subgroup's own timeout.
        reserve: bytes that each store keeps free for the DataLoader's shared memory; see ``SharedCacheStore``.
        max_bytes: a cap on the total size of each node's store (the value of the lowest rank of each node counts).
        path: with ``persistent=True``, the directory of each node's store, kept across runs (the value of the lowest
            rank of each node counts). It must be on the node: on a file system that several nodes share, give each
            node a path of its own, such as ``f"/shared/cache/{socket.gethostname()}"``.
        persistent: keep each node's store in ``path`` for later runs, see :py:class:`SharedCacheStore`.

    Returns:
        this rank's handle of its node's store; ``close()`` it when done, or let it close at exit. Its ``node_cpus`` is
        this rank's share of the node's CPUs, the threads that :py:func:`monai_sharedcache.fill` computes with by
        default.

    Raises:
        NotImplementedError: without ``fcntl`` (Windows), on every rank before any collective call.
        ValueError: a bad ``timeout``, ``reserve`` or ``max_bytes``; ``path`` and ``persistent=True`` are not given
            together, or with ``root``; this process is not in ``group``, or ``timeout`` with a subgroup that is not
            a gloo group.
        RuntimeError: on every rank, if a store could not be made on any rank; the message names them.

    Example:
        .. code-block:: python

            dist.init_process_group("gloo")  # under torchrun, say
            store = create_shared_cache()  # every rank, once
            ds = CacheDataset(
                data, transform, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform
            )
            loader = DataLoader(ds, batch_size=2, num_workers=2, sampler=DistributedSampler(ds))
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, numbers.Integral) or reserve < 0):
        raise ValueError(f"reserve must be None or a non-negative number of bytes, got {reserve!r}.")  # every rank
    max_bytes = budget.check_bytes("max_bytes", max_bytes)  # on every rank, before any collective
    if (path is None) == bool(persistent) or (persistent and root is not None):
        raise ValueError(
            "create_shared_cache: path (the directory of a store kept across runs) goes with persistent=True, and "
            f"root (where temporary stores are made) without it; got path={path!r}, persistent={persistent!r}, "
            f"root={root!r}."
        )

    def make(joined: str | None = None, *, root: Any = None, reserve: int | None = None) -> SharedCacheStore:
        if joined is not None:  # the other ranks of the node join the store of its lowest rank
            return SharedCacheStore(joined, reserve=reserve)
        if persistent:
            return SharedCacheStore(path, persistent=True, reserve=reserve, max_bytes=max_bytes)
        return SharedCacheStore(root=root, reserve=reserve, max_bytes=max_bytes)

    if not SharedCacheStore.supported:
        raise NotImplementedError(
            "create_shared_cache needs SharedCacheStore, which needs fcntl file locks, missing on this platform. Give "
            "each rank its own cache instead: CacheDataset(..., runtime_cache=False) or runtime_cache='process'."
        )
    if not (dist.is_available() and dist.is_initialized()):
        return make(root=root, reserve=reserve)
    if dist.get_rank(group) < 0:
        raise ValueError("create_shared_cache: this process is not a member of `group`.")
    node = str(node_id) if node_id is not None else os.environ.get(NODE_ID_ENV) or socket.gethostname()
    exchange, made_here = _exchange_group(group, timeout)
    store: SharedCacheStore | None = None
    try:
        # 1. which rank is on which node, and on which CPUs; the lowest rank of each node creates its store
        cpus = process_cpus()
        gathered = _all_gather((node, sorted(cpus)), exchange)
        nodes = [n for n, _ in gathered]
        me = dist.get_rank(exchange)
        creator = min(r for r, n in enumerate(nodes) if n == node)
        created: tuple[str, str] | None = None
        if me == creator:
            try:
                store = make(root=root, reserve=reserve)
                created = (_OK, store.path)
            except Exception as err:  # every rank must learn of it, and none may hang waiting for a path
                created = (
                    _ERROR,
                    f"cannot create a store in {root or 'the default root'}: {type(err).__name__}: {err}",
                )
        # 2. the path of every node's store (or an error marker); a failure anywhere fails every rank alike
        outcomes = _all_gather(created, exchange)
        failed = _failures(nodes, outcomes)
        if failed:
            raise RuntimeError("create_shared_cache failed on every rank: " + "; ".join(failed))
        attached: tuple[str, str] = (_OK, "")
        if me != creator:
            joined = outcomes[creator][1]
            try:
                store = make(joined, reserve=reserve)
            except Exception as err:  # no store there (its creator had no room), or another machine: one of its own
                warnings.warn(
                    f"create_shared_cache: cannot join {joined!r}, the store of rank {creator} ({type(err).__name__}: "
                    f"{err}); this rank uses a store of its own. Ranks with one node identity must run on one machine "
                    f"and see the same {os.path.dirname(joined)}: set node_id or ${NODE_ID_ENV} to tell machines apart.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                try:
                    store = make(root=root, reserve=reserve)
                except Exception as err:
                    attached = (_ERROR, f"cannot create a store in {root or 'the default root'}: {err!r}")
        # 3. every rank has registered as a participant before any rank returns (and may close)
        failed = _failures(nodes, _all_gather(attached, exchange))
        if failed:
            raise RuntimeError("create_shared_cache failed on every rank: " + "; ".join(failed))
    except BaseException:
        if store is not None:
            store.close()
        raise
    finally:
        if made_here:
            dist.destroy_process_group(exchange)
    assert store is not None  # every rank either created or attached, or raised
    store.node_cpus = share_of_cpus(cpus, [set(c) for n, c in gathered if n == node])
    return store
