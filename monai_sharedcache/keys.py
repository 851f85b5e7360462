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
What counts as the same item in the fork: the keys under which a runtime cache of ``CacheDataset`` keeps its items.
The core keys an item by ``hash_func`` of its input and ``hash_transform`` of the cached transforms; the fork's
``CacheDataset`` (its patch ``patches/fork/fork-0002``) keys it by this module instead.

A cached item is what the cached (deterministic) transforms make of one input. A cache that other processes fill or
that outlives the run (a ``ListProxy`` of DDP ranks, a ``SharedCacheStore``, a persistent one) must never serve an
item of other transforms or of another input, and must reuse every item where nothing changed. Pickle alone does
neither: it stores functions and classes by name, so an edited function or method keeps its key; it stores a set in
its hash order, which changes with ``PYTHONHASHSEED``, so processes stop sharing; and a data entry names its files,
so a file rewritten in place, or the same relative name in another directory, keeps its key. So:

- :py:func:`transforms_fingerprint` hashes the transforms by their pickled state in a canonical form. User code
  (functions and classes of no installed distribution: scripts, ``__main__``, a project installed in editable mode)
  counts by its code: bytecode, constants, names, defaults, closure values and the globals it reads, recursively, and
  for a class its bases and members. Library code counts by its name and its distribution's version. Sets count by
  their sorted elements. Members whose state cannot change an item (``STATELESS_TYPES``) count by their type, and a
  ``multiprocessing`` shared value by the content it held when first keyed in the process, so processes still share
  and a count that moves churns no key. Any other member
  that pickle cannot store makes the fingerprint private to its process (``Fingerprint.private`` names it).
- :py:func:`transforms_fingerprint` counts library code by its name and version, also where pickle could not find it
  by its name (a namedtuple's or a dataclass's methods, ``np.clip`` in a ``partial``), and a tensor or array by its
  dtype, shape and bytes: pickle writes the address of a tensor's storage, another in every interpreter.
- :py:func:`stamp_files` replaces, in a data entry, each string or path that names an existing regular file by its
  absolute path and stat data, as git's index keeps it: one ``stat`` per name, no byte read; a directory by its
  entries, one level deep (a DICOM series), when the item is first needed.
  For a key kept across runs, :py:func:`kept_digests` stamps a file by a digest of its content instead, kept with its
  stat data in a persistent store, so that a later run reads only the files whose stat data changed
  (:py:func:`file_digest`; a file modified less than ``RACY_SECONDS`` before it was hashed is hashed again).
"""

from __future__ import annotations

import collections.abc
import copyreg
import dis
import hashlib
import io
import logging
import os
import pickle
import site
import stat
import sys
import sysconfig
import threading
import time
import types
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache, partial
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from monai.data.utils import pickle_hashing

__all__ = [
    "STATELESS_TYPES",
    "RACY_SECONDS",
    "PROCESS_TOKEN",
    "Fingerprint",
    "transforms_fingerprint",
    "member_digests",
]
__all__ += ["pipeline_difference", "stamp_files", "library_version", "file_digest", "kept_digests"]
__all__ += ["transforms_hashing", "fingerprint_of", "SlotKeys", "file_content", "Pipelines", "SAME"]

# members whose state cannot change an item: they count by their type alone, so that processes still share items
STATELESS_TYPES: tuple[type, ...] = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Event,
    threading.Semaphore,
    threading.Thread,
    logging.Logger,
    logging.Handler,
)
try:  # multiprocessing's locks, conditions, events and semaphores (absent where the platform has no sem_open)
    from multiprocessing import synchronize as _mp_sync

    STATELESS_TYPES += (_mp_sync.SemLock, _mp_sync.Condition, _mp_sync.Event)
except ImportError:
    pass

RACY_SECONDS = 2.0  # a file modified this shortly before it was hashed may change again unseen: hashed again later
_PROCESS_SALT = uuid.uuid4().bytes  # makes a fingerprint with a private member private to this process (and forks)
PROCESS_TOKEN = hashlib.sha256(_PROCESS_SALT + b"token").hexdigest()[:16]  # names this process (and forks) in notes
_MAIN = ("__main__", "__mp_main__")  # a script, as run and as a spawned child re-imports it
_PLAIN = (str, bytes, int, float, bool, type(None), tuple, list, dict, complex)
# class members that cannot change an item: what pickle, abc and the compiler (line numbers) add
_CLASS_NOISE = {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__slotnames__", "_abc_impl"}
_CLASS_NOISE |= {"__firstlineno__", "__static_attributes__"}
_SHARED_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a shared value's first content, here
_digests: dict[str, tuple[tuple[int, ...], bytes]] = {}  # path -> (stat data, content digest), of this process


class Fingerprint(NamedTuple):
    """The fingerprint of some transforms: ``digest`` (hex), one ``parts`` digest per transform, ``private`` members."""

    digest: str
    parts: tuple[str, ...]
    private: tuple[str, ...]


@lru_cache(maxsize=None)
def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {sys.base_prefix + os.sep + "lib", getattr(site, "USER_SITE", None)}
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


@lru_cache(maxsize=None)
def _distributions() -> Mapping[str, list[str]]:
    from importlib import metadata

    return metadata.packages_distributions()


def library_version(module: str) -> str | None:
    """
    What library code of ``module`` counts by: its top-level package and the version of its distribution (the
    Python version for the standard library and built-in modules), or ``None`` where it is user code, counted by its
    code: ``__main__``, a script's directory, a project installed in editable mode, anything not installed.
    """
    return None if module in _MAIN else _top_version(module.partition(".")[0])


@lru_cache(maxsize=None)
def _top_version(top: str) -> str | None:
    if top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ()):
        return f"python {sys.version_info[0]}.{sys.version_info[1]}"
    if top == "monai":  # the library itself, also where it runs from a source tree
        return f"monai {getattr(sys.modules.get('monai'), '__version__', '')}"
    mod = sys.modules.get(top)
    found = [getattr(mod, "__file__", None), *(getattr(mod, "__path__", None) or [])]
    files = [os.path.realpath(f) for f in found if isinstance(f, str)]
    if not files or not all(f.startswith(_library_prefixes()) for f in files):
        return None
    from importlib import metadata

    try:  # a distribution of the package's name (numpy, torch), else the one that installed it
        return f"{top} {metadata.version(top)}"
    except metadata.PackageNotFoundError:
        names = _distributions().get(top) or []
    try:
        return f"{top} " + ",".join(f"{n} {metadata.version(n)}" for n in sorted(names))
    except metadata.PackageNotFoundError:
        return f"{top} {getattr(mod, '__version__', '')}"


def _found(module: str, qualname: str) -> Any:
    """What ``module.qualname`` names among the loaded modules (importing nothing), or ``None``."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):  # a module's own names: its __getattr__ may import
        obj = vars(obj).get(part) if isinstance(obj, types.ModuleType) else getattr(obj, part, None)
    return obj


def _first(pair: tuple) -> str:
    return str(pair[0])


def _tensor_state(tensor: Any) -> list:
    """The state of a tensor subclass (a MetaTensor's meta and operations), without the ids of the transforms that
    recorded the operations: addresses of the process that computed it."""
    state = getattr(tensor, "__dict__", None) or {}
    return sorted(((k, _without_ids(v) if "operations" in k else v) for k, v in state.items()), key=_first)


def _without_ids(ops: Any) -> Any:
    if isinstance(ops, dict):
        return {k: _without_ids(v) for k, v in ops.items() if not (k == "id" and "class" in ops)}
    return [_without_ids(v) for v in ops] if isinstance(ops, list) else ops


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _shared_value(obj: Any) -> tuple | None:
    """
    A ``multiprocessing`` shared value or array by its type and the content it held when this process first keyed
    it: a transform that counts its calls in one keeps its key as the count moves (``set_data`` reuses the items).
    """
    raw = getattr(obj, "_obj", obj)
    wrapper = getattr(raw, "_wrapper", None)  # the shared block, which lives as long as the value
    if type(wrapper).__module__ != "multiprocessing.heap":
        return None
    content = _SHARED_SEEN.get(wrapper)
    if content is None:
        try:
            content = _SHARED_SEEN.setdefault(wrapper, memoryview(raw).tobytes())
        except TypeError:
            return None
    return ("shared memory", _qualname(type(obj)), _qualname(type(raw)), content)


def _global_names(code: types.CodeType, ops: set[str] | None = None) -> set[str]:
    """The globals that ``code`` (and the code it holds) reads: not its attribute names (``np.load`` reads ``np``,
    whatever a global ``load`` of the module holds: a ``Compose`` with its random state, say); with ``ops=None``,
    every name it uses, attributes included."""
    if ops is None:
        names = set(code.co_names)
    else:
        names = {i.argval for i in dis.get_instructions(code) if i.opname in ops and isinstance(i.argval, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const, ops)
    return names


_GLOBAL_OPS = {"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"}


def _function_parts(fn: types.FunctionType) -> tuple:
    """What a user function computes with: code, defaults, closure values and the globals that its code reads."""
    names, attributes = sorted(_global_names(fn.__code__, _GLOBAL_OPS)), _global_names(fn.__code__)
    reads: list[tuple[str, Any]] = []
    for name in names:
        if name not in fn.__globals__:
            continue  # a builtin
        value = fn.__globals__[name]
        if isinstance(value, types.ModuleType) and library_version(value.__name__) is None:
            # a user module: the members its code reads (``helpers.scale(x)``)
            value = (
                value.__name__,
                [(n, vars(value)[n]) for n in sorted(attributes) if n in vars(value) and n[:2] != "__"],
            )
        reads.append((name, value))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            cells.append(("empty cell",))
    return fn.__code__, fn.__defaults__, fn.__kwdefaults__, cells, reads


def _class_parts(cls: type) -> tuple:
    """What a user class computes with: its bases and members (methods by their code)."""
    members = []
    for name, value in sorted(vars(cls).items(), key=lambda kv: kv[0]):
        if name in _CLASS_NOISE:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = (type(value).__name__, value.__func__)
        elif isinstance(value, property):
            value = ("property", value.fget, value.fset, value.fdel)
        elif isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            value = ("slot",)
        members.append((name, value))
    return cls.__bases__, members


class _Context:
    """What one fingerprint shares between its picklers: digests of code, cycles, libraries and private members."""

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.digests: dict[int, bytes] = {}
        self.keep: list[Any] = []  # what `digests` is keyed by the id of, alive until the fingerprint is made
        self.libraries: set[str] = set()
        self.private: list[str] = []

    def digest(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        _KeyPickler(buffer, self).dump(obj)
        return hashlib.sha256(buffer.getvalue()).digest()


class _KeyPickler(pickle.Pickler):
    """For hashing only: a canonical pickle, in which user code counts by its code (never unpickled)."""

    def __init__(self, file: io.BytesIO, context: _Context) -> None:
        super().__init__(file, protocol=4)
        self.context = context

    def persistent_id(self, obj: Any) -> Any:  # called for every object, sets and frozensets included
        if type(obj) in _PLAIN:
            return None
        if isinstance(obj, (set, frozenset)):
            return (type(obj).__name__, sorted(self.context.digest(e) for e in obj))
        if isinstance(obj, STATELESS_TYPES):
            return ("stateless", _qualname(type(obj)))
        shared = _shared_value(obj)
        if shared is not None:
            return shared
        if isinstance(obj, types.MappingProxyType):  # a dataclass field's metadata, a class's __dict__
            return ("mapping", dict(obj))
        if isinstance(obj, types.ModuleType):
            self._library(obj.__name__)
            return ("module", obj.__name__)
        if isinstance(obj, (type, types.FunctionType, types.CodeType, torch.Tensor)) or type(obj) is np.ndarray:
            return None
        reduce = copyreg.dispatch_table.get(type(obj))  # as pickle looks it up (numpy's ufuncs, say)
        try:
            reduce(obj) if reduce is not None else obj.__reduce_ex__(4)
        except Exception as err:
            self.context.private.append(f"a member of type {_qualname(type(obj))} ({type(err).__name__}: {err})")
            return ("private", _qualname(type(obj)), id(obj))
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) or type(obj) is np.ndarray:  # a subclass (a masked array): by its pickle
            return tuple, (self._array(obj),)
        if isinstance(obj, types.CodeType):
            parts = (obj.co_code, obj.co_consts, obj.co_names, obj.co_argcount, obj.co_kwonlyargcount, obj.co_flags)
            return tuple, (("code", *parts),)
        if isinstance(obj, types.FunctionType):
            return self._by_code(obj, _function_parts)
        if isinstance(obj, type):
            return self._by_code(obj, _class_parts)
        if isinstance(getattr(obj, "__wrapped__", None), types.FunctionType):  # functools.lru_cache, say
            return tuple, (("wrapped", type(obj).__qualname__, obj.__wrapped__),)
        return NotImplemented

    def _array(self, obj: Any) -> tuple:
        """A tensor or array by its type, dtype, shape, device and a digest of its bytes: pickle would write the
        address of a tensor's storage, another in every interpreter."""
        if isinstance(obj, np.ndarray) and obj.dtype.hasobject:  # its elements, each as any other object
            return "object array", type(obj), obj.shape, obj.tolist()
        try:
            if obj.is_quantized if isinstance(obj, torch.Tensor) else False:  # its bytes without its scales
                raise TypeError("a quantized tensor")
            if isinstance(obj, np.ndarray):
                data = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
                kind: tuple = ("array", obj.dtype.descr, obj.shape)
            else:
                flat = (
                    obj.as_subclass(torch.Tensor).detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
                )
                data = flat.view(torch.uint8).numpy()
                kind = ("tensor", str(obj.dtype), tuple(obj.shape), str(obj.device))
        except (RuntimeError, TypeError, ValueError) as err:  # sparse, quantized, on meta
            self.context.private.append(f"a tensor whose bytes cannot be read ({type(err).__name__}: {err})")
            return "private", _qualname(type(obj)), id(obj)
        state = _tensor_state(obj)  # a MetaTensor's meta and applied operations
        return (*kind, type(obj), hashlib.sha256(cast(Any, data)).digest(), state)

    def _library(self, module: str) -> bool:
        if library_version(module) is None:
            return False
        self.context.libraries.add(module.partition(".")[0])
        return True

    def _by_code(self, obj: Any, parts: Callable[[Any], tuple]) -> Any:
        module, qualname = getattr(obj, "__module__", None) or "", obj.__qualname__
        module = "__main__" if module in _MAIN else module
        if self._library(module) and "<" not in qualname:  # its name, and its distribution's version
            # by pickle's reference where its name finds it; a namedtuple's methods, numpy's dispatched functions
            # and the like are not found under their names: the same name and version, as a tuple
            if _found(module, qualname) is obj:
                return NotImplemented
            if isinstance(obj, types.FunctionType) and obj.__code__.co_filename.startswith(_library_prefixes()):
                return tuple, (("library", module, qualname),)
            # else a function of yours that took a library's name (functools.wraps), or a class a library made
        key, context = id(obj), self.context
        if key in context.active:  # a function that calls itself, a method that makes its own class
            return tuple, (("cycle", module, qualname),)
        if key not in context.digests:
            context.active.add(key)
            try:
                context.digests[key] = context.digest(parts(obj))
            finally:
                context.active.discard(key)
            context.keep.append(obj)
        return tuple, (("code", module, qualname, context.digests[key]),)


def transforms_fingerprint(transforms: Sequence[Any]) -> Fingerprint:
    """
    The fingerprint of ``transforms``: the same in every process that builds the same transforms from the same code,
    whatever ``PYTHONHASHSEED``, and another one where anything that can change their results differs.

    Args:
        transforms: the transforms (any objects).

    Returns:
        the digest, a digest per transform (to tell which differs), and the members that made the digest private to
        this process; a pipeline that cannot be pickled at all is private, with a fresh digest, and names why.
    """
    context, parts, private = _Context(), [], []
    for t in transforms:
        before = len(context.private)
        try:
            parts.append(context.digest((type(t), t)).hex())
        except Exception as err:  # a failing __getstate__, say
            why = f"cannot be pickled ({type(err).__name__}: {err})"
            return Fingerprint(uuid.uuid4().hex + uuid.uuid4().hex, (), tuple(_members(t, why)))
        if len(context.private) > before:
            private += _members(t)
    libraries = sorted((top, library_version(top) or "") for top in context.libraries)
    digest = hashlib.sha256(pickle.dumps((parts, libraries), protocol=4))
    if private:
        digest.update(_PROCESS_SALT)
    return Fingerprint(digest.hexdigest(), tuple(parts), tuple(dict.fromkeys(private)))


def _members(transform: Any, failed: str | None = None) -> list[str]:
    """The members of ``transform`` (one level down) that cannot be counted the same in every process, each with why,
    in words; ``failed``: why the whole transform failed."""
    where = f"{type(transform).__qualname__}" if not isinstance(transform, Mapping) else "the Compose options"
    members = transform if isinstance(transform, Mapping) else getattr(transform, "__dict__", None) or {}
    found = []
    for name, value in members.items():
        context = _Context()
        try:
            context.digest(value)
        except Exception as err:
            found.append(f"{where}.{name}, which cannot be pickled ({type(err).__name__}: {err})")
            continue
        found += [f"{where}.{name}: {what}" for what in context.private]
    return found or [f"{where}: {failed or 'a member that cannot be pickled'}"]


def member_digests(obj: Any) -> dict[str, str]:
    """
    A short digest of each attribute of ``obj`` (each key of a mapping), hashed as by
    :py:func:`transforms_fingerprint`: what another process compares to tell which member of a transform differs.
    """
    members = obj if isinstance(obj, Mapping) else getattr(obj, "__dict__", None) or {}
    context, digests = _Context(), {}
    for name, value in members.items():
        try:
            digests[str(name)] = context.digest(value).hex()[:16]
        except Exception:  # a failing __getstate__, say
            digests[str(name)] = "unpicklable"
    return digests


def pipeline_difference(mine: Sequence[Any], theirs: Sequence[Any]) -> str:
    """
    What differs between two pipelines, each described by a ``(name, digest, member_digests(transform))`` per
    transform: the transforms or their members, "here" (``mine``) and "there" (``theirs``).
    """
    if len(mine) != len(theirs):
        return f"{len(mine)} cached transforms here, {len(theirs)} there"
    found = []
    for (name, digest, members), (other, other_digest, other_members) in zip(mine, theirs):
        if name != other:
            found.append(f"{name} here, {other} there")
        elif digest != other_digest:
            names = sorted(set(members) | set(other_members))
            differ = [n for n in names if members.get(n) != other_members.get(n)]
            found.append(f"{name}, member{'s' * (len(differ) > 1)} {', '.join(differ)}" if differ else name)
    return "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "") if found else "the libraries' versions"


def _stat_data(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _record(entry: Any) -> tuple[tuple[int, ...], bytes] | None:
    """``[*stat data, hex digest]`` as :py:func:`file_digest` gives it to keep, or ``None`` where it is malformed."""
    try:
        data, digest = tuple(entry[:-1]), bytes.fromhex(entry[-1])
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    return (data, digest) if len(data) == 5 and all(type(v) is int for v in data) and len(digest) == 32 else None


def file_digest(path: str, st: os.stat_result, earlier: Callable[[], Any] | None = None) -> tuple[bytes, list | None]:
    """
    The sha256 of the content of the regular file ``path``, whose stat data is ``st``. The file is read only where
    neither this process nor ``earlier()`` (what an earlier run kept: ``[*stat data, hex digest]``) has its digest for
    the same stat data (device, inode, size, modification and change times), as git's index does.

    Args:
        path: an absolute path.
        st: its ``os.stat``.
        earlier: called only where this process has no digest of the file.

    Returns:
        the digest, and ``[*stat data, hex digest]`` to keep for a later run where the file was read now (``None``
        where it was not, or where it was modified less than ``RACY_SECONDS`` before, so may change again unseen).
    """
    data = _stat_data(st)
    known = _digests.get(path)  # dict operations are atomic: no lock, which a fork could leave held in the child
    if known is None and earlier is not None and (known := _record(earlier())) is not None and known[0] == data:
        _digests[path] = known
    if known is not None and known[0] == data:
        return known[1], None
    started = time.time_ns()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        after = os.fstat(f.fileno())  # the file that was read, whatever its name points to now
    if _stat_data(after) != data:  # replaced or written while read: a digest of no version, never kept
        return b"changed while read " + uuid.uuid4().bytes, None
    if started - st.st_mtime_ns <= RACY_SECONDS * 1e9:
        return digest.digest(), None
    _digests[path] = (data, digest.digest())
    return digest.digest(), [*data, digest.hexdigest()]


def _kept_digest(keeper: Any, path: str, st: os.stat_result) -> bytes:
    name = "digest-" + hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:40]
    digest, record = file_digest(path, st, lambda: keeper.kept(name))
    if record is not None:
        keeper.keep(name, record)
    return digest


def kept_digests(keeper: Any) -> Callable[[str, os.stat_result], bytes]:
    """
    A ``content`` for :py:func:`stamp_files` whose digests outlive the process: ``keeper`` (a persistent
    ``SharedCacheStore``) keeps each file's digest with its stat data, one small record per file, so that a later run
    reads only the files whose stat data changed. It pickles with the keeper (for spawned DataLoader workers).
    """
    return partial(_kept_digest, keeper)


DIRECTORY_SECONDS = 5.0  # how long a directory's listing stands for the keys made meanwhile in a process
_DIRECTORIES: dict[tuple, tuple[float, tuple]] = {}
_DIRECTORY_LOCK = threading.Lock()


def _stamp(name: str, content: Callable[[str, os.stat_result], bytes] | None) -> tuple | None:
    try:
        st = os.stat(name)
    except (OSError, ValueError):  # no such file, a name too long, a NUL: not a file name
        return None
    path = os.path.abspath(name)
    if stat.S_ISDIR(st.st_mode):  # a reader that loads a directory (a DICOM series) reads the files in it
        # listed once while the keys of many inputs that name it are made (a label naming the data's root: a listing
        # per input would be quadratic), and anew after DIRECTORY_SECONDS or a change of the directory itself
        memo = (path, content is None, _stat_data(st))
        with _DIRECTORY_LOCK:
            known = _DIRECTORIES.get(memo)
        if known is not None and time.monotonic() - known[0] < DIRECTORY_SECONDS:
            return known[1]
        stamped = _stamp_directory(path, content)
        with _DIRECTORY_LOCK:
            if len(_DIRECTORIES) > 4096:
                _DIRECTORIES.clear()
            _DIRECTORIES[memo] = (time.monotonic(), stamped)
        return stamped
    if not stat.S_ISREG(st.st_mode):  # a device, a pipe: plain data
        return None
    try:
        return ("file", path, _stat_data(st) if content is None else content(path, st))
    except OSError as err:  # unreadable: a stamp of no content, never the same twice
        return ("unreadable", path, type(err).__name__, uuid.uuid4().bytes)


def _stamp_directory(path: str, content: Callable[[str, os.stat_result], bytes] | None) -> tuple:
    """
    A directory by the names and stat data of its entries, one level deep, and never a byte of them: a label that
    names the data's root would read the whole data set. For ``content`` (a key that outlives the stat data), a file
    counts by its size and modification time, which a copy that keeps times (``cp -p``, ``rsync -a``) keeps.
    """
    entries: list[tuple] = []
    try:
        with os.scandir(path) as found:
            for entry in found:
                try:
                    st = entry.stat()
                except FileNotFoundError:  # a link to nothing: the link itself, and where it points
                    entries.append((entry.name, "link", os.readlink(entry.path)))
                    continue
                if content is None:
                    entries.append((entry.name, stat.S_IFMT(st.st_mode), _stat_data(st)))
                elif stat.S_ISREG(st.st_mode):
                    entries.append((entry.name, stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns))
                else:
                    entries.append((entry.name, stat.S_IFMT(st.st_mode)))
    except OSError as err:  # unreadable, or changed while listed: a stamp never the same twice
        return ("unreadable", path, type(err).__name__, uuid.uuid4().bytes)
    listing = hashlib.sha256(pickle.dumps(sorted(entries), protocol=4)).digest()  # what each key of it pickles
    return ("directory", path, listing)


def _canonical(value: Any) -> Any:
    """A tensor or array by its dtype, shape and the digest of its bytes (pickle writes an address in a tensor's)."""
    if type(value) is np.ndarray and not value.dtype.hasobject:  # a subclass (a masked array): by its pickle
        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        return ("array", value.dtype.descr, value.shape, hashlib.sha256(cast(Any, raw)).digest())
    if isinstance(value, torch.Tensor) and not value.is_quantized:  # quantized: its scales are not in its bytes
        try:
            flat = value.as_subclass(torch.Tensor).detach().resolve_conj().resolve_neg().cpu().contiguous()
            raw = cast(Any, flat.reshape(-1).view(torch.uint8).numpy())
        except (RuntimeError, TypeError, ValueError):  # sparse, quantized, on meta: as pickle has it
            return value
        meta = _tensor_state(value)  # a MetaTensor's meta and applied operations
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.sha256(raw).digest(), stamp_files(meta))
    return value


def stamp_files(
    entry: Any, memo: dict | None = None, content: Callable[[str, os.stat_result], bytes] | None = None
) -> Any:
    """
    ``entry`` (nested dicts, lists and tuples) with each string or path-like that names an existing regular file
    replaced by ``("file", absolute path, stat data)`` (device, inode, size, modification and change times, as git's
    index keeps them), each that names a directory by the names and stamps of its entries, one level deep (a reader
    of a DICOM series reads the files in it), each tensor and array by its dtype, shape and a digest of its bytes,
    and everything else as it is. No byte of a file is read.

    Args:
        entry: a data entry, for example ``{"image": "img.nii.gz", "label": "seg.nii.gz", "id": 3}``.
        memo: the stamp of each name already stamped, kept between calls (a name is stat'ed once while it is kept).
        content: if given, a file's stamp is ``content(path, stat)`` instead (a digest of the content, for keys that
            outlive the stat data: see :py:func:`kept_digests`).

    Returns:
        the stamped entry, for a content key such as ``pickle_hashing(stamp_files(entry))``.
    """
    memo = {} if memo is None else memo
    if isinstance(entry, (str, os.PathLike)):
        name = os.fspath(entry)
        if isinstance(name, str) and name not in memo:  # a bytes path is data
            memo[name] = _stamp(name, content)
        return memo.get(name) or entry
    if isinstance(entry, Mapping):
        return {k: stamp_files(v, memo, content) for k, v in entry.items()}
    if isinstance(entry, (list, tuple)):
        return type(entry)(stamp_files(v, memo, content) for v in entry) if type(entry) in (list, tuple) else entry
    return _canonical(entry)


def transforms_hashing(transforms: Sequence) -> bytes | None:
    """
    A ``hash_transform`` for ``CacheDataset`` and ``PersistentDataset``: the digest of
    :py:func:`transforms_fingerprint`,
    the same in the processes that build the same transforms from the same code, whatever ``PYTHONHASHSEED``. The
    fork's ``CacheDataset`` keys its runtime cache so without one.

    Args:
        transforms: the transforms, for example those whose results a ``CacheDataset`` caches.

    Returns:
        the hash, or ``None`` if the transforms hold a member that pickle cannot store, or cannot be pickled at all.
    """
    fingerprint = transforms_fingerprint(transforms)
    return None if fingerprint.private else fingerprint.digest.encode()


def data_key(entry: Any) -> bytes:
    """
    A ``hash_func`` for ``CacheDataset``: ``pickle_hashing`` of ``entry`` with its files stamped by their stat data
    (:py:func:`stamp_files`), so that a file rewritten in place is a new key. It reads no byte of a file.

    Args:
        entry: an input of the dataset, e.g. ``{"image": "img.nii.gz", "label": "seg.nii.gz"}``.

    Returns:
        the hash, as bytes.
    """
    return cast(bytes, pickle_hashing(stamp_files(entry)))


def transforms_key(transforms: Sequence) -> bytes:
    """
    A ``hash_transform`` for ``CacheDataset``: the digest of :py:func:`transforms_fingerprint`, or where a member of
    the transforms cannot be pickled, a digest private to this process, after one warning.

    Args:
        transforms: the cached transforms.

    Returns:
        the hash (64 hex digits), as bytes.
    """
    return cast(str, fingerprint_of(list(transforms), stacklevel=3).digest).encode()


def fingerprint_of(cached: Sequence[Any], stacklevel: int = 2) -> Fingerprint:
    """:py:func:`transforms_fingerprint` of ``cached``, with one warning where a member makes it private."""
    fingerprint = transforms_fingerprint(cached)
    if fingerprint.private:
        warnings.warn(
            f"CacheDataset: the cached transforms cannot have the same key in every process, because of "
            f"{fingerprint.private[0]}. So their items are neither shared with other processes nor kept across runs. "
            "Make that member picklable (or leave it out of __getstate__, if it cannot change an item), or pass "
            "hash_transform= with a fingerprint of your own.",
            stacklevel=stacklevel + 1,
        )
    return fingerprint


class SlotKeys(collections.abc.Sequence):
    """
    The key of each slot of a runtime cache: ``entries[i]`` (``hash_func`` of the input, ``-``, the transforms'
    fingerprint), or with ``files`` (``(data, indices, tag, content)`` for the default ``hash_func``) the key of the
    input ``data[indices[i]]`` with its files stamped (:py:func:`stamp_files`), made when the slot is first needed,
    so that a constructor or ``set_data`` reads no file.
    """

    def __init__(self, entries: list[str], files: tuple | None = None) -> None:
        self.entries, self.files, self.stamps = entries, files, {}  # type: ignore[var-annotated]
        self.known: list[str | None] = list(entries) if files is None else [None] * len(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, slot):
        if (key := self.known[slot]) is None:
            data, indices, tag, content = self.files  # type: ignore[misc]
            stamped = stamp_files(data[indices[slot]], self.stamps, content)
            key = self.known[slot] = f"{pickle_hashing(stamped).decode()}-{tag}"
        return key

    def renewed(self) -> SlotKeys:
        """The same slots, their files to be stamped anew (after a ``refresh``)."""
        return SlotKeys(self.entries, self.files)


def file_content(store: Any) -> Callable[[str, os.stat_result], bytes] | None:
    """The ``content`` of :py:func:`stamp_files` for a runtime cache in ``store``: kept digests for a persistent store
    that keeps records (the fork's), so that its keys outlive the stat data; else ``None``, the stat data."""
    if store is None or not getattr(store, "persistent", False) or not callable(getattr(store, "kept", None)):
        return None
    return kept_digests(store)


SAME = (
    "Make the cached transforms the same in every process: a value that differs per rank (a device such as "
    "cuda:{rank}, or a bound method of an object that holds the rank) belongs in a transform after the cached ones."
)


class Pipelines:
    """
    The notes of one dataset in a store of the fork (its ``add_note``): with which cached transforms it caches which
    inputs, so that the first process that computes an item can tell, once, that other processes cache the same
    inputs with other transforms (each item is then computed and stored once per pipeline). A store without notes
    (the core's) or a persistent one (whose notes would outlive the run) is not noted in.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self.on = callable(getattr(store, "add_note", None)) and not getattr(store, "persistent", False)
        self.mine: dict[str, Any] | None = None  # the note of this dataset: its inputs and cached transforms
        self.compared = -1  # the process that last compared it with the notes of other processes

    def note(self, keys: Sequence[Any], tag: str, fingerprint: Fingerprint | None, cached: Sequence[Any]) -> None:
        """Note the inputs (``hash_func`` of each) and the cached transforms (``tag``, and ``fingerprint`` unless a
        ``hash_transform`` of the user's made the tag)."""
        if not self.on or (fingerprint is not None and fingerprint.private):  # private: never shared
            return
        described = None  # what a user's hash_transform hashes cannot be told
        if fingerprint is not None:
            names = [f"transform {i - 1} ({type(t).__qualname__})" for i, t in enumerate(cached)]
            names[0] = "Compose options"
            described = [[n, d, member_digests(t)] for n, d, t in zip(names, fingerprint.parts, cached)]
        inputs = hashlib.sha256("\n".join(sorted(map(str, keys))).encode()).hexdigest()[:32]
        digest = hashlib.sha256(tag.encode()).hexdigest()[:32]
        if self.mine is not None and (self.mine["inputs"], self.mine["tag"]) != (inputs, digest):
            self.store.discard_note(f"p{self.mine['inputs']}-{self.mine['tag']}")  # what it cached before
        self.mine = {"inputs": inputs, "tag": digest, "process": PROCESS_TOKEN, "transforms": described}
        self.store.add_note(f"p{inputs}-{digest}", self.mine)
        self.compared = -1

    def computing(self, compute: Callable[[], Any]) -> Callable[[], Any]:
        """``compute``, compared with the other processes' pipelines first if this process has not yet."""

        def first_compared() -> Any:
            if self.compared != os.getpid():
                self.compare()
            return compute()

        return first_compared

    def compare(self) -> None:
        """Warn once if other processes cache the same inputs with other cached transforms."""
        self.compared, mine = os.getpid(), self.mine
        if mine is None:
            return
        others = [
            note
            for note in self.store.notes(f"p{mine['inputs']}-").values()
            if isinstance(note, dict) and note.get("tag") != mine["tag"] and note.get("process") != mine["process"]
        ]
        if not others or not self.store.add_note(f"w{mine['inputs']}-{mine['tag']}", os.getpid()):
            return  # the same everywhere, or told already in a process of this pipeline
        theirs, what = others[0].get("transforms"), "unknown (hash_transform= gives the fingerprint)"
        if isinstance(theirs, list) and mine["transforms"] is not None:
            what = pipeline_difference(mine["transforms"], theirs)
        warnings.warn(
            f"CacheDataset: other processes of the store {self.store.path} cache the same inputs with other cached "
            f"transforms, so each item is computed and stored once per pipeline. What differs: {what}. {SAME}",
            stacklevel=6,
        )
