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
What real pipelines hit (issue 56): ``Invertd`` on an item that another rank or an earlier run computed, a DICOM series
rewritten in place, and transforms whose code uses a namedtuple, a dataclass, an enum or a ``functools.partial``, or
that hold a tensor: each in the processes where it went wrong (2 gloo ranks, fresh interpreters).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings

import numpy as np
import torch
import torch.distributed as dist

from monai.data import CacheDataset
from monai.transforms import Compose, EnsureChannelFirstd, Invertd, LoadImaged, Spacingd
from monai.utils import optional_import
from monai_sharedcache import SharedCacheStore, cache_stats, create_shared_cache
from monai_sharedcache.keys import transforms_key
from tests.layer.layer_utils import TIMEOUT, keyed_dataset, skip_unless_store
from tests.test_utils import DistCall, DistTestCase, SkipIfNoModule

nib, has_nib = optional_import("nibabel")
SHAPE, PIXDIM = (40, 36, 20), (1.5, 1.5, 2.0)  # resampled to 1 mm: 60 x 54 x 39


def write_nifti(path: str, seed: int) -> None:
    data = np.random.default_rng(seed).random(SHAPE, dtype=np.float32)
    nib.save(nib.Nifti1Image(data, np.diag([*PIXDIM, 1.0])), path)


def pipeline() -> Compose:
    return Compose([LoadImaged("image"), EnsureChannelFirstd("image"), Spacingd("image", pixdim=(1.0, 1.0, 1.0))])


def inverted(item: dict, transform: Compose) -> torch.Tensor:
    inverter = Invertd("image", transform=transform, orig_keys="image", nearest_interp=False)
    return torch.as_tensor(inverter(dict(item))["image"]).clone()


# one run of a training script on a persistent store, in a fresh interpreter: what it computed and what it read
SCRIPT = """
import json, sys, warnings
import numpy as np, torch
from monai.data import CacheDataset
from monai.transforms import Compose, EnsureChannelFirstd, Invertd, LoadImaged, NormalizeIntensityd
from monai.transforms import ScaleIntensityRanged, Spacingd
from monai_sharedcache import SharedCacheStore, cache_stats

warnings.simplefilter("ignore")
store = SharedCacheStore(sys.argv[1], persistent=True)
kind, entries = sys.argv[2], json.loads(sys.argv[3])
if kind == "nifti":
    t = Compose([LoadImaged("image"), EnsureChannelFirstd("image"), Spacingd("image", pixdim=(1.0, 1.0, 1.0))])
elif kind == "dicom":
    t = Compose([LoadImaged("image", reader="PydicomReader")])
else:  # transforms that hold a tensor and an array of the value given
    value = float(kind)
    scale = ScaleIntensityRanged("image", a_min=0.0, a_max=1.0, b_min=0.0, b_max=value)
    t = Compose([LoadImaged("image"), scale, NormalizeIntensityd("image", subtrahend=torch.tensor([value]), divisor=np.ones(1))])
ds = CacheDataset(entries, t, runtime_cache=store, hash_func=store.hash_func, hash_transform=store.hash_transform)
facts = {"means": [float(ds[i]["image"].float().mean()) for i in range(len(ds))]}
if kind == "nifti":
    inv = [Invertd("image", transform=t, orig_keys="image")(dict(ds[i]))["image"] for i in range(len(ds))]
    facts.update(shapes=[list(x.shape) for x in inv], sums=[round(float(x.double().sum()), 3) for x in inv])
facts["computed"] = cache_stats(ds)["process"]["computed"]
print(json.dumps(facts), flush=True)
store.close()
"""


def write_series(folder: str, value: int, slices: int = 3) -> None:
    """A CT series of ``slices`` files ``slice<z>.dcm`` of constant ``value``, the names the same at every call."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    os.makedirs(folder, exist_ok=True)
    series = generate_uid()
    for z in range(slices):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = CTImageStorage, generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta, ds.SOPClassUID, ds.SOPInstanceUID = meta, CTImageStorage, meta.MediaStorageSOPInstanceUID
        ds.SeriesInstanceUID = ds.StudyInstanceUID = series
        ds.Modality, ds.Rows, ds.Columns, ds.InstanceNumber = "CT", 4, 5, z + 1
        ds.ImagePositionPatient, ds.ImageOrientationPatient = [0, 0, z], [1, 0, 0, 0, 1, 0]
        ds.PixelSpacing, ds.SliceThickness = [1, 1], 1
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated = ds.BitsStored = 16
        ds.HighBit, ds.PixelRepresentation = 15, 0
        ds.PixelData = np.full((4, 5), value, dtype=np.uint16).tobytes()
        ds.save_as(os.path.join(folder, f"slice{z}.dcm"), enforce_file_format=True)


@skip_unless_store
@SkipIfNoModule("nibabel")
class TestInvertSharedItems(DistTestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.root = os.path.join(self.tmp, "root")
        os.mkdir(self.root, 0o700)
        self.data = []
        for i in range(2):
            self.data.append({"image": os.path.join(self.tmp, f"img{i}.nii.gz")})
            write_nifti(self.data[-1]["image"], i)

    @DistCall(nnodes=1, nproc_per_node=2, timeout=TIMEOUT)
    def test_invertd_in_the_rank_that_read_the_item(self) -> None:
        """Rank 0 computes every item; rank 1 reads them and inverts each as rank 0 does, into the input's shape."""
        # as torchrun starts a rank: no start method set (a spawned rank has spawn's, which Invertd checks by name)
        multiprocessing.set_start_method(None, force=True)
        rank, t = dist.get_rank(), pipeline()
        store = create_shared_cache(root=self.root, timeout=TIMEOUT)
        ds = keyed_dataset(self.data, t, store, progress=False)
        if rank == 0:
            [ds[i] for i in range(len(ds))]
        dist.barrier()
        mine = [inverted(ds[i], t) for i in range(len(ds))]
        direct = [inverted(t(dict(d)), t) for d in self.data]  # computed here, without the cache
        computed = cache_stats(ds)["process"]["computed"]
        everyone: list = [None, None]
        dist.all_gather_object(everyone, ([x.numpy() for x in mine], computed))
        dist.barrier()
        store.close()
        self.assertEqual([c for _, c in everyone], [2, 0])  # rank 1 read what rank 0 computed
        for x, d in zip(mine, direct):
            self.assertEqual(tuple(x.shape), (1, *SHAPE))
            torch.testing.assert_close(x, d)
        for a, b in zip(*(inv for inv, _ in everyone)):
            np.testing.assert_array_equal(a, b)  # the same inverse in the rank that computed and the one that read

    def test_a_pipeline_that_differs_is_still_refused(self) -> None:
        """An item read from a store inverts with the dataset's transforms, and not with another Compose."""
        store = SharedCacheStore(root=self.root)
        self.addCleanup(store.close)
        t = pipeline()
        ds = keyed_dataset(self.data[:1], t, store, progress=False)
        ds[0]
        self.assertEqual(tuple(inverted(ds[0], t).shape), (1, *SHAPE))
        with self.assertRaises(RuntimeError) as raised:
            inverted(ds[0], pipeline())  # the same code, other objects: as upstream, not this pipeline's item
        self.assertIn("most recently applied invertible transform", str(raised.exception.__cause__))
        ref = [op["id"] for op in ds[0]["image"].applied_operations]
        self.assertEqual(ref, [op["id"] for op in t(dict(self.data[0]))["image"].applied_operations])


@skip_unless_store
class TestAcrossRuns(unittest.TestCase):
    """Fresh interpreters on one persistent store."""

    def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.store = os.path.join(self.tmp, "store")

    def run_script(self, kind: str, entries: list) -> dict:
        # from the test's directory: "-c" puts the working directory first on the path
        cmd = [sys.executable, "-c", SCRIPT, self.store, kind, json.dumps(entries)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT * 2, check=False, cwd=self.tmp)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    @SkipIfNoModule("nibabel")
    def test_invertd_in_a_later_run(self) -> None:
        entries = [{"image": os.path.join(self.tmp, "img.nii.gz")}]
        write_nifti(entries[0]["image"], 0)
        first, second = self.run_script("nifti", entries), self.run_script("nifti", entries)
        self.assertEqual((first["computed"], second["computed"]), (1, 0))
        self.assertEqual(second["shapes"], [[1, *SHAPE]])
        self.assertEqual(second["sums"], first["sums"])

    @SkipIfNoModule("pydicom")
    def test_a_series_rewritten_in_place_is_recomputed(self) -> None:
        series = os.path.join(self.tmp, "series")
        write_series(series, 100)
        entries = [{"image": series}]
        self.assertEqual(self.run_script("dicom", entries), {"means": [100.0], "computed": 1})
        self.assertEqual(self.run_script("dicom", entries), {"means": [100.0], "computed": 0})
        write_series(series, 7)  # the same file names, in place
        self.assertEqual(self.run_script("dicom", entries), {"means": [7.0], "computed": 1})
        self.assertEqual(self.run_script("dicom", entries), {"means": [7.0], "computed": 0})

    def test_transforms_that_hold_tensors_are_reused_and_an_edit_recomputes(self) -> None:
        entries = []
        for i in range(2):
            entries.append({"image": os.path.join(self.tmp, f"img{i}.npy")})
            np.save(entries[-1]["image"], np.full((2, 3), float(i), dtype=np.float32))
        first = self.run_script("2.0", entries)
        self.assertEqual(first["computed"], 2)
        self.assertEqual(self.run_script("2.0", entries), first | {"computed": 0})  # another interpreter: reused
        self.assertEqual(self.run_script("3.0", entries)["computed"], 2)  # another tensor: recomputed
        self.assertEqual(self.run_script("2.0", entries)["computed"], 0)


# the fingerprints of transforms whose code uses what real code uses, printed by a fresh interpreter
FINGERPRINTS = """
import collections, dataclasses, enum, functools, json, sys, typing
import numpy as np, torch
from monai.transforms import Transform
from monai.data.utils import pickle_hashing
from monai_sharedcache.keys import stamp_files, transforms_fingerprint

VALUE = float(sys.argv[1])
Pt = collections.namedtuple("Pt", "x y")


class TypedPt(typing.NamedTuple):
    x: float
    y: float = VALUE


@dataclasses.dataclass
class Window:
    low: float = 0.0
    high: float = VALUE


class Mode(enum.Enum):
    CLIP = 1


clip = functools.partial(np.clip, a_min=0, a_max=VALUE)


class UsesNamedTuple(Transform):
    def __call__(self, x):
        return Pt(x, VALUE).x


class UsesTypedNamedTuple(Transform):
    def __call__(self, x):
        return TypedPt(x).y


class UsesDataclass(Transform):
    def __call__(self, x):
        return Window().high * x


class UsesEnumAndPartial(Transform):
    def __call__(self, x):
        return clip(x) if Mode.CLIP else x


class HoldsTensors(Transform):
    def __init__(self):
        self.t, self.a = torch.tensor([VALUE]), np.full(3, VALUE)

    def __call__(self, x):
        return x * self.t


out = {}
for cls in (UsesNamedTuple, UsesTypedNamedTuple, UsesDataclass, UsesEnumAndPartial, HoldsTensors):
    fp = transforms_fingerprint([cls()])
    out[cls.__name__] = [fp.digest, list(fp.private)]
entry = {"image": torch.tensor([VALUE]), "label": np.full(3, VALUE), "id": 1}  # a data entry that holds tensors
out["entry"] = [pickle_hashing(stamp_files(entry)).decode(), []]
print(json.dumps(out))
"""


class TestKeysOfWhatCodeUses(unittest.TestCase):
    def fingerprints(self, value: str, seed: str) -> dict:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        cmd = [sys.executable, "-c", FINGERPRINTS, value]
        # not from the checkout: "-c" puts the working directory first on the path, where the package's sources are
        cwd = tempfile.gettempdir()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT * 2, check=False, env=env, cwd=cwd)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def test_the_same_in_every_interpreter_and_changed_by_an_edit(self) -> None:
        first, again, edited = self.fingerprints("1", "1"), self.fingerprints("1", "2"), self.fingerprints("2", "1")
        for name, (digest, private) in first.items():
            self.assertEqual(private, [], name)
            self.assertEqual(again[name][0], digest, name)  # another interpreter, another hash seed
            self.assertNotEqual(edited[name][0], digest, name)  # another value in what the code uses

    def test_a_member_that_cannot_be_keyed_is_named(self) -> None:
        import socket

        from monai.transforms import Lambda

        class HoldsSocket(Lambda):
            def __init__(self) -> None:
                super().__init__(lambda x: x)
                self.connection = socket.socket()

        transform = HoldsSocket()
        self.addCleanup(transform.connection.close)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            CacheDataset([1], Compose([transform]), runtime_cache=[], hash_transform=transforms_key, progress=False)
        told = [str(w.message) for w in caught if "same key in every process" in str(w.message)]
        self.assertEqual(len(told), 1, [str(w.message) for w in caught])
        self.assertIn("HoldsSocket.connection", told[0])
        self.assertIn("socket", told[0])


if __name__ == "__main__":
    unittest.main()
