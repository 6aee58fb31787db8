"""ImageNet-style image datasets with Pillow and torch only (no torchvision).

    ImageFolder(root, transform)      root/<class>/<image>.jpg, classes sorted by name
    TrainTransform(size)              random resized crop + horizontal flip + normalise
    EvalTransform(size)               resize the short side to size/0.875 + centre crop + normalise
    SyntheticImages(n, classes, size) random images made on the fly (no data needed)

The transforms follow torchvision's ImageNet recipe: RandomResizedCrop
(scale 0.08-1, aspect ratio 3/4-4/3, ten tries then a centre crop) and
RandomHorizontalFlip for training, Resize(size / 0.875) + CenterCrop(size) for
evaluation, then ToTensor and Normalize with the ImageNet mean and std. The
random numbers come from torch's generator, which DataLoader seeds differently
in every worker process.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from PIL import Image

__all__ = ["IMG_EXTENSIONS", "IMAGENET_MEAN", "IMAGENET_STD", "ImageFolder", "TrainTransform",
           "EvalTransform", "SyntheticImages", "to_tensor"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_tensor(img: Image.Image, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """An RGB PIL image as a normalised float32 (3, H, W) tensor."""
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    x = x.to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return x.sub_(m).div_(s)


def _uniform(lo: float, hi: float) -> float:
    return lo + (hi - lo) * torch.rand(()).item()


class TrainTransform:
    """Random resized crop to size x size, random horizontal flip, to tensor."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5):
        self.size, self.scale, self.ratio, self.flip = int(size), scale, ratio, flip

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of the crop, as torchvision's RandomResizedCrop."""
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * _uniform(*self.scale)
            aspect = math.exp(_uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                left = int(torch.randint(0, width - w + 1, ()).item())
                top = int(torch.randint(0, height - h + 1, ()).item())
                return left, top, left + w, top + h
        # Fallback: the largest centre crop within the allowed aspect ratios.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = int(round(height * self.ratio[1])), height
        else:
            w, h = width, height
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def __call__(self, img: Image.Image) -> torch.Tensor:
        box = self.crop_box(*img.size)
        # resize() with a box crops and resamples in one pass.
        img = img.resize((self.size, self.size), Image.BILINEAR, box=box)
        if torch.rand(()).item() < self.flip:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return to_tensor(img)


class EvalTransform:
    """Resize the shorter side to size / crop_fraction, centre crop size x size,
    to tensor (224 -> resize 256, crop 224)."""

    def __init__(self, size: int, crop_fraction: float = 0.875):
        self.size = int(size)
        self.resize = int(round(size / crop_fraction))

    def __call__(self, img: Image.Image) -> torch.Tensor:
        w, h = img.size
        if w <= h:
            nw, nh = self.resize, max(1, int(self.resize * h / w))
        else:
            nw, nh = max(1, int(self.resize * w / h)), self.resize
        img = img.resize((nw, nh), Image.BILINEAR)
        left = int(round((nw - self.size) / 2.0))
        top = int(round((nh - self.size) / 2.0))
        img = img.crop((left, top, left + self.size, top + self.size))
        return to_tensor(img)


class ImageFolder(torch.utils.data.Dataset):
    """root/<class>/<file>: classes are the sub-folder names in sorted order,
    labelled 0..C-1; files with an image extension are taken in sorted order
    (the order is the same on every rank, which DistributedSampler needs).
    Items are (transform(RGB image), label)."""

    def __init__(self, root: str, transform=None, classes: list[str] | None = None):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder: {self.root} is not a directory")
        if classes is None:
            classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not classes:
            raise FileNotFoundError(f"ImageFolder: no class folders in {self.root}")
        self.classes = list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for c in self.classes:
            folder = os.path.join(self.root, c)
            if not os.path.isdir(folder):
                continue  # a class missing from this split (e.g. val) has no images
            for dirpath, dirnames, files in sorted(os.walk(folder, followlinks=True)):
                dirnames.sort()
                for f in sorted(files):
                    if f.lower().endswith(IMG_EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, f), self.class_to_idx[c]))
        if not self.samples:
            raise FileNotFoundError(f"ImageFolder: no images ({', '.join(IMG_EXTENSIONS)}) "
                                    f"under {self.root}")
        self.targets = [t for _, t in self.samples]
        self.transform = transform

    @classmethod
    def from_samples(cls, root: str, classes: list[str], samples: list[tuple[str, int]],
                     transform=None) -> "ImageFolder":
        """An ImageFolder from a listing made elsewhere (e.g. by one rank, sent
        to the others) without touching the file system."""
        self = cls.__new__(cls)
        self.root, self.classes = os.fspath(root), list(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(path, int(target)) for path, target in samples]
        self.targets = [t for _, t in self.samples]
        self.transform = transform
        return self

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return (self.transform(img) if self.transform is not None else img), target


class SyntheticImages(torch.utils.data.Dataset):
    """`length` random (3, size, size) images in `num_classes` classes, made on
    the fly: item i is the same on every rank and in every epoch (seeded by
    seed and i) and its class shifts the colour, so a network can learn it."""

    def __init__(self, length: int, num_classes: int, size: int, seed: int = 0):
        if length < 1 or num_classes < 1 or size < 1:
            raise ValueError("SyntheticImages: length, num_classes and size must be positive")
        self.length, self.num_classes, self.size, self.seed = length, num_classes, size, seed
        g = torch.Generator().manual_seed(seed)
        self.class_colour = torch.randn(num_classes, 3, 1, 1, generator=g)
        self.targets = [(i * 7919 + seed) % num_classes for i in range(length)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        target = self.targets[index]
        img = torch.randn(3, self.size, self.size, generator=g) + self.class_colour[target]
        return img, target
