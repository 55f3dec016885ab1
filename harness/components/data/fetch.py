"""Fetching the four benchmarks into their official layouts: download (resumable), verify,
unpack beside the target, check against the dataset's known facts, then publish in one rename.

The order is the safety argument. Nothing appears under the dataset's own folder until
every step has passed: the archive's checksum (the original release's md5, or a sha256
the user pins with ``--sha256``), a safe extraction (tarfile's ``data`` filter; zip members
checked by hand, since :mod:`zipfile` has no filter), and a load of the unpacked tree by
the same loader ``run`` uses, held to the official per-split image and class counts
(:class:`~harness.components.data.base.OfficialCounts`) with every listed image present.
Only then does :func:`~harness.base.atomic.publish_folder` rename the staged tree into
place, with a record (``FETCH_RECORD``) of what was fetched and what was checked.

What may stay in the data root after a failure: only the partial download of a transfer
that broke off after some bytes arrived (``.<archive>.<url hash>.part``), which the error
line names and the next ``fetch`` resumes with an HTTP Range request. Every other failure
(an HTTP error, a refused or stalled connection before any byte, a wrong checksum, a
damaged archive, a member escaping the target, counts that differ) leaves nothing.

Sources (``docs/datasets.md`` gives each one's size and licence terms):

* CUB-200-2011: Caltech DATA record 65de6-vp158 (the original vision.caltech.edu host
  is gone); md5 of ``CUB_200_2011.tgz`` as the field's loaders have recorded it since
  the original release.
* SOP: the original ``ftp.cs.stanford.edu`` host is gone; the Google Drive copy that
  pytorch-metric-learning (``src/pytorch_metric_learning/datasets/sop.py``) and
  open-metric-learning download today, checked against the original zip's md5.
* Cars196: the original ``ai.stanford.edu/~jkrause`` and ``imagenet.stanford.edu`` hosts
  are gone and the mirrors in use need an account (Kaggle): a manual step, then
  ``fetch --from``; both files checked against the originals' md5.
* In-Shop: DeepFashion's Google Drive folder, behind the authors' agreement form, with
  no published checksum: a manual step, then ``fetch --from``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import cast

from harness.base.atomic import atomic_write_json, publish_folder
from harness.base.errors import HarnessError
from harness.components.data.base import DATASETS, FileImageSet, OfficialCounts, default_data_root
from harness.components.data.download import DEFAULT_TIMEOUT, download

__all__ = [
    "Part",
    "DatasetSource",
    "SOURCES",
    "FETCH_RECORD",
    "FetchResult",
    "fetch_dataset",
    "fetch_command",
    "fetch_record",
    "DEFAULT_TIMEOUT",
]

#: The record a fetch leaves in the dataset's folder: what was fetched and what was checked.
FETCH_RECORD = "dml-harness-fetch.json"
_BLOCK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One file of a dataset's release.

    ``into``: where it goes, relative to the staging folder whose ``<dataset folder>``
    becomes the dataset (an archive is extracted there; another file is copied there).
    ``url`` empty: no scripted download (the dataset's ``manual`` paragraph says where
    to get it). ``md5`` / ``sha256``: the checksums known for the original file.
    """

    filename: str
    into: str = ""
    url: str = ""
    md5: str = ""
    sha256: str = ""

    @property
    def kind(self) -> str:
        name = self.filename.lower()
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            return "tar"
        return "zip" if name.endswith(".zip") else "file"


@dataclass(frozen=True)
class DatasetSource:
    """Where a dataset's release comes from and what it must unpack to."""

    name: str
    parts: tuple[Part, ...]
    #: The official counts the unpacked tree must have (default: the registry's).
    counts: OfficialCounts | None = None
    #: What the user must do by hand when a part has no ``url``.
    manual: str = ""
    homepage: str = ""

    @property
    def folder(self) -> str:
        return DATASETS.get(self.name).folder

    def expected_counts(self) -> OfficialCounts:
        counts = self.counts or DATASETS.get(self.name).official
        assert counts is not None  # every source is a benchmark with official counts
        return counts


SOURCES: dict[str, DatasetSource] = {
    "cub200": DatasetSource(
        "cub200",
        (
            Part(
                "CUB_200_2011.tgz",
                url="https://data.caltech.edu/records/65de6-vp158/files/CUB_200_2011.tgz",
                md5="97eceeb196236b17998738112f37df78",
            ),
        ),
        homepage="https://www.vision.caltech.edu/datasets/cub_200_2011/",
    ),
    "sop": DatasetSource(
        "sop",
        (
            Part(
                "Stanford_Online_Products.zip",
                url="https://drive.usercontent.google.com/download?id=1TclrpQOF_ullUP99wk_gjGN8pKvtErG8"
                "&export=download&confirm=t",
                md5="7f73d41a2f44250d4779881525aea32e",
            ),
        ),
        homepage="https://cvgl.stanford.edu/projects/lifted_struct/",
    ),
    "cars196": DatasetSource(
        "cars196",
        (
            Part("car_ims.tgz", into="cars196", md5="d5c8f0aa497503f355e17dc7886c3f14"),
            Part("cars_annos.mat", into="cars196", md5="b407c6086d669747186bd1d764ff9dbc"),
        ),
        manual="Cars196's original host (ai.stanford.edu/~jkrause/cars) is offline and its mirrors need an "
        "account: download the original car_ims.tgz and cars_annos.mat (e.g. from a Kaggle copy of "
        "the Stanford Cars release); both are checked against the originals' md5.",
        homepage="https://ai.stanford.edu/~jkrause/cars/car_dataset.html",
    ),
    "inshop": DatasetSource(
        "inshop",
        (Part("img.zip", into="inshop/Img"), Part("list_eval_partition.txt", into="inshop")),
        manual="In-Shop is shared through DeepFashion's Google Drive folder after the authors' agreement "
        "form: from 'In-shop Clothes Retrieval Benchmark' download Img/img.zip and "
        "Eval/list_eval_partition.txt; no checksum is published (add --sha256 HEX per file to pin "
        "the copy you trust).",
        homepage="https://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html",
    ),
}


def fetch_command(name: str, data_root: Path | None) -> str:
    """The exact command that fetches ``name`` (named by ``run``'s missing-dataset error)."""
    source = SOURCES[name]
    root = f" --data-root {data_root}" if data_root is not None else ""
    local = (
        "".join(f" --from {p.filename}" for p in source.parts)
        if not all(p.url for p in source.parts)
        else ""
    )
    return f"python -m harness datasets fetch {name}{root}{local}"


def fetch_record(folder: Path) -> dict | None:
    """The record a fetch left in ``folder``, or None (not fetched by the harness)."""
    try:
        return json.loads((folder / FETCH_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclass
class FetchResult:
    folder: Path
    #: False: the dataset was already there, nothing was done.
    fetched: bool
    record: dict = field(default_factory=dict)


def fetch_dataset(
    name: str,
    data_root: Path | None = None,
    *,
    local_files: Sequence[Path] = (),
    url: str | None = None,
    sha256: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
    progress: bool = False,
    say: Callable[[str], None] = print,
) -> FetchResult:
    """Fetch ``name`` into ``data_root`` (default :func:`default_data_root`), in its official layout.

    ``local_files``: the parts, in :attr:`DatasetSource.parts` order, already on disk
    (``--from``); else each part is downloaded, ``url`` replacing a one-part dataset's.
    ``sha256``: one pinned checksum per part, checked besides any published one.
    """
    source = SOURCES.get(name)
    if source is None:
        raise HarnessError(
            f"dataset '{name}' cannot be fetched; fetchable: {', '.join(sorted(SOURCES))}"
        )
    root = Path(data_root) if data_root is not None else default_data_root()
    present = _present(name, root)
    if present is not None:
        record = fetch_record(present)
        state = (
            "fetched and verified"
            if record
            else "present (not fetched by the harness, so not verified)"
        )
        say(f"{name}: {state} at {present}; nothing to do")
        return FetchResult(present, False, record or {})
    parts = _resolve_parts(source, local_files, url, sha256, data_root)
    target = root / source.folder
    if target.exists():
        raise HarnessError(
            f"{target} exists but holds no {DATASETS.get(name).marker}: move it away, then fetch again"
        )
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{source.folder}.fetch-", dir=root))
    try:
        record = _stage(
            source, parts, local_files, root, staging, timeout=timeout, progress=progress, say=say
        )
        try:
            publish_folder(staging / source.folder, target)
        except OSError as err:
            raise HarnessError(
                f"cannot move the fetched {name} into {target}: {err.strerror or err}"
            ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                root.rmdir()  # only if empty: a failure leaves no new data root behind
    say(f"{name}: fetched and verified into {target} ({record['images']:,} images)")
    return FetchResult(target, True, record)


def _present(name: str, root: Path) -> Path | None:
    with contextlib.suppress(HarnessError):
        return DATASETS.get(name).locate(root)
    return None


def _resolve_parts(
    source: DatasetSource,
    local_files: Sequence[Path],
    url: str | None,
    sha256: Sequence[str],
    data_root: Path | None,
) -> list[Part]:
    parts = list(source.parts)
    if local_files and len(local_files) != len(parts):
        raise HarnessError(
            f"dataset '{source.name}' takes {len(parts)} --from file(s), in this order: "
            f"{', '.join(p.filename for p in parts)}; got {len(local_files)}"
        )
    for path in local_files:
        if not Path(path).is_file():
            raise HarnessError(f"--from {path}: no such file")
    if url is not None:
        if len(parts) != 1:
            raise HarnessError(
                f"--url needs a one-file dataset; '{source.name}' has {len(parts)} files: use --from"
            )
        parts = [Part(parts[0].filename, parts[0].into, url, parts[0].md5, parts[0].sha256)]
    if sha256:
        if len(sha256) != len(parts):
            raise HarnessError(
                f"give one --sha256 per file of '{source.name}' ({len(parts)}), in the order "
                f"{', '.join(p.filename for p in parts)}"
            )
        bad = [
            h for h in sha256 if len(h) != 64 or any(c not in "0123456789abcdef" for c in h.lower())
        ]
        if bad:
            raise HarnessError(f"--sha256 expects 64 hex digits, got '{bad[0]}'")
        parts = [
            Part(p.filename, p.into, p.url, p.md5, h.lower())
            for p, h in zip(parts, sha256, strict=True)
        ]
    if not local_files and not all(p.url for p in parts):
        raise HarnessError(
            f"dataset '{source.name}' needs a manual download: {source.manual} Then run: "
            f"{fetch_command(source.name, data_root)}"
        )
    return parts


def _stage(
    source: DatasetSource,
    parts: list[Part],
    local_files: Sequence[Path],
    root: Path,
    staging: Path,
    *,
    timeout: float,
    progress: bool,
    say: Callable[[str], None],
) -> dict:
    """Get, verify and unpack every part into ``staging``; check the tree; write its record."""
    files = []
    for i, part in enumerate(parts):
        if local_files:
            path = Path(local_files[i])
            digests = _verify(part, path)
            _unpack(part, path, staging / part.into)
        else:
            path = download(
                part.url, part.filename, root, timeout=timeout, progress=progress, say=say
            )
            try:  # a whole download that fails a check is removed: resuming it cannot make it right
                digests = _verify(part, path)
                _unpack(part, path, staging / part.into)
            finally:
                path.unlink(missing_ok=True)
        files.append(
            {
                "file": part.filename,
                "source": str(local_files[i]) if local_files else part.url,
                **digests,
                "checksum_verified": bool(part.md5 or part.sha256),
            }
        )
    tree = staging / source.folder
    images = _check_tree(source, tree)
    record = {
        "dataset": source.name,
        "files": files,
        "images": images,
        "verified": all(f["checksum_verified"] for f in files),
    }
    if not record["verified"]:
        say(
            f"{source.name}: no published checksum for "
            f"{', '.join(f['file'] for f in files if not f['checksum_verified'])}; its sha256 is recorded in "
            f"{FETCH_RECORD} (pass --sha256 to check a copy against a checksum you trust)"
        )
    atomic_write_json(tree / FETCH_RECORD, record)
    return record


# --------------------------------------------------------------------- verify


def _digests(path: Path) -> dict[str, str | int]:
    md5, sha = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            md5.update(block)
            sha.update(block)
    return {"md5": md5.hexdigest(), "sha256": sha.hexdigest(), "bytes": path.stat().st_size}


def _verify(part: Part, path: Path) -> dict:
    """The file's digests; an error if a known checksum differs."""
    digests = _digests(path)
    for algorithm in ("md5", "sha256"):
        want = getattr(part, algorithm)
        if want and digests[algorithm] != want:
            raise HarnessError(
                f"{part.filename}: {algorithm} {digests[algorithm]} is not the expected {want} "
                f"({digests['bytes']:,} bytes; a truncated or different file)"
            )
    return digests


# --------------------------------------------------------------------- unpack


def _unpack(part: Part, path: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    try:
        if part.kind == "tar":
            with tarfile.open(path) as archive:
                archive.extractall(
                    into, filter="data"
                )  # refuses absolute paths, '..' and outside links
        elif part.kind == "zip":
            with zipfile.ZipFile(path) as archive:
                for member in archive.infolist():
                    _check_zip_member(member, part.filename)
                archive.extractall(into)
        else:
            shutil.copyfile(path, into / part.filename)
    except tarfile.FilterError as err:
        raise HarnessError(
            f"{part.filename}: refused member escaping the dataset folder: {err}"
        ) from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as err:
        raise HarnessError(
            f"{part.filename}: damaged or truncated archive ({type(err).__name__}: {err})"
        ) from None


def _check_zip_member(member: zipfile.ZipInfo, archive: str) -> None:
    name = PurePosixPath(member.filename.replace("\\", "/"))
    if name.is_absolute() or ".." in name.parts or ":" in member.filename:
        raise HarnessError(
            f"{archive}: refused member escaping the dataset folder: {member.filename!r}"
        )
    if stat.S_ISLNK(member.external_attr >> 16):
        raise HarnessError(
            f"{archive}: refused link member {member.filename!r} (the releases hold none)"
        )


# ---------------------------------------------------------------- known facts


def _check_tree(source: DatasetSource, tree: Path) -> int:
    """Load the staged tree with the loader ``run`` uses; hold it to the expected counts,
    every listed image present. Returns the number of images."""
    info = DATASETS.get(source.name)
    if not (tree / info.marker).is_file():
        raise HarnessError(
            f"the {source.name} release did not unpack to the official layout: no "
            f"{source.folder}/{info.marker}"
        )
    splits = info.loader(tree)
    sets = [s for s in (splits.train, splits.test, splits.gallery) if s is not None]
    counts = source.expected_counts()
    test_classes = len(
        {
            *splits.test.labels.tolist(),
            *([] if splits.gallery is None else splits.gallery.labels.tolist()),
        }
    )
    got = (
        len(splits.train),
        splits.train.num_classes,
        len(splits.test),
        test_classes,
        0 if splits.gallery is None else len(splits.gallery),
    )
    want = (
        counts.train_images,
        counts.train_classes,
        counts.test_images,
        counts.test_classes,
        counts.gallery_images,
    )
    if got != want:
        names = ("train images", "train classes", "test images", "test classes", "gallery images")
        wrong = ", ".join(
            f"{n} {g:,} (expected {w:,})"
            for n, g, w in zip(names, got, want, strict=True)
            if g != w
        )
        raise HarnessError(f"the unpacked {source.name} is not the official release: {wrong}")
    for images in cast(list[FileImageSet], sets):  # a benchmark's loader reads files
        for key in images.keys():
            if not (images.root / key).is_file():
                raise HarnessError(
                    f"the unpacked {source.name} lacks an image its index lists: {key}"
                )
    return sum(len(s) for s in sets)
