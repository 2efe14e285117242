"""Tune an image pipeline: JPEG decode with PIL, random crop and flip, a small CNN step.

The JPEG files are made in memory at start-up (no download): 64 x 64 photos-like noise,
kept as encoded bytes, as a dataset of files read from a local disk would be once cached.
Each item is decoded, cropped to 56 x 56 at random, flipped at random and normalised, on
the CPU. The step trains a small CNN on the CPU; on a GPU pass ``--device cuda``.

    python examples/image_pipeline.py [--time-budget 60] [--items 4096] [--out image.json]

Then ``python examples/train_with_best.py image.json`` trains with the tuned loader.
"""

from __future__ import annotations

import argparse
import io

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

import autoloader


def make_jpegs(count: int, size: int = 64, seed: int = 0) -> np.ndarray:
    """``count`` JPEG files, encoded, in one numpy array of bytes with their offsets."""
    rng = np.random.default_rng(seed)
    files = []
    for _ in range(count):
        base = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
        pixels = np.kron(base, np.ones((8, 8, 1), dtype=np.uint8))  # blocky, so it compresses
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        files.append(buffer.getvalue())
    return np.array(files, dtype=object)


class JpegDataset(Dataset[tuple[torch.Tensor, int]]):
    """Decodes and augments one JPEG per item.

    The encoded files are kept in one ``bytes`` blob with offsets (numpy), not in a list
    of ``bytes`` objects: forked workers then share the blob instead of copying each
    file they read (see the report's copy-on-read advice).
    """

    def __init__(self, count: int = 4096, crop: int = 56) -> None:
        files = make_jpegs(count)
        self.blob = np.frombuffer(b"".join(files), dtype=np.uint8)
        self.offsets = np.cumsum([0, *(len(f) for f in files)])
        self.crop = crop

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        start, end = self.offsets[index], self.offsets[index + 1]
        image = Image.open(io.BytesIO(self.blob[start:end].tobytes())).convert("RGB")
        left, top = np.random.randint(0, image.width - self.crop + 1, size=2)
        image = image.crop((left, top, left + self.crop, top + self.crop))
        if np.random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
        pixels = (pixels - 0.5) / 0.25
        return pixels.permute(2, 0, 1).contiguous(), index % 10


class TrainStep:
    """One SGD step of a small CNN on ``device``."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        ).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        images, labels = (t.to(self.device, non_blocking=True) for t in batch)
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--items", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="image.json")
    args = parser.parse_args()

    dataset = JpegDataset(args.items)
    step = TrainStep(args.device)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    print(autoloader.diagnose(loader, step, seconds=5), end="\n\n")
    result = autoloader.tune(
        dataset,
        step,
        batch_size=args.batch_size,
        time_budget=args.time_budget,
        loader_kwargs={"shuffle": True},
    )
    print(autoloader.report(result))
    result.save(args.out)
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
