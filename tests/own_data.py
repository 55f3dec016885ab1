"""Datasets as users hold them, written with Pillow: a folder of class folders and a CSV
in open-metric-learning's columns, with JPEG, PNG and WebP files in RGB, grayscale,
palette, RGBA and CMYK, and one JPEG stored unturned with an EXIF orientation tag."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

#: The one picture stored on its side: 24 wide and 16 high in the file, its EXIF tag
#: (orientation 6) says to turn it a quarter clockwise, so it shows 16 wide, 24 high.
ROTATED = "class_00/rotated.jpg"
ROTATED_SIZE_ON_DISK = (24, 16)
#: EXIF tag 0x0112, Orientation; 6: the picture is shown turned 90 degrees clockwise.
ORIENTATION, TURNED_CLOCKWISE = 0x0112, 6


def _picture(label: int, index: int, size: tuple[int, int] = (20, 20)) -> Image.Image:
    """An RGB picture whose colour says its class and whose noise says which image it is."""
    rng = np.random.default_rng(1000 * label + index)
    base = np.array([(37 * label) % 256, (91 * label) % 256, (151 * label) % 256], dtype=np.int16)
    noise = rng.integers(-30, 30, (size[1], size[0], 3), dtype=np.int16)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def _save(picture: Image.Image, path: Path, kind: int) -> Path:
    """One of six formats and modes, by ``kind``; returns the path written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kind %= 6
    if kind == 0:
        path = path.with_suffix(".jpg")
        picture.save(path, "JPEG")
    elif kind == 1:
        path = path.with_suffix(".png")
        picture.convert("L").save(path, "PNG")
    elif kind == 2:
        path = path.with_suffix(".png")
        rgba = picture.convert("RGBA")
        rgba.putpixel((0, 0), (0, 0, 0, 0))  # one transparent pixel, black underneath
        rgba.save(path, "PNG")
    elif kind == 3:
        path = path.with_suffix(".webp")
        picture.save(path, "WEBP")
    elif kind == 4:
        path = path.with_suffix(".png")
        picture.convert("P").save(path, "PNG")
    else:
        path = path.with_suffix(".jpg")
        picture.convert("CMYK").save(path, "JPEG")
    return path


def _rotated(path: Path) -> None:
    exif = Image.Exif()
    exif[ORIENTATION] = TURNED_CLOCKWISE
    _picture(0, 99, ROTATED_SIZE_ON_DISK).save(path, "JPEG", exif=exif.tobytes())


def make_class_folders(root: Path, classes: int = 16, per_class: int = 4) -> Path:
    """``root/class_NN/img_M.<ext>``: every class in mixed formats and modes, plus
    :data:`ROTATED` in the first class."""
    for label in range(classes):
        for index in range(per_class):
            _save(
                _picture(label, index), root / f"class_{label:02d}" / f"img_{index}", label + index
            )
    _rotated(root / ROTATED)
    return root


def make_csv(
    folder: Path,
    classes: int = 16,
    per_class: int = 4,
    *,
    split: bool = True,
    roles: bool = False,
    name: str = "products.csv",
) -> Path:
    """``folder/<name>`` with open-metric-learning's columns over ``folder/images/``: the
    first half of the classes ``train``, the rest ``validation`` (its evaluation split),
    with ``is_query``/``is_gallery`` (``roles``: alternating, else every test image both)."""
    rows = []
    for label in range(classes):
        for index in range(per_class):
            written = _save(
                _picture(label, index), folder / "images" / f"{label}_{index}", label * 3 + index
            )
            test = label >= classes // 2
            query = (index % 2 == 0) if roles else True
            gallery = (index % 2 == 1) if roles else True
            rows.append(
                {
                    "label": str(label),
                    "path": written.relative_to(folder).as_posix(),
                    "split": "validation" if test else "train",
                    "is_query": str(query) if test else "",
                    "is_gallery": str(gallery) if test else "",
                    "category": "things",
                }
            )
    path = folder / name
    columns = ["label", "path", "split", "is_query", "is_gallery", "category"]
    if not split:
        columns = ["label", "path"]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_rows(path: Path, header: str, *lines: str) -> Path:
    """A CSV written line by line (the bad inputs of the refusal table)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    return path
