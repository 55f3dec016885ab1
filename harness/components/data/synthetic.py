"""``synthetic``: the embedded, procedurally generated fine-grained dataset.

In the spirit of CUB: every image shows one "creature" made of four parts
(body, head, wing, tail); a class is one combination of part attributes
(shape, colour, texture per part). Classes come in families that share most
attributes and differ in one or two parts, so telling them apart needs the
discriminative part, as in fine-grained birds. Each creature is drawn at a
random position, scale and orientation over a cluttered background of
distractor shapes, and a ground-truth label map (0 background, 1-4 the visible
pixels of each part) is saved beside every image so explanations can be scored.

``synthetic-closeup`` draws the same classes, backgrounds, poses and splits with the
creature about twice as large and nearer the centre (:data:`FRAMINGS`): the creature fills
about a third of the image instead of a tenth, so its parts span cells of a coarse
feature map (the explanation benchmark's dataset, ``protocols/explain.toml``).

Generation is deterministic in the seed, happens once on first use, and is
cached under ``<data root>/synthetic/v1-seed<seed>`` (``v1-closeup-seed<seed>``); it is written to a
temporary folder and renamed, so an interrupted generation leaves nothing half
written. Besides the PNG files (for people to look at) the images are packed
into one ``images.npy`` that training reads memory-mapped: decoding PNGs every
epoch would cost more than the rest of the data pipeline.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from harness.base.atomic import atomic_write, publish_folder
from harness.components.data.base import (
    ArrayImageSet,
    DatasetSplits,
    default_data_root,
    register_dataset,
)

VERSION = "v1"
PARTS = ("body", "head", "wing", "tail")
SHAPES = ("ellipse", "rectangle", "triangle", "diamond")
COLOURS = {
    "red": (214, 48, 49),
    "orange": (240, 147, 43),
    "yellow": (246, 229, 80),
    "green": (39, 174, 96),
    "blue": (41, 98, 255),
    "purple": (142, 68, 173),
}
TEXTURES = ("solid", "stripes", "dots")
#: Part layout in the creature's own frame (units of image size): centre, half-extent.
LAYOUT = {
    "body": ((0.0, 0.0), (0.17, 0.11)),
    "head": ((0.0, -0.19), (0.085, 0.085)),
    "wing": ((0.15, 0.02), (0.09, 0.06)),
    "tail": ((0.0, 0.19), (0.07, 0.08)),
}
DRAW_ORDER = ("tail", "wing", "body", "head")  # later parts occlude earlier ones

#: Where and how large a creature is drawn: its scale (a fraction of the image's side)
#: and its centre's range per axis. ``wide``: ``synthetic``; ``closeup``: ``synthetic-closeup``.
FRAMINGS = {
    "wide": {"scale": (0.75, 1.15), "centre": (0.32, 0.68)},
    "closeup": {"scale": (1.4, 1.9), "centre": (0.42, 0.58)},
}

NUM_CLASSES = 120
FAMILY_SIZE = 6
IMAGES_PER_CLASS = 24
IMAGE_SIZE = 128
NUM_TRAIN_CLASSES = 60


def make_classes(rng: np.random.Generator, num_classes: int = NUM_CLASSES) -> list[dict]:
    """Families of classes: a random base, then variants that change one or two part attributes."""
    classes: list[dict] = []
    seen: set[str] = set()
    colours = list(COLOURS)

    def random_part():
        return {
            "shape": str(rng.choice(SHAPES)),
            "colour": str(rng.choice(colours)),
            "texture": str(rng.choice(TEXTURES)),
        }

    while len(classes) < num_classes:
        base = {p: random_part() for p in PARTS}
        family = [base]
        while len(family) < FAMILY_SIZE:
            variant = json.loads(json.dumps(base))
            for _ in range(int(rng.integers(1, 3))):
                part = str(rng.choice(PARTS))
                attr = str(rng.choice(("shape", "colour", "texture")))
                options = {"shape": SHAPES, "colour": colours, "texture": TEXTURES}[attr]
                variant[part][attr] = str(rng.choice(options))
            family.append(variant)
        for cls in family:
            key = json.dumps(cls, sort_keys=True)
            if key not in seen and len(classes) < num_classes:
                seen.add(key)
                classes.append(cls)
    return classes


def _unit_polygon(shape: str) -> np.ndarray:
    if shape == "ellipse":
        t = np.linspace(0, 2 * np.pi, 32, endpoint=False)
        return np.stack([np.cos(t), np.sin(t)], 1)
    if shape == "rectangle":
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=float)
    if shape == "triangle":
        return np.array([[0, -1], [1, 1], [-1, 1]], dtype=float)
    return np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], dtype=float)  # diamond


def _texture(colour: tuple, texture: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """RGB texture in the creature's frame (so stripes turn with the creature)."""
    base = np.array(colour, dtype=float)
    dark = base * 0.45
    if texture == "stripes":
        on = np.sin(u * 70.0) > 0
    elif texture == "dots":
        on = ((np.mod(u * 22.0, 1.0) - 0.5) ** 2 + (np.mod(v * 22.0, 1.0) - 0.5) ** 2) < 0.07
    else:
        on = np.zeros_like(u, dtype=bool)
    return np.where(on[..., None], dark, base)


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Gradient plus distractor shapes and noise: clutter that carries no class signal."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    c0, c1 = rng.uniform(60, 200, 3), rng.uniform(60, 200, 3)
    w = (xx * np.cos(rng.uniform(0, 6.3)) + yy * np.sin(rng.uniform(0, 6.3)))[..., None]
    img = c0 * (1 - w) + c1 * w
    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(8, 16))):
        poly = _unit_polygon(str(rng.choice(SHAPES))) * rng.uniform(2, 9)
        angle = rng.uniform(0, 2 * np.pi)
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        pts = poly @ rot.T + rng.uniform(0, size, 2)
        fill = tuple(int(c) for c in rng.uniform(30, 230, 3))
        draw.polygon([tuple(p) for p in pts], fill=fill)
    out = np.asarray(canvas, dtype=float) + rng.normal(0, 8, (size, size, 3))
    return np.clip(out, 0, 255)


def render(
    cls: dict, rng: np.random.Generator, size: int = IMAGE_SIZE, framing: str = "wide"
) -> tuple[np.ndarray, np.ndarray]:
    """One image (H x W x 3 uint8) of class ``cls`` and its part label map (H x W uint8),
    the creature placed as ``framing`` says (:data:`FRAMINGS`). The framings draw the same
    random numbers: one image differs between them by the creature's size and place only."""
    img = _background(rng, size)
    labels = np.zeros((size, size), dtype=np.uint8)
    frame = FRAMINGS[framing]
    scale = rng.uniform(*frame["scale"]) * size
    angle = rng.uniform(0, 2 * np.pi)
    centre = rng.uniform(*frame["centre"], 2) * size
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    yy, xx = np.mgrid[0:size, 0:size].astype(float)
    local = (np.stack([xx - centre[0], yy - centre[1]], -1) @ rot) / scale  # inverse rotation
    for part in DRAW_ORDER:
        (cx, cy), (hx, hy) = LAYOUT[part]
        spec = cls[part]
        poly = _unit_polygon(spec["shape"]) * [hx, hy] + [cx, cy]
        pts = (poly * scale) @ rot.T + centre
        mask_img = Image.new("L", (size, size), 0)
        ImageDraw.Draw(mask_img).polygon([tuple(p) for p in pts], fill=1)
        mask = np.asarray(mask_img, dtype=bool)
        # The texture at the part's pixels only: it is a function of each pixel's own
        # coordinates, so this is the full-image texture masked, at a fraction of the cost.
        at = local[mask]
        img[mask] = _texture(COLOURS[spec["colour"]], spec["texture"], at[:, 0], at[:, 1])
        labels[mask] = PARTS.index(part) + 1
    return img.astype(np.uint8), labels


def synthetic_root(data_root: Path | None, seed: int = 0, framing: str = "wide") -> Path:
    name = f"{VERSION}-seed{seed}" if framing == "wide" else f"{VERSION}-{framing}-seed{seed}"
    return Path(data_root or default_data_root()) / "synthetic" / name


def generate(
    target: Path,
    seed: int = 0,
    *,
    num_classes: int = NUM_CLASSES,
    images_per_class: int = IMAGES_PER_CLASS,
    size: int = IMAGE_SIZE,
    framing: str = "wide",
) -> Path:
    """Write the dataset to ``target`` atomically (temp folder, then rename)."""
    if (target / "manifest.json").is_file():
        return target
    rng = np.random.default_rng(seed)
    classes = make_classes(rng, num_classes)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        items, pixels = [], []
        for c, cls in enumerate(classes):
            (tmp / "images" / f"{c:03d}").mkdir(parents=True)
            (tmp / "masks" / f"{c:03d}").mkdir(parents=True)
            for i in range(images_per_class):
                # One generator per image: any image can be regenerated on its own.
                img, lab = render(cls, np.random.default_rng([seed, c, i]), size, framing)
                rel = f"{c:03d}/{i:03d}.png"
                Image.fromarray(img).save(tmp / "images" / rel)
                Image.fromarray(lab).save(tmp / "masks" / rel)
                items.append({"path": f"images/{rel}", "mask": f"masks/{rel}", "label": c})
                pixels.append(img)
        # The pack training reads (:func:`packed_images`), from the pixels just drawn: the
        # PNG files are lossless, so decoding them again would give the same array.
        np.save(tmp / "images.npy", np.stack(pixels))
        manifest = {
            "version": VERSION,
            "seed": seed,
            **({"framing": framing} if framing != "wide" else {}),
            "parts": list(PARTS),
            "classes": classes,
            "num_train_classes": min(NUM_TRAIN_CLASSES, num_classes // 2),
            "items": items,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        try:  # fsynced, then renamed: a crash never leaves a manifest without its images
            publish_folder(tmp, target)
        except OSError:  # another process finished first
            if not (target / "manifest.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def packed_images(root: Path, paths: list[str]) -> np.ndarray:
    """``images.npy`` (N x H x W x 3 uint8, manifest order), packed once, memory-mapped."""
    packed = root / "images.npy"
    if packed.is_file():
        try:
            images = np.load(packed, mmap_mode="r")
            if images.shape[0] == len(paths):
                return images
            raise ValueError(f"{images.shape[0]} images for {len(paths)} listed")
        except (OSError, ValueError) as err:  # cut short (a full disk, a killed packer)
            print(f"synthetic cache {packed} is corrupt ({err}); packing it again", file=sys.stderr)
            packed.unlink(missing_ok=True)
    if not packed.is_file():
        stack = np.stack([np.asarray(Image.open(root / p).convert("RGB")) for p in paths])
        # A unique temp name per process (harness.base.atomic): workers that start together each
        # pack, and the last atomic replace wins with identical bytes.
        atomic_write(packed, lambda fh: np.save(fh, stack))
    return np.load(packed, mmap_mode="r")


def load_part_mask(root: Path, relpath: str) -> np.ndarray:
    """The part label map (0 background, i = PARTS[i-1]) of one image."""
    return np.asarray(Image.open(root / relpath))


def synthetic_train_classes(data_root: Path | None, seed: int = 0, framing: str = "wide") -> int:
    """The training classes of the set under ``data_root``: its manifest's, or (not there
    yet, or cut short) those of the set :func:`load_synthetic` generates there; nothing is
    generated here."""
    manifest = synthetic_root(data_root, seed, framing) / "manifest.json"
    try:
        return int(json.loads(manifest.read_text())["num_train_classes"])
    except (OSError, ValueError, KeyError, TypeError):
        return min(NUM_TRAIN_CLASSES, NUM_CLASSES // 2)


@register_dataset(
    "synthetic",
    description=f"embedded procedural fine-grained creatures: {NUM_CLASSES} classes x "
    f"{IMAGES_PER_CLASS} images, part masks; classes 0-{NUM_TRAIN_CLASSES - 1} train",
    folder="synthetic",
    marker="manifest.json",
    embedded=True,
    train_classes=synthetic_train_classes,
)
def load_synthetic(
    data_root: Path | None,
    seed: int = 0,
    *,
    num_classes: int = NUM_CLASSES,
    images_per_class: int = IMAGES_PER_CLASS,
    size: int = IMAGE_SIZE,
    framing: str = "wide",
) -> DatasetSplits:
    """The set under ``data_root``, generated there first if it is not (or again if its
    manifest is cut short); ``num_classes``, ``images_per_class`` and ``size``: the set it
    generates (a small one for tests; a set already there is read as it is); ``framing``:
    :data:`FRAMINGS`."""
    sizes = {"num_classes": num_classes, "images_per_class": images_per_class, "size": size}
    root = synthetic_root(data_root, seed, framing)
    root = generate(root, seed, **sizes, framing=framing)
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        items = manifest["items"]
    except (ValueError, KeyError, TypeError) as err:  # cut short: generated again
        print(
            f"synthetic cache {root} is corrupt (manifest.json: {err}); generating it again",
            file=sys.stderr,
        )
        shutil.rmtree(root)
        root = generate(root, seed, **sizes, framing=framing)
        manifest = json.loads((root / "manifest.json").read_text())
        items = manifest["items"]
    labels = np.array([it["label"] for it in items], dtype=np.int64)
    paths = [it["path"] for it in items]
    masks = {it["path"]: it["mask"] for it in items}
    is_train = labels < manifest["num_train_classes"]
    tr, te = np.flatnonzero(is_train), np.flatnonzero(~is_train)
    images = packed_images(root, paths)
    # Keys stay the PNG paths: the split digest names the same images either way.
    return DatasetSplits(
        "synthetic" if framing == "wide" else f"synthetic-{framing}",
        train=ArrayImageSet(images[tr], labels[tr], [paths[i] for i in tr]),
        test=ArrayImageSet(images[te], labels[te], [paths[i] for i in te]),
        extras={"root": root, "masks": masks, "parts": manifest["parts"]},
    )


@register_dataset(
    "synthetic-closeup",
    description="the synthetic creatures drawn about twice as large (a third of the image): "
    "the explanation benchmark's dataset",
    folder="synthetic",
    marker="manifest.json",
    embedded=True,
    train_classes=lambda data_root: synthetic_train_classes(data_root, framing="closeup"),
)
def load_synthetic_closeup(
    data_root: Path | None,
    seed: int = 0,
    *,
    num_classes: int = NUM_CLASSES,
    images_per_class: int = IMAGES_PER_CLASS,
    size: int = IMAGE_SIZE,
) -> DatasetSplits:
    """``synthetic`` with the ``closeup`` framing (:data:`FRAMINGS`)."""
    sizes = {"num_classes": num_classes, "images_per_class": images_per_class, "size": size}
    return load_synthetic(data_root, seed, **sizes, framing="closeup")
