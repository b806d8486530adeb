"""The data `swinbench train` learns from: the handwritten digits shipped with swinbench, or an ImageFolder.

Both give batches of (images (N, 3, H, W) fp32 normalized, labels (N,) int64) at the model's input size,
training batches shuffled and augmented from a generator seeded by (seed, epoch) and dropping the last
partial batch, so that every recipe trained with the same seed sees the same images in the same order
with the same augmentation; validation batches in a fixed order, unaugmented, the last one partial.

Data parallel (`rank` of `world` processes, each with `batch` images a step): the digits cut each global
batch of world x batch images of the one-process order into consecutive shares, rank 0's first, so the
ranks together see exactly what one process sees with the global batch; an ImageFolder is sharded by
torch's DistributedSampler (a disjoint, equal share of each epoch's permutation per rank).

Digits (`workbench/data/digits.npz`, see its README): 1,797 8x8 grey images, 10 classes. A fixed split
(a permutation drawn once with DIGITS_SPLIT_SEED) gives DIGITS_TRAIN training and 597 validation images,
whatever --seed is. Augmentation: a random shift by up to one source pixel in each direction. Each batch
is upsampled (bilinear) to the model's input size on the device and repeated to 3 channels.

An ImageFolder (`--data DIR`, read with torchvision): DIR/train and DIR/val when both exist, else DIR split
once into IMAGEFOLDER_VAL_FRACTION for validation and the rest for training. Augmentation: a random resized
crop (scale 0.35-1) and a horizontal flip; validation: resize and center crop, as timm evaluates.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from workbench.errors import UserError

DIGITS_FILE = Path(__file__).resolve().parent / "data" / "digits.npz"
DIGITS_SPLIT_SEED = 0
DIGITS_TRAIN = 1200            # of 1,797; the other 597 validate (one image = 0.17 accuracy points)
IMAGEFOLDER_VAL_FRACTION = 0.1
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

Batch = tuple[torch.Tensor, torch.Tensor]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of one epoch's order and augmentation: the same for every recipe at the same seed."""
    return torch.Generator().manual_seed(seed * 100_003 + epoch)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """-> (images (1797, 8, 8) uint8 0..16, labels (1797,) uint8 0..9), as shipped."""
    with np.load(DIGITS_FILE) as f:
        return f["images"], f["labels"]


@dataclass
class DigitsData:
    """The shipped digits, split once; batches made at `size` (H, W) on the device they are asked for."""

    size: tuple[int, int]
    train_x: torch.Tensor          # (1200, 8, 8) fp32 in [0, 1]
    train_y: torch.Tensor          # (1200,) int64
    val_x: torch.Tensor
    val_y: torch.Tensor
    mean: float
    std: float
    name: str = "digits"
    classes: int = 10

    @classmethod
    def load(cls, size: tuple[int, int]) -> "DigitsData":
        images, labels = load_digits()
        x = torch.from_numpy(images.astype(np.float32) / 16.0)
        y = torch.from_numpy(labels.astype(np.int64))
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
        train, val = order[:DIGITS_TRAIN], order[DIGITS_TRAIN:]
        mean, std = x[train].mean().item(), x[train].std().item()
        return cls(size, x[train], y[train], x[val], y[val], mean, std)

    @property
    def train_size(self) -> int:
        return len(self.train_y)

    @property
    def val_size(self) -> int:
        return len(self.val_y)

    def describe(self) -> dict:
        return {"name": self.name, "classes": self.classes, "train": self.train_size, "val": self.val_size,
                "source": "UCI optical recognition of handwritten digits (via scikit-learn), 8x8 upsampled to "
                          f"{self.size[0]}x{self.size[1]}",
                "augmentation": "random shift by up to 1 source pixel"}

    def _to_images(self, x: torch.Tensor, device) -> torch.Tensor:
        x = x.to(device, non_blocking=True)[:, None]
        x = F.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        return ((x - self.mean) / self.std).expand(-1, 3, -1, -1).contiguous()

    def train_batches(self, epoch: int, batch: int, seed: int, device, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        g = epoch_generator(seed, epoch)
        order = torch.randperm(self.train_size, generator=g)
        shifts = torch.randint(0, 3, (self.train_size, 2), generator=g)
        padded = F.pad(self.train_x, (1, 1, 1, 1))
        step = batch * world
        for start in range(0, self.train_size - step + 1, step):
            idx = order[start + rank * batch:start + (rank + 1) * batch]
            crops = torch.empty(len(idx), 8, 8)
            for dy in range(3):
                for dx in range(3):
                    sel = (shifts[idx, 0] == dy) & (shifts[idx, 1] == dx)
                    crops[sel] = padded[idx[sel], dy:dy + 8, dx:dx + 8]
            yield self._to_images(crops, device), self.train_y[idx].to(device, non_blocking=True)

    def val_batches(self, batch: int, device) -> Iterator[Batch]:
        for start in range(0, self.val_size, batch):
            yield (self._to_images(self.val_x[start:start + batch], device),
                   self.val_y[start:start + batch].to(device, non_blocking=True))


class _SeededItems(torch.utils.data.Dataset):
    """A dataset whose item i draws its random augmentation from its own seed, made of (seed, epoch, i): the
    same crops and flips for the same run seed and epoch whatever the loader processes, their number or
    the training's own draws from torch's generator."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.seed = 0
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(((self.seed * 1_000_003 + self.epoch) * 10_000_019 + int(i)) % 2**63)
            return self.dataset[i]


# What Pillow raises for an image it cannot read: OSError (unreadable, truncated, not an image),
# SyntaxError (a damaged PNG chunk), ValueError, and DecompressionBombError (an image too large to decode)
def _unreadable_image_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, SyntaxError, ValueError)
    try:
        from PIL import Image

        errors += (Image.DecompressionBombError,)
    except ImportError:
        pass
    return errors


class ImageFolderData:
    """An ImageFolder read with torchvision's loaders; `workers` processes decode and augment."""

    def __init__(self, root: Path, size: tuple[int, int], workers: int):
        try:
            from torchvision import datasets, transforms
        except ImportError:
            raise UserError("--data reads an ImageFolder with torchvision, which is not installed here "
                            "(pip install torchvision), or leave --data out to train on the shipped digits") from None
        root = Path(root)
        if not root.is_dir():
            raise UserError(f"--data {root}: " + ("a file, not a folder: give the folder of class folders"
                                                  if root.exists() else "no such folder"))
        halves = [n for n in ("train", "val") if (root / n).is_dir()]
        if len(halves) == 1:    # read as class folders, train/ beside test/ would train "train" against "test"
            other = "val" if halves[0] == "train" else "train"
            raise UserError(f"--data {root}: holds {halves[0]}/ but no {other}/: give both (class folders in each), "
                            "or a folder of class folders")
        train_tf = transforms.Compose([
            transforms.RandomResizedCrop(size, scale=(0.35, 1.0)), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        val_tf = transforms.Compose([
            transforms.Resize(int(math.floor(size[0] / 0.875))), transforms.CenterCrop(size),
            transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        try:
            if (root / "train").is_dir() and (root / "val").is_dir():
                self.train = datasets.ImageFolder(root / "train", train_tf)
                self.val = datasets.ImageFolder(root / "val", val_tf)
                if self.val.classes != self.train.classes:
                    raise UserError(f"--data {root}: train/ and val/ hold different class folders")
                split = "train/ and val/"
            else:
                full_train = datasets.ImageFolder(root, train_tf)
                full_val = datasets.ImageFolder(root, val_tf)
                order = torch.randperm(len(full_train), generator=torch.Generator().manual_seed(0)).tolist()
                n_val = max(1, round(IMAGEFOLDER_VAL_FRACTION * len(order)))
                self.train = torch.utils.data.Subset(full_train, order[n_val:])
                self.val = torch.utils.data.Subset(full_val, order[:n_val])
                self.train.classes = full_train.classes
                split = f"{IMAGEFOLDER_VAL_FRACTION:.0%} held out for validation (fixed)"
        except (FileNotFoundError, RuntimeError) as exc:   # no class folders, no images
            raise UserError(f"--data {root}: not an ImageFolder ({str(exc).splitlines()[0]})") from None
        class_names = self.train.classes
        self.train = _SeededItems(self.train)
        # no more loader processes than CPUs this process may use (torch's own advice; more only contend)
        self.root, self.size, self.workers, self.split = root, size, min(workers, _usable_cpus()), split
        self.name = str(root)
        self.classes = len(class_names)
        if self.classes < 2 or len(self.val) == 0:
            raise UserError(f"--data {root}: needs at least 2 class folders and images to validate on")

    @property
    def train_size(self) -> int:
        return len(self.train)

    @property
    def val_size(self) -> int:
        return len(self.val)

    def describe(self) -> dict:
        return {"name": self.name, "classes": self.classes, "train": self.train_size, "val": self.val_size,
                "source": f"ImageFolder {self.root} ({self.split}) at {self.size[0]}x{self.size[1]}",
                "augmentation": "random resized crop (0.35-1), horizontal flip"}

    def _loader(self, dataset, batch: int, shuffle: bool, generator, device):
        return self._read(torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=shuffle, drop_last=shuffle,
                                                      generator=generator, num_workers=self.workers,
                                                      pin_memory=torch.device(device).type == "cuda"))

    def _read(self, loader) -> Iterator[Batch]:
        """loader's batches; an image that cannot be read is one line naming it (a loader process re-raises
        it with its whole traceback as the message: the last line of that is the error)."""
        batches = iter(loader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except _unreadable_image_errors() as exc:
                text = str(exc).strip()
                if "Original Traceback" in text:   # from a loader process: its last line is 'Type: message'
                    text = text.splitlines()[-1].split(": ", 1)[-1]
                raise UserError(f"--data {self.root}: {text.splitlines()[0] if text else type(exc).__name__}") \
                    from None
            yield batch

    def train_batches(self, epoch: int, batch: int, seed: int, device, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        self.train.seed, self.train.epoch = seed, epoch    # each image's augmentation: per (seed, epoch, image)
        if world == 1:
            # the loader draws its order from this generator: the same per (seed, epoch)
            yield from self._loader(self.train, batch, True, epoch_generator(seed, epoch), device)
            return
        # DistributedSampler: each rank an equal, disjoint share of the epoch's permutation (the tail that
        # does not divide is dropped)
        sampler = torch.utils.data.DistributedSampler(self.train, num_replicas=world, rank=rank, shuffle=True,
                                                      seed=seed * 100_003, drop_last=True)
        sampler.set_epoch(epoch)
        yield from self._read(torch.utils.data.DataLoader(
            self.train, batch_size=batch, sampler=sampler, drop_last=True, num_workers=self.workers,
            generator=epoch_generator(seed * world + rank, epoch), pin_memory=torch.device(device).type == "cuda"))

    def val_batches(self, batch: int, device) -> Iterator[Batch]:
        yield from self._loader(self.val, batch, False, None, device)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def load_data(data: Path | None, size: tuple[int, int], workers: int = 0):
    """`--data DIR` -> ImageFolderData, None -> the shipped DigitsData; batches at `size` (H, W)."""
    return DigitsData.load(size) if data is None else ImageFolderData(Path(data), size, workers)
