"""nox sessions: tests, lint, docs, lock, reproduce-agrouping, -diml, -diablo, -avsl, -sam,
fair-table, fair-tuned, tables, explain-benchmark.

``nox -s reproduce-<paper> -- [--data-root DIR] [--device cuda] [--workers N]
[--storage URL] [--smoke]`` runs the paper's grid (restartable: finished cells are
skipped) and writes its tables under ``results/tables``:

* ``reproduce-agrouping``: A-grouping Table 3 (+ the SOP row of Table 4);
* ``reproduce-diml``: DIML Table 1, a baseline per loss and DIML applied at test time
  to each trained baseline;
* ``reproduce-diablo``: DIABLO Table 1, a baseline and + DIABLO (N = 8) per loss, and
  N = 16 for the binomial deviance, beside the published rows of the same setting;
* ``reproduce-avsl``: AVSL Table 1, Margin and ProxyAnchor with and without AVSL on
  CUB, Cars and SOP;
* ``reproduce-sam``: SAM Table 1, baseline and SAM for the Siamese (contrastive),
  triplet and quadruplet architectures on CUB;
* ``fair-table``: the harness's own table (``protocols/grids/fair-roth2020.toml``): every
  registered method under ``roth2020``, three losses, four datasets, five seeds, each row
  with its interval and paired tests against ``plain``;
* ``fair-tuned``: the same table with every method tuned alike first
  (``protocols/grids/fair-tuned-roth2020.toml``: 50 trials (Optuna TPE) on 4 class-disjoint folds
  per method, loss and dataset, as Musgrave et al. 2020), its tables written by the sweep:
  the separated and concatenated reports, the chosen settings and the best-so-far figure.

Every table cell carries the mean over seeds, the half-width of its 95% t-interval and
n; each row is tested against the grid's ``baseline`` row of its block (default ``plain``).

``nox -s explain-benchmark -- [--seeds 0,1,2]`` trains ``plain`` and the six methods
with maps of their own on the ``explain`` protocol, explains every run with its sanity
checks and writes ``results/tables/explain-benchmark.md`` / ``.tex`` with the strip of one
pair explained by every method (docs/performance.md, "The explanation benchmark");
``-- --seeds 0 --shuffled-labels`` the same on models trained on permuted labels (the data
randomisation control, ``results/tables/explain-benchmark-shuffled-labels.md``).

``nox -s tables`` regenerates the tables of every grid whose experiment is in the
tracking store, without training.

``nox -s docs`` writes the JSON Schemas of protocol and grid files into ``docs/`` and
builds the documentation site (``docs/``, ``mkdocs.yml``) into ``site/``; it fails on any
warning.

``nox -s lock`` writes ``requirements/lock.txt``, the exact versions of the default install
and the ``test`` extra (``pip install -c requirements/lock.txt -e '.[test]'``), resolved
from ``pyproject.toml`` by uv's ``pip compile``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]

ROOT = Path(__file__).parent
GRIDS = ROOT / "protocols" / "grids"
LOCK = "requirements/lock.txt"


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The test suite in the current environment (fast tests; pass -m slow for the rest)."""
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", "harness", "tests", "benchmarks", "noxfile.py")


@nox.session(python=False)
def docs(session: nox.Session) -> None:
    """The JSON Schemas of protocol and grid files into ``docs/`` (from the registered
    methods), the plugin roles' table into ``docs/writing-a-plugin.md``, the built-in
    plugins' catalog that ``harness methods`` reads (``harness/config/method_catalog.py``), then the
    documentation site into ``site/`` (``-- --site-dir DIR`` elsewhere); any warning fails
    it."""
    for kind in ("protocol", "grid"):
        with open(ROOT / "docs" / f"{kind}.schema.json", "w", encoding="utf-8") as out:
            session.run("python", "-m", "harness", "schema", kind, stdout=out)
    page = ROOT / "docs" / "writing-a-plugin.md"
    catalog = ROOT / "harness" / "config" / "method_catalog.py"
    write = (
        f"from harness.methods.role_docs import write_role_table; write_role_table({str(page)!r}); "
        "from harness.methods.listing import write_method_catalog; "
        f"write_method_catalog({str(catalog)!r})"
    )
    session.run("python", "-c", write)
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


def uv_command() -> list[str] | None:
    """How to run uv: the ``uv`` program on PATH, else the ``uv`` module of the Python that
    runs nox (``pip install uv`` gives both); None when neither is installed."""
    if shutil.which("uv"):
        return ["uv"]
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv"]
    return None


@nox.session(python=False)
def lock(session: nox.Session) -> None:
    """``requirements/lock.txt``: the exact versions of the default install and the ``test``
    extra, resolved from ``pyproject.toml`` by uv's ``pip compile`` for the Python that runs
    nox. Versions already in the lock stay while ``pyproject.toml`` allows them (uv prefers
    an output file's pins); ``-- --upgrade`` moves every package to its newest version,
    ``-- --upgrade-package NAME`` one."""
    uv = uv_command()
    if uv is None:
        session.error("nox -s lock resolves with uv, which is not installed: pip install uv")
    session.run(
        *uv,
        "pip",
        "compile",
        "--quiet",
        "pyproject.toml",
        "--extra",
        "test",
        "--annotation-style",
        "line",
        "--custom-compile-command",
        "nox -s lock",
        "--output-file",
        LOCK,
        *session.posargs,
    )


def _sweep_args(posargs: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="nox -s reproduce-<paper> --")
    parser.add_argument("--data-root")
    parser.add_argument("--device")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--storage")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(posargs)
    forwarded = []
    for flag in ("data_root", "device", "workers", "storage"):
        value = getattr(args, flag)
        if value is not None:
            forwarded += [f"--{flag.replace('_', '-')}", str(value)]
    if args.smoke:
        forwarded.append("--smoke")
    return args, forwarded


def _grid_tables(session: nox.Session, grid: str, *, smoke: bool) -> None:
    """``results/tables/<grid>.tex`` and ``.md`` from the tracking store, with the paper's
    published values. A smoke run's cells (other backbone and dataset) get their own rows
    and columns beside the paper's, and the caption says they are not comparable."""
    data = tomllib.loads((GRIDS / f"{grid}.toml").read_text())
    experiment = (
        (data.get("smoke", {}).get("experiment") or f"{data['name']}-smoke")
        if smoke
        else data.get("experiment", data["name"])
    )
    published = data.get("published", {})
    caption = data.get("description", grid)
    if smoke:
        caption += (
            f" -- smoke run (experiment {experiment}, on {', '.join(data['smoke'].get('datasets', []))}): "
            "a pipeline check"
            + (", not comparable with the published columns" if published else "")
        )
    tune = {**data.get("tune", {}), **(data.get("smoke", {}).get("tune", {}) if smoke else {})}
    # A tuned grid with k > 1 folds: the concatenated fold models' table too.
    reports = ["separated", "concatenated"] if tune.get("folds", 1) > 1 else ["separated"]
    for fmt, ext, report in [
        (f, e, r) for r in reports for f, e in (("latex", "tex"), ("markdown", "md"))
    ]:
        suffix = "" if report == "separated" else f"-{report}"
        args = [
            "--experiment",
            experiment,
            "--format",
            fmt,
            "--out",
            f"results/tables/{data['name']}{suffix}.{ext}",
            "--caption",
            caption,
        ]
        if published:
            args += [
                "--published",
                published["file"],
                "--table",
                ",".join(str(t) for t in published["tables"]),
            ]
            for method, rows in published.get("rows", {}).items():  # rows told apart by `setting`
                args += [arg for row in rows for arg in ("--published-row", f"{method}={row}")]
            for reported, variant in published.get(
                "metrics", {}
            ).items():  # a paper's own definition
                args += ["--published-metric", f"{reported}={variant}"]
        if data.get("metrics"):
            args += ["--metrics", ",".join(data["metrics"])]
        if data.get("baseline"):
            args += ["--baseline", data["baseline"]]
        if tune:
            args += ["--report", report]
        session.run("python", "-m", "harness", "table", *args)


def _reproduce(session: nox.Session, grid: str) -> None:
    args, forwarded = _sweep_args(list(session.posargs))
    session.run("python", "-m", "harness", "sweep", "--grid", grid, *forwarded)
    _grid_tables(session, grid, smoke=args.smoke)


@nox.session(name="reproduce-agrouping", python=False)
def reproduce_agrouping(session: nox.Session) -> None:
    """A-grouping Table 3 (+ the SOP row of Table 4): sweep the grid, then the tables."""
    _reproduce(session, "agrouping-table3")


@nox.session(name="reproduce-diml", python=False)
def reproduce_diml(session: nox.Session) -> None:
    """DIML Table 1: train a baseline per loss, apply DIML at test time to each, then the tables."""
    _reproduce(session, "diml-table1")


@nox.session(name="reproduce-diablo", python=False)
def reproduce_diablo(session: nox.Session) -> None:
    """DIABLO Table 1: baseline and + DIABLO per loss (N = 8, and N = 16 for binomial), then the tables."""
    _reproduce(session, "diablo-table1")


@nox.session(name="reproduce-avsl", python=False)
def reproduce_avsl(session: nox.Session) -> None:
    """AVSL Table 1: Margin and ProxyAnchor baselines and + AVSL on CUB, Cars, SOP, then the tables."""
    _reproduce(session, "avsl-table1")


@nox.session(name="reproduce-sam", python=False)
def reproduce_sam(session: nox.Session) -> None:
    """SAM Table 1: baseline and SAM for the Siamese, triplet and quadruplet architectures, then the tables."""
    _reproduce(session, "sam-table1")


@nox.session(name="fair-table", python=False)
def fair_table(session: nox.Session) -> None:
    """Every registered method under roth2020 with intervals and paired tests against plain:
    sweep ``fair-roth2020``, then ``results/tables/fair-roth2020.tex`` and ``.md``."""
    _reproduce(session, "fair-roth2020")


@nox.session(name="fair-tuned", python=False)
def fair_tuned(session: nox.Session) -> None:
    """Every registered method tuned with the same budget, then compared: sweep
    ``fair-tuned-roth2020`` (search, then final runs), which writes
    ``results/tables/fair-tuned-roth2020.md`` / ``.tex``, ``-concatenated`` ones, the
    appendix ``.settings.md`` / ``.tex`` and the figure ``.search.png``."""
    _, forwarded = _sweep_args(list(session.posargs))
    session.run("python", "-m", "harness", "sweep", "--grid", "fair-tuned-roth2020", *forwarded)


@nox.session(python=False)
def tables(session: nox.Session) -> None:
    """Regenerate the tables of every grid from the tracking store (no training).
    ``-- --smoke`` for the smoke versions."""
    smoke = "--smoke" in session.posargs
    for path in sorted(GRIDS.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        experiment = (
            (data.get("smoke", {}).get("experiment") or f"{data['name']}-smoke")
            if smoke
            else data.get("experiment", data["name"])
        )
        code = (
            "from harness.store.queries import experiment_exists; "
            f"print('found' if experiment_exists({experiment!r}) else 'missing')"
        )
        if "found" not in (session.run("python", "-c", code, silent=True) or ""):
            session.log(
                f"{path.stem}: no experiment '{experiment}' in the tracking store yet; skipped"
            )
            continue
        _grid_tables(session, path.stem, smoke=smoke)


#: The explanation benchmark: the six methods with maps of their own, and ``plain``, whose
#: Grad-CAM baseline shows that the protocol's data and training let a map find the part.
EXPLAIN_METHODS = ("plain", "agrouping", "ggrouping", "avsl", "diablo", "diml", "sam")
EXPLAIN_EXPERIMENT = "explain-benchmark"
#: The data randomisation control's experiment (``-- --shuffled-labels``).
EXPLAIN_SHUFFLED = "explain-benchmark-shuffled-labels"
#: The creatures drawn large enough for their parts to span cells of the 8 x 8 map.
EXPLAIN_DATASET = "synthetic-closeup"


@nox.session(name="explain-benchmark", python=False)
def explain_benchmark(session: nox.Session) -> None:
    """Train :data:`EXPLAIN_METHODS` on the ``explain`` protocol and :data:`EXPLAIN_DATASET`
    (``-- --seeds``, default 0,1,2; sessions of different seeds can run side by side on one
    store), explain each run with ``--sanity``, then the table over every seed in the store
    and the strip. ``-- --shuffled-labels``: instead, the data randomisation control, the
    same methods trained on permuted labels (``run --shuffled-labels-control``) in
    :data:`EXPLAIN_SHUFFLED`, explained and tabled alike."""
    parser = argparse.ArgumentParser(prog="nox -s explain-benchmark --")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--pairs", default="100")
    parser.add_argument("--curve-pairs", default="16")
    parser.add_argument("--shuffled-labels", action="store_true")
    args = parser.parse_args(list(session.posargs))
    experiment = EXPLAIN_SHUFFLED if args.shuffled_labels else EXPLAIN_EXPERIMENT
    control = ("--shuffled-labels-control",) if args.shuffled_labels else ()
    out = Path("results") / experiment
    runs = out / f"runs-seeds-{args.seeds.replace(',', '-')}.json"  # sessions of other seeds beside
    harness = ("python", "-m", "harness")
    session.run(
        *harness, "run", "--methods", ",".join(EXPLAIN_METHODS), "--protocol", "explain",
        "--dataset", EXPLAIN_DATASET, "--seeds", args.seeds, "--experiment", experiment,
        *control, "--json", str(runs), "--force",
    )  # fmt: skip
    for record in json.loads(runs.read_text()):
        run_id = record["mlflow_run_id"]
        session.run(
            *harness, "explain", "--run", run_id, "--pairs", args.pairs,
            "--curve-pairs", args.curve_pairs, "--sanity", "--out", str(out / run_id),
            "--json", str(out / f"{run_id}.json"), "--force",
        )  # fmt: skip
    session.run(
        *harness, "explain-table", "--experiment", experiment, "--strip",
        "--out", f"results/tables/{experiment}", "--force",
    )  # fmt: skip
