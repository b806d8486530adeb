"""An ImageFolder's augmentation is a function of (seed, epoch, image) alone, and every kind of image Pillow
cannot read is one line."""
from __future__ import annotations

import pytest
import torch

from workbench.errors import UserError

pytest.importorskip("torchvision")


def image_folder(root, n: int = 12):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c in range(2):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(n):
            pixels = (torch.rand(20, 24, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def epoch_images(data, seed: int, epoch: int = 0) -> torch.Tensor:
    return torch.cat([x for x, _ in data.train_batches(epoch, 4, seed, "cpu")])


def test_the_augmentation_is_the_same_whatever_the_workers_and_the_global_generator(tmp_path):
    from workbench.datasets import ImageFolderData

    root = image_folder(tmp_path / "images")
    torch.manual_seed(1)
    inline = epoch_images(ImageFolderData(root, (16, 16), 0), seed=3)
    torch.manual_seed(2)                   # the training's own draws move torch's generator
    again = epoch_images(ImageFolderData(root, (16, 16), 0), seed=3)
    workers = epoch_images(ImageFolderData(root, (16, 16), 2), seed=3)
    assert torch.equal(inline, again) and torch.equal(inline, workers)
    assert not torch.equal(inline, epoch_images(ImageFolderData(root, (16, 16), 0), seed=3, epoch=1))
    assert not torch.equal(inline, epoch_images(ImageFolderData(root, (16, 16), 0), seed=4))


@pytest.mark.parametrize("kind", ["damaged PNG chunk", "decompression bomb", "truncated"])
def test_an_image_pillow_cannot_read_is_one_line(tmp_path, kind, monkeypatch):
    from PIL import Image

    from workbench.datasets import ImageFolderData

    root = image_folder(tmp_path / "images", n=4)
    bad = root / "class0" / "0.png"
    data = bytearray(bad.read_bytes())
    if kind == "damaged PNG chunk":
        data[12:16] = b"XXXX"               # the IHDR chunk's type: Pillow raises SyntaxError
        bad.write_bytes(bytes(data))
    elif kind == "truncated":
        bad.write_bytes(bytes(data[:40]))
    else:
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)   # 480 pixels: past twice the limit
    loaded = ImageFolderData(root, (16, 16), 0)
    with pytest.raises(UserError, match=f"--data {root}: "):
        for _ in loaded.train_batches(0, 2, 0, "cpu"):
            pass
        for _ in loaded.val_batches(2, "cpu"):
            pass


@pytest.mark.parametrize("halves", [("train", "test"), ("train",), ("val",)])
def test_one_of_train_and_val_alone_is_refused_not_read_as_classes(tmp_path, halves):
    """train/ beside test/ read as class folders would train a classifier of "train" against "test"."""
    from workbench.datasets import ImageFolderData

    for half in halves:
        image_folder(tmp_path / "images" / half, n=3)
    with pytest.raises(UserError, match="holds (train|val)/ but no (val|train)/"):
        ImageFolderData(tmp_path / "images", (16, 16), 0)
