"""Real pipelines: datasets built the way users build them, with the libraries they use.

The tuner's yardstick (see the issue "Real pipelines"): a dataset this project wrote
itself is a weak witness, so these are built with PIL and torch ops, HuggingFace
``datasets``, ``h5py`` and ``webdataset``, over data generated on disk by
:func:`build`. Every item carries its id, so a test can check that one epoch of a tuned
loader holds every sample exactly once.

- ``images``: JPEG files decoded with PIL, cropped, flipped and normalised with torch
  ops as torchvision's ``Normalize`` does: ``(x - mean) / std`` on 3x112x112, a large
  enough op to run torch's intra-op thread pool in the process that calls it.
- ``hf-text``: an Arrow dataset on disk (``save_to_disk`` / ``load_from_disk``) with a
  tokenizing ``with_transform``; DataLoader fetches through its ``__getitems__``.
- ``hdf5``: chunked, gzip-compressed images in HDF5, the file opened lazily in each
  process (h5py's advice); ``hdf5-open-in-init`` opens it in ``__init__`` instead, as
  many users do, and forked workers inherit the handle.
- ``webdataset``: tar shards decoded with PIL, split between workers by
  ``split_by_worker``; ``webdataset-unsharded`` (``workersplitter=None``) makes every
  worker read every shard, ``webdataset-few-shards`` has 2 shards, fewer than the
  workers the tuner tries.
- ``cpu-train``: small JPEG files decoded with PIL and augmented with torch ops, and a
  step that trains a small CNN on the CPU (forward, backward, SGD): the step and the
  workers compete for the cores. ``cpu-train-small`` trains a CNN of half the
  width on batches of 32 (issue 26's case): its step gains less from a second thread,
  and loading is a larger share of the work.

The steps of the first five sleep, as a step on an accelerator leaves the CPU to the
loader. Everything is a module-level class, so that spawned processes can load it.
"""

from __future__ import annotations

import collections
import io
import random
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

# ImageNet's per-channel statistics, as every torchvision pipeline normalises with.
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class SleepStep:
    """A step on an accelerator, standing in: waits ``seconds`` per batch, no CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch: object) -> None:
        time.sleep(self.seconds)


def _picture(rng: np.random.Generator, size: int) -> np.ndarray:
    """A photo-like uint8 HxWx3 image: smooth gradients, a few shapes and sensor noise
    (JPEG and gzip compress it like a real image, not like pure noise)."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    colour = rng.uniform(0, 1, size=(3, 3))
    image = colour[0] * x[..., None] + colour[1] * y[..., None] + colour[2] * (x * y)[..., None]
    for _ in range(3):
        cx, cy, r = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.05, 0.3)
        image[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 1, size=3)
    image = image / max(float(image.max()), 1e-6) * 255 + rng.normal(0, 6, size=image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def _augment(image: torch.Tensor, crop: int) -> torch.Tensor:
    """Random crop and flip of a uint8 CxHxW tensor, then to float and normalised."""
    _, height, width = image.shape
    top, left = random.randint(0, height - crop), random.randint(0, width - crop)
    image = image[:, top : top + crop, left : left + crop]
    if random.random() < 0.5:
        image = image.flip(-1)
    return (image.float().div(255) - _MEAN) / _STD


# images: JPEG files, PIL, torch ops ---------------------------------------------------


class JpegFolder(Dataset[dict[str, Any]]):
    """JPEG files in a folder, named ``{index}_{label}.jpg``; decoded with PIL,
    augmented and normalised with torch ops."""

    def __init__(self, root: str | Path, crop: int = 224) -> None:
        self.files = sorted(Path(root).glob("*.jpg"))
        self.crop = crop

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from PIL import Image

        path = self.files[index]
        with Image.open(path) as image:
            pixels = np.array(image.convert("RGB"))
        tensor = torch.from_numpy(pixels).permute(2, 0, 1)
        number, label = path.stem.split("_")
        return {"image": _augment(tensor, self.crop), "label": int(label), "id": int(number)}


def _write_jpegs(root: Path, count: int, size: int) -> None:
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        Image.fromarray(_picture(rng, size)).save(
            root / f"{index:06d}_{index % 10}.jpg", quality=90
        )


# hf-text: HuggingFace datasets, Arrow on disk, with_transform -------------------------


def _vocabulary(count: int = 3000) -> list[str]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 11))) for _ in range(count)]


class Tokenize:
    """A ``with_transform`` tokenizer: words to sub-word pieces of up to 4 letters,
    hashed into a vocabulary, padded or cut to ``length``; as a real tokenizer, it
    runs on the batch of rows the dataset hands it."""

    def __init__(self, length: int = 128, vocabulary: int = 30_000) -> None:
        self.length = length
        self.vocabulary = vocabulary

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, Any]:
        ids = torch.zeros(len(batch["text"]), self.length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(batch["text"]):
            pieces = [
                zlib.crc32(word[start : start + 4].encode()) % self.vocabulary
                for word in text.lower().split()
                for start in range(0, len(word), 4)
            ][: self.length]
            ids[row, : len(pieces)] = torch.tensor(pieces)
            mask[row, : len(pieces)] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "label": torch.tensor(batch["label"]),
            "id": torch.tensor(batch["id"]),
        }


def _write_hf(root: Path, count: int) -> None:
    import datasets

    rng, words = random.Random(0), _vocabulary()
    texts = [" ".join(rng.choices(words, k=rng.randint(48, 160))) for _ in range(count)]
    table = {"id": list(range(count)), "text": texts, "label": [i % 4 for i in range(count)]}
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(table).save_to_disk(str(root))


def hf_text(root: str | Path) -> Any:
    import datasets

    return datasets.load_from_disk(str(root)).with_transform(Tokenize())


# hdf5: h5py, chunked and gzip-compressed ----------------------------------------------


class H5Images(Dataset[tuple[torch.Tensor, int, int]]):
    """Images in an HDF5 file, opened lazily by each process that reads (h5py's advice:
    a handle must not cross a fork)."""

    def __init__(self, path: str | Path) -> None:
        import h5py

        self.path = str(path)
        with h5py.File(self.path, "r") as file:
            self.length = len(file["labels"])
        self._file: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self.length

    def _open(self) -> Any:
        import os

        import h5py

        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        file = self._open()
        image = torch.from_numpy(file["images"][index])
        return _augment(image, 80), int(file["labels"][index]), index

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": -1}


class H5ImagesOpenedInInit(H5Images):
    """The same, with the file opened once in ``__init__``: forked workers inherit the
    open handle."""

    def __init__(self, path: str | Path) -> None:
        import os

        import h5py

        super().__init__(path)
        self._file, self._pid = h5py.File(self.path, "r"), os.getpid()

    def _open(self) -> Any:
        return self._file


def _write_hdf5(path: Path, count: int, size: int) -> None:
    import h5py

    rng = np.random.default_rng(1)
    images = np.stack([_picture(rng, size).transpose(2, 0, 1) for _ in range(count)])
    with h5py.File(path, "w") as file:
        file.create_dataset(
            "images", data=images, chunks=(1, 3, size, size), compression="gzip", compression_opts=4
        )
        file.create_dataset("labels", data=np.arange(count) % 10)


# webdataset: tar shards ----------------------------------------------------------------


class WdsSample:
    """A webdataset ``map``: the decoded PIL image augmented with torch ops."""

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int, str]:
        pixels = torch.from_numpy(np.array(sample["jpg"].convert("RGB"))).permute(2, 0, 1)
        return _augment(pixels, 112), int(sample["cls"]), sample["__key__"]


def _write_shards(root: Path, count: int, shards: int, size: int) -> list[str]:
    import webdataset as wds
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2)
    per_shard = -(-count // shards)
    urls = []
    for shard in range(shards):
        url = str(root / f"shard-{shard:04d}.tar")
        with wds.TarWriter(url) as sink:
            for index in range(shard * per_shard, min(count, (shard + 1) * per_shard)):
                encoded = io.BytesIO()
                Image.fromarray(_picture(rng, size)).save(encoded, format="JPEG", quality=90)
                sink.write(
                    {"__key__": f"{index:06d}", "jpg": encoded.getvalue(), "cls": index % 10}
                )
        urls.append(url)
    return urls


def webdataset(urls: Sequence[str], *, sharded: bool = True) -> Any:
    import webdataset as wds

    return (
        wds.WebDataset(
            list(urls),
            shardshuffle=False,
            workersplitter=wds.split_by_worker if sharded else None,
        )
        .decode("pil")
        .map(WdsSample())
    )


# cpu-train: a CNN trained on the CPU -------------------------------------------------


class TrainCnn:
    """One SGD step of a small CNN on the CPU, with torch's threads (forward, loss,
    backward, update), as training without an accelerator runs it."""

    def __init__(self, channels: tuple[int, int] = (16, 32)) -> None:
        torch.manual_seed(0)
        first, second = channels
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(3, first, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(first, second, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(second * 16 * 16, 10),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def __call__(self, batch: dict[str, Any]) -> None:
        images, labels = batch["image"], batch["label"]
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()


# The corpus ------------------------------------------------------------------------


@dataclass
class Pipeline:
    """A dataset as users build it, with its training step and loader options.

    Attributes:
        name: the pipeline's name in the corpus.
        dataset: the dataset.
        step: the training step.
        batch_size: samples per batch.
        ids: the id of each sample in a batch from a loader over ``dataset``.
        expected: the ids one epoch must hold, each once.
        loader_kwargs: the DataLoader options kept in every setting.
        hand_workers: the ``num_workers`` a patient person would try by hand.
        what: one line on what it stands for.
    """

    name: str
    dataset: Any
    step: Callable[[Any], object]
    batch_size: int
    ids: Callable[[Any], list[Any]]
    expected: list[Any]
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    hand_workers: tuple[int, ...] = (0, 1, 2, 3, 4)
    what: str = ""
    # The step trains on the CPU: a hand grid sets the training process's threads too.
    cpu_step: bool = False


def _dict_ids(batch: Any) -> list[Any]:
    return [int(i) for i in batch["id"]]


def _tuple_ids(batch: Any) -> list[Any]:
    return [int(i) for i in batch[2]]


def _key_ids(batch: Any) -> list[Any]:
    return list(batch[2])


NAMES = (
    "images",
    "hf-text",
    "hdf5",
    "hdf5-open-in-init",
    "webdataset",
    "webdataset-unsharded",
    "webdataset-few-shards",
    "cpu-train",
    "cpu-train-small",
)


@dataclass(frozen=True)
class Sizes:
    """How much data :func:`build` writes: the tests' small corpus, or the benchmark's."""

    images: int = 2000
    texts: int = 8000
    h5_images: int = 4000
    shard_samples: int = 4000
    shards: int = 16
    small_images: int = 4000
    # Batch sizes are the pipelines' own divided by this: the tests' small corpus keeps
    # enough batches in an epoch for a trial to time (more than its workers' warm-up).
    batch_divisor: int = 1


SMALL = Sizes(
    images=192,
    texts=512,
    h5_images=1024,
    shard_samples=192,
    shards=4,
    small_images=256,
    batch_divisor=4,
)


def train_epoch(loader: Any, pipeline: Pipeline) -> tuple[float, int, str]:
    """One epoch of ``pipeline.step`` over ``loader``: its seconds, its samples, and "ok"
    or how its samples differ from the dataset's (repeated, lost)."""
    started = time.perf_counter()
    counts: collections.Counter[Any] = collections.Counter()
    for batch in loader:
        pipeline.step(batch)
        counts.update(pipeline.ids(batch))
    seconds = time.perf_counter() - started
    repeats = sum(n - 1 for n in counts.values() if n > 1)
    lost = len(set(pipeline.expected) - set(counts))
    check = "ok" if not repeats and not lost else f"{repeats} repeated, {lost} lost"
    return seconds, sum(counts.values()), check


def build(name: str, root: str | Path, sizes: Sizes = Sizes()) -> Pipeline:
    """The pipeline ``name`` (see :data:`NAMES`), its data written under ``root`` the
    first time and reused after."""
    root = Path(root)
    builders: dict[str, Callable[[Path, Sizes], Pipeline]] = {
        "images": _images,
        "hf-text": _hf_text,
        "hdf5": _hdf5,
        "hdf5-open-in-init": _hdf5,
        "webdataset": _webdataset,
        "webdataset-unsharded": _webdataset,
        "webdataset-few-shards": _webdataset,
        "cpu-train": _cpu_train,
        "cpu-train-small": _cpu_train,
    }
    if name not in builders:
        raise ValueError(f"unknown pipeline {name!r}; the corpus has {', '.join(NAMES)}")
    pipeline = builders[name](root, sizes)
    pipeline.name = name
    pipeline.batch_size = max(1, pipeline.batch_size // sizes.batch_divisor)
    if name == "hdf5-open-in-init":
        pipeline.dataset = H5ImagesOpenedInInit(pipeline.dataset.path)
        pipeline.what = "HDF5 (h5py), the file opened in __init__ and inherited by workers"
    if name == "cpu-train-small":
        pipeline.step = TrainCnn(channels=(8, 16))
        pipeline.batch_size = max(1, 32 // sizes.batch_divisor)
        pipeline.what = "small JPEG files, PIL decode, torch ops; a narrow CNN on the CPU, batch 32"
    if name != "webdataset" and name.startswith("webdataset"):
        unsharded = name == "webdataset-unsharded"
        urls = _shard_urls(root, sizes, shards=sizes.shards if unsharded else 2)
        pipeline.dataset = webdataset(urls, sharded=not unsharded)
        pipeline.what = (
            "WebDataset with workersplitter=None: every worker reads every shard"
            if unsharded
            else "WebDataset with 2 shards: fewer than the workers tried"
        )
    return pipeline


def _image_folder(root: Path, count: int, size: int) -> Path:
    folder = root / f"images-{size}px-{count}"
    if not (folder / ".done").exists():
        _write_jpegs(folder, count, size=size)
        (folder / ".done").touch()
    return folder


def _images(root: Path, sizes: Sizes) -> Pipeline:
    return Pipeline(
        name="images",
        dataset=JpegFolder(_image_folder(root, sizes.images, 256)),
        step=SleepStep(0.02),
        batch_size=32,
        ids=_dict_ids,
        expected=list(range(sizes.images)),
        loader_kwargs={"shuffle": True},
        what="JPEG files, PIL decode, torch-op crop/flip/normalize; 20 ms step",
    )


def _hf_text(root: Path, sizes: Sizes) -> Pipeline:
    folder = root / f"hf-text-{sizes.texts}"
    if not (folder / ".done").exists():
        _write_hf(folder, sizes.texts)
        (folder / ".done").touch()
    return Pipeline(
        name="hf-text",
        dataset=hf_text(folder),
        step=SleepStep(0.01),
        batch_size=128,
        ids=_dict_ids,
        expected=list(range(sizes.texts)),
        loader_kwargs={"shuffle": True},
        what="HF datasets: Arrow on disk, with_transform tokenizer; 10 ms step",
    )


def _hdf5(root: Path, sizes: Sizes) -> Pipeline:
    path = root / f"images-{sizes.h5_images}.h5"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".partial")
        _write_hdf5(temporary, sizes.h5_images, size=96)
        temporary.rename(path)
    return Pipeline(
        name="hdf5",
        dataset=H5Images(path),
        step=SleepStep(0.01),
        batch_size=64,
        ids=_tuple_ids,
        expected=list(range(sizes.h5_images)),
        loader_kwargs={"shuffle": True},
        what="HDF5 (h5py), chunked + gzip, opened lazily per process; 10 ms step",
    )


def _shard_urls(root: Path, sizes: Sizes, *, shards: int) -> list[str]:
    folder = root / f"shards-{sizes.shard_samples}-{shards}"
    if not (folder / ".done").exists():
        urls = _write_shards(folder, sizes.shard_samples, shards, size=128)
        (folder / ".done").touch()
        return urls
    return sorted(str(p) for p in folder.glob("shard-*.tar"))


def _webdataset(root: Path, sizes: Sizes) -> Pipeline:
    return Pipeline(
        name="webdataset",
        dataset=webdataset(_shard_urls(root, sizes, shards=sizes.shards)),
        step=SleepStep(0.01),
        batch_size=32,
        ids=_key_ids,
        expected=[f"{i:06d}" for i in range(sizes.shard_samples)],
        what="WebDataset tar shards, split_by_worker, PIL decode; 10 ms step",
    )


def _cpu_train(root: Path, sizes: Sizes) -> Pipeline:
    return Pipeline(
        name="cpu-train",
        dataset=JpegFolder(_image_folder(root, sizes.small_images, 96), crop=64),
        step=TrainCnn(),
        batch_size=64,
        ids=_dict_ids,
        expected=list(range(sizes.small_images)),
        loader_kwargs={"shuffle": True},
        what="small JPEG files, PIL decode, torch ops; a CNN trained on the CPU",
        cpu_step=True,
    )


def epoch_ids(loader: Any, ids: Callable[[Any], list[Any]]) -> Iterator[Any]:
    """The id of every sample one epoch of ``loader`` yields, in order."""
    for batch in loader:
        yield from ids(batch)
