"""``python -m harness datasets fetch``: archives in each benchmark's official layout served
by a local HTTP server (127.0.0.1, started and stopped by each test), and every way a
download or an archive can go wrong: one ``error:`` line, exit 2, nothing new left behind."""

from __future__ import annotations

import hashlib
import io
import re
import socket
import tarfile
import threading
import zipfile
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.components.data import DATASETS
from harness.components.data.base import OfficialCounts
from harness.components.data.fetch import FETCH_RECORD, SOURCES, Part
from tests.fixtures import make_cars, make_cub, make_inshop, make_sop

#: Seconds a test waits on a silent server: short, so a stall cannot hang the suite.
TIMEOUT = "0.5"


# ------------------------------------------------------------------ the server


class _Handler(BaseHTTPRequestHandler):
    """Serves ``server.routes[path]``: ``bytes`` (Range honoured), an ``int`` status,
    ``("half-once", bytes)`` (the first request gets half the body, then the connection
    closes) or ``("stall", bytes)`` (headers, then silence)."""

    def do_GET(self):  # the http.server hook's name
        self.server.log.append((self.path, self.headers.get("Range")))
        route = self.server.routes.get(self.path, 404)
        if isinstance(route, int):
            self.send_error(route)
            return
        kind, data = route if isinstance(route, tuple) else ("file", route)
        if kind == "half-once" and self.headers.get("Range") is None:
            self._headers(200, len(data))
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if kind == "stall":
            self._headers(200, len(data))
            self.wfile.flush()
            self.server.stopping.wait(10)
            return
        start = (
            int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
            if self.headers.get("Range")
            else 0
        )
        self._headers(206 if start else 200, len(data) - start, start, len(data))
        self.wfile.write(data[start:])

    def _headers(self, status, length, start=0, total=0):
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{total - 1}/{total}")
        self.end_headers()

    def log_message(self, *args):  # the test reads server.log instead
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.routes, httpd.log, httpd.stopping = {}, [], threading.Event()
    httpd.url = lambda path: f"http://127.0.0.1:{httpd.server_port}{path}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.stopping.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def _refused_url() -> str:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/CUB_200_2011.tgz"


# -------------------------------------------------- archives in official layouts


def _tar(members: dict[str, Path | bytes], *, links: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, content in members.items():
            if isinstance(content, Path):
                archive.add(content, arcname=name)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return out.getvalue()


def _zip(folder: Path, under: str) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for path in sorted(folder.rglob("*")):
            archive.write(path, f"{under}/{path.relative_to(folder).as_posix()}")
    return out.getvalue()


def _counts(name: str, tree: Path) -> OfficialCounts:
    """The fixture's own per-split counts, standing in for the official ones."""
    splits = DATASETS.get(name).loader(tree)
    test = [
        *splits.test.labels.tolist(),
        *([] if splits.gallery is None else splits.gallery.labels.tolist()),
    ]
    return OfficialCounts(
        len(splits.train),
        splits.train.num_classes,
        len(splits.test),
        len(set(test)),
        0 if splits.gallery is None else len(splits.gallery),
    )


def _release(name: str, src: Path) -> tuple[dict[str, bytes], OfficialCounts]:
    """Each file of ``name``'s release, built from the test fixture tree in its official layout."""
    if name == "cub200":
        tree = make_cub(src)  # the release also holds a top-level attributes.txt
        files = {
            "CUB_200_2011.tgz": _tar(
                {"CUB_200_2011": tree, "attributes.txt": b"1 has_bill_shape::dagger\n"}
            )
        }
    elif name == "sop":
        tree = make_sop(src)
        files = {"Stanford_Online_Products.zip": _zip(tree, "Stanford_Online_Products")}
    elif name == "cars196":
        tree = make_cars(src, per_class=1)
        files = {
            "car_ims.tgz": _tar({"car_ims": tree / "car_ims"}),
            "cars_annos.mat": (tree / "cars_annos.mat").read_bytes(),
        }
    else:
        tree = make_inshop(src)
        files = {
            "img.zip": _zip(tree / "Img" / "img", "img"),
            "list_eval_partition.txt": (tree / "list_eval_partition.txt").read_bytes(),
        }
    return files, _counts(name, tree)


def _serve(
    monkeypatch,
    server,
    name: str,
    files: dict[str, bytes],
    counts: OfficialCounts,
    *,
    md5: dict[str, str] | None = None,
) -> None:
    """Point ``name``'s source at the test server, with these files' md5 (or ``md5``'s)."""
    md5 = (
        md5 if md5 is not None else {f: hashlib.md5(data).hexdigest() for f, data in files.items()}
    )
    parts = []
    for part in SOURCES[name].parts:
        server.routes[f"/{part.filename}"] = files[part.filename]
        parts.append(
            Part(
                part.filename,
                part.into,
                server.url(f"/{part.filename}"),
                md5.get(part.filename, ""),
            )
        )
    monkeypatch.setitem(SOURCES, name, replace(SOURCES[name], parts=tuple(parts), counts=counts))


@pytest.fixture(scope="module")
def cub_release(tmp_path_factory):
    return _release("cub200", tmp_path_factory.mktemp("cub-src"))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _fetch(capsys, *args: str) -> tuple[int, str]:
    rc = main(["datasets", "fetch", *args, "--timeout", TIMEOUT])
    return rc, capsys.readouterr().err


def _one_error(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    return lines[0]


# ------------------------------------------------------------------ fetching


@pytest.mark.parametrize("name", ["cub200", "sop", "cars196", "inshop"])
def test_a_release_downloads_verifies_and_loads_then_a_second_fetch_does_nothing(
    tmp_path, monkeypatch, server, capsys, name
):
    files, counts = _release(name, tmp_path / "src")
    _serve(monkeypatch, server, name, files, counts)
    root = tmp_path / "data"
    rc, err = _fetch(capsys, name, "--data-root", str(root))
    assert rc == 0, err
    assert "fetched and verified" in err and "B/s" not in err  # no progress bar off a terminal
    folder = root / DATASETS.get(name).folder
    assert _tree(root) == {
        folder.name,
        *(f"{folder.name}/{p}" for p in _tree(folder)),
    }  # nothing beside it
    splits = DATASETS.get(name).load(root)  # the loader `run` uses
    assert (len(splits.train), len(splits.test)) == (counts.train_images, counts.test_images)
    splits.train.read(0)
    record = (folder / FETCH_RECORD).read_text()
    assert all(hashlib.md5(data).hexdigest() in record for data in files.values())

    requests = len(server.log)
    rc, err = _fetch(capsys, name, "--data-root", str(root))
    assert rc == 0 and "fetched and verified" in err and "nothing to do" in err
    assert len(server.log) == requests  # not one request


def test_a_manual_release_unpacks_from_local_files_with_a_pinned_sha256(
    tmp_path, monkeypatch, capsys
):
    files, counts = _release("inshop", tmp_path / "src")
    monkeypatch.setitem(SOURCES, "inshop", replace(SOURCES["inshop"], counts=counts))
    local = []
    for filename, data in files.items():
        (tmp_path / "downloads").mkdir(exist_ok=True)
        local.append(tmp_path / "downloads" / filename)
        local[-1].write_bytes(data)
    sums = [hashlib.sha256(data).hexdigest() for data in files.values()]
    root = tmp_path / "data"
    args = ["inshop", "--data-root", str(root), "--from", str(local[0]), "--from", str(local[1])]

    line = _one_error(*_fetch(capsys, "inshop", "--data-root", str(root)))
    assert (
        "needs a manual download" in line
        and "--from img.zip --from list_eval_partition.txt" in line
    )
    wrong = [
        "--sha256",
        sums[1],
        "--sha256",
        sums[0],
    ]  # swapped: the first file is held to the second's
    assert "sha256" in _one_error(*_fetch(capsys, *args, *wrong)) and not root.exists()
    assert all(p.is_file() for p in local)  # the user's own files are never removed

    rc, err = _fetch(capsys, *args, "--sha256", sums[0], "--sha256", sums[1])
    assert rc == 0, err
    assert len(DATASETS.get("inshop").load(root).gallery) == counts.gallery_images
    assert main(["datasets", "--data-root", str(root)]) == 0
    listing = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("inshop")
    )
    assert "found, verified" in listing and f"{counts.images:,}" in listing


def test_datasets_lists_a_hand_placed_tree_as_found_but_not_verified(tmp_path, capsys):
    make_sop(tmp_path)
    assert main(["datasets", "--data-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    sop = next(line for line in out if line.startswith("sop"))
    splits = DATASETS.get("sop").loader(tmp_path / "Stanford_Online_Products")
    assert "found, not verified" in sop and f" {len(splits.train) + len(splits.test)} " in sop
    cub = next(line for line in out if line.startswith("cub200"))
    assert "missing" in cub and f"datasets fetch cub200 --data-root {tmp_path}" in cub


def test_an_interrupted_download_resumes_with_a_range_request(
    tmp_path, monkeypatch, server, capsys, cub_release
):
    files, counts = cub_release
    _serve(monkeypatch, server, "cub200", files, counts)
    data = files["CUB_200_2011.tgz"]
    server.routes["/CUB_200_2011.tgz"] = ("half-once", data)
    root = tmp_path / "data"
    root.mkdir()
    line = _one_error(*_fetch(capsys, "cub200", "--data-root", str(root)))
    assert f"at {len(data) // 2:,} of {len(data):,} bytes" in line and "again to resume" in line
    (part,) = root.iterdir()  # the partial download, and nothing else
    assert part.name.endswith(".part") and part.read_bytes() == data[: len(data) // 2]

    rc, err = _fetch(capsys, "cub200", "--data-root", str(root))
    assert rc == 0 and "resuming at" in err, err
    assert server.log[-1] == ("/CUB_200_2011.tgz", f"bytes={len(data) // 2}-")
    assert _tree(root) == {
        "CUB_200_2011",
        *(f"CUB_200_2011/{p}" for p in _tree(root / "CUB_200_2011")),
    }
    assert hashlib.md5(data).hexdigest() in (root / "CUB_200_2011" / FETCH_RECORD).read_text()


# ------------------------------------------------------- every failure: one line


def _evil(kind: str, tree_src: Path) -> bytes:
    base = {"CUB_200_2011": tree_src}
    if kind == "dotdot":
        return _tar({**base, "CUB_200_2011/../../evil": b"outside"})
    return _tar(base, links={"CUB_200_2011/images/escape": "../../../../outside"})


@pytest.mark.parametrize(
    "case, expected",
    [
        ("wrong checksum", "md5 .* is not the expected 0{32}"),
        ("truncated archive", "damaged or truncated archive"),
        ("404", "HTTP 404"),
        ("500", "HTTP 500"),
        ("refused", "cannot reach .*refused"),
        ("stall", "no data arrived in time"),
        ("dotdot member", "refused member escaping the dataset folder"),
        ("symlink member", "refused member escaping the dataset folder"),
        ("dotdot zip member", "refused member escaping the dataset folder"),
        ("counts differ", "not the official release: train images"),
    ],
)
def test_each_failure_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch, server, capsys, cub_release, case, expected
):
    files, counts = cub_release
    data = files["CUB_200_2011.tgz"]
    _serve(monkeypatch, server, "cub200", files, counts)
    route = "/CUB_200_2011.tgz"
    name, extra = "cub200", []
    if case == "wrong checksum":
        _serve(monkeypatch, server, "cub200", files, counts, md5={"CUB_200_2011.tgz": "0" * 32})
    elif (
        case == "truncated archive"
    ):  # served whole (a complete HTTP reply) but cut: no checksum to catch it
        _serve(
            monkeypatch,
            server,
            "cub200",
            {"CUB_200_2011.tgz": data[: len(data) // 2]},
            counts,
            md5={},
        )
    elif case in ("404", "500"):
        server.routes[route] = int(case)
    elif case == "refused":
        extra = ["--url", _refused_url()]
    elif case == "stall":
        server.routes[route] = ("stall", data)
    elif case in ("dotdot member", "symlink member"):
        src = tmp_path / "src"
        evil = _evil(case.split()[0], make_cub(src, classes=2, per_class=1))
        _serve(monkeypatch, server, "cub200", {"CUB_200_2011.tgz": evil}, counts)
    elif case == "dotdot zip member":
        name = "sop"
        src = make_sop(tmp_path / "src")
        evil = io.BytesIO(_zip(src, "Stanford_Online_Products"))
        with zipfile.ZipFile(evil, "a") as archive:
            archive.writestr("Stanford_Online_Products/../../evil", b"outside")
        sop = {"Stanford_Online_Products.zip": evil.getvalue()}
        _serve(monkeypatch, server, "sop", sop, _counts("sop", src))
    elif case == "counts differ":
        _serve(
            monkeypatch,
            server,
            "cub200",
            files,
            replace(counts, train_images=counts.train_images + 1),
        )
    root = tmp_path / "data"
    root.mkdir()
    before = _tree(tmp_path)
    line = _one_error(*_fetch(capsys, name, "--data-root", str(root), *extra))
    assert re.search(expected, line), line
    assert (
        _tree(tmp_path) == before
    )  # no partial folder, no temporary file, nothing outside the root


def test_run_names_the_fetch_command_or_downloads_with_download(
    workdir, tiny_protocol, monkeypatch, server, capsys, cub_release
):
    files, counts = cub_release
    _serve(monkeypatch, server, "cub200", files, counts)
    root = workdir / "data"
    root.mkdir()
    run = [
        "run",
        "--methods",
        "plain",
        "--dataset",
        "cub200",
        "--data-root",
        str(root),
        "--protocol",
        str(tiny_protocol),
        "--epochs",
        "0",
    ]
    assert main(run) == 2
    assert (
        f"fetch it with: python -m harness datasets fetch cub200 --data-root {root}"
        in capsys.readouterr().err
    )
    assert not any(root.iterdir()) and server.log == []
    assert main([*run, "--download"]) == 0
    out, err = capsys.readouterr()
    assert "cub200: fetched and verified" in err and "MAP@R" in out and "plain" in out
    assert (root / "CUB_200_2011" / FETCH_RECORD).is_file()
