"""``python -m harness deviations``: where a grid's or a protocol's runs depart from the
papers and the authors' released code (the protocols' ``[deviations]`` tables), and the
settings a grid changes on top of its protocol."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.base.errors import HarnessError, unknown_name
from harness.config.catalog import MAX_CELLS, list_protocols
from harness.config.deviations import PaperDeviation, find_deviation
from harness.config.grids import load_grid
from harness.config.ledger import check_ledger, family_counts, ledgers_for_grid, load_ledger
from harness.config.protocol import apply_overrides
from harness.config.protocol_files import load_protocol
from harness.engine.audit.deviation_effects import (
    effect_lines,
    effect_sentences,
    measurable_deviations,
    measure_deviations,
)
from harness.engine.run.runtime import resolve_device
from harness.reports.tables.effects import write_effect_notes


def _describe(name: str, deviation: PaperDeviation) -> str:
    scope = (
        ", ".join(
            filter(
                None,
                [
                    f"methods {', '.join(deviation.methods)}" if deviation.methods else "",
                    f"datasets {', '.join(deviation.datasets)}" if deviation.datasets else "",
                    f"backbones {', '.join(deviation.backbones)}" if deviation.backbones else "",
                    f"losses {', '.join(deviation.losses)}" if deviation.losses else "",
                ],
            )
        )
        or "every run"
    )
    lines = [
        f"{name}  ({scope})",
        f"  paper/code: {deviation.paper}"
        + (f"  [{deviation.reference}]" if deviation.reference else ""),
        f"  harness:    {deviation.harness}",
        f"  why:        {deviation.why}",
    ]
    return "\n".join(lines)


def _grid_sections(
    args: argparse.Namespace,
) -> list[tuple[str, dict[str, PaperDeviation], list[str]]]:
    """The deviations of every cell of the grid (the paper protocol's declared ones, and a
    smoke version's settings), and the settings the grid itself changes."""
    grid = load_grid(args.grid, smoke=args.smoke, max_cells=_max_cells(args))
    found = {name: d for cell in grid.cells for name, d in cell.paper_deviations.items()}
    _, overrides = apply_overrides(load_protocol(grid.protocol), grid.overrides)
    settings = [f"{d}  (set by grid {grid.name})" for d in overrides]
    return [(f"grid {grid.name} (protocol {load_protocol(grid.protocol).name})", found, settings)]


def _max_cells(args: argparse.Namespace) -> int | None:
    """The most cells the grid may expand to: none with ``--yes``."""
    return None if args.yes else MAX_CELLS


def cmd_deviations(args: argparse.Namespace) -> int:
    if (args.smoke or args.ledger or args.yes or args.measure) and not args.grid:
        raise HarnessError("--smoke, --ledger, --yes and --measure go with --grid")
    if args.measure:
        return _measure(args)
    # Every file read (the grid, its ledgers) before the first line is printed.
    ledger_lines = _ledger_lines(args) if args.grid and not args.smoke else []
    if args.grid:
        sections = _grid_sections(args)
    else:
        names = [args.protocol] if args.protocol else list_protocols()
        sections = [
            (f"protocol {load_protocol(n).name}", load_protocol(n).deviations, []) for n in names
        ]
    if args.name:
        where = sections[0][0] if len(sections) == 1 else "the shipped protocols"
        merged = {k: v for _, found, _ in sections for k, v in found.items()}
        print(_describe(args.name, find_deviation(merged, args.name, where)))
        return 0
    for title, found, settings in sections:
        print(
            f"{title}: {len(found)} deviation{'s' * (len(found) != 1)} from the paper or its code"
            + (f", {len(settings)} grid setting{'s' * (len(settings) != 1)}" if settings else "")
        )
        for name, deviation in sorted(found.items()):
            print(_describe(name, deviation))
        for line in settings:
            print(f"setting: {line}")
    for line in ledger_lines:
        print(line)
    return 0


def _ledger_lines(args: argparse.Namespace) -> list[str]:
    """Per ledger covering the grid (or ``--ledger``), one line per cell family."""
    grid = load_grid(args.grid, max_cells=_max_cells(args))
    ledgers = [load_ledger(args.ledger)] if args.ledger else ledgers_for_grid(grid.name)
    lines = []
    for ledger in ledgers:
        counts = family_counts(check_ledger(ledger, [str(args.grid)], max_cells=_max_cells(args)))
        lines.append(
            f"recipe ledger {ledger.paper} ({ledger.path.name}, {len(ledger.entries)} entries), "
            f"per cell family:"
        )
        for family, found in counts.items():
            lines.append(
                f"  {family}: {found['matched']} matched, {found['deviating']} deviating"
                + (f", {found['undeclared']} UNDECLARED" if found["undeclared"] else "")
            )
    return lines


def _measure(args: argparse.Namespace) -> int:
    """``--measure``: each deviation's effect at the smoke scale, as a Markdown table."""

    seeds = _seeds(args.seeds)
    resolve_device(args.device)
    if args.data_root is not None and not Path(args.data_root).is_dir():
        raise HarnessError(f"--data-root {args.data_root} does not exist or is not a folder")
    ledgers = [load_ledger(args.ledger)] if args.ledger else None
    if args.name:
        measurable = measurable_deviations(args.grid, ledgers)
        if args.name not in measurable:
            smoke_name = load_grid(args.grid, smoke=True, max_cells=None).name
            raise unknown_name(f"deviation of grid {smoke_name}", args.name, measurable)
    paper = load_grid(args.grid, max_cells=None)
    smoke = load_grid(args.grid, smoke=True, max_cells=None)
    started = time.monotonic()
    effects = measure_deviations(
        args.grid,
        seeds=seeds,
        device=args.device,
        data_root=args.data_root,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        ledgers=ledgers,
        only=args.name,
    )
    for line in effect_lines(args.grid, effects, seeds):
        print(line)
    path = write_effect_notes(
        paper.name,
        (paper.experiment, smoke.experiment),
        seeds,
        effect_sentences(effects),
        merge=bool(args.name),
    )
    print(f"measured in {time.monotonic() - started:.0f} s; the tables' notes: {path}")
    return 0


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds``: at least two distinct seeds >= 0."""
    try:
        seeds = tuple(int(s) for s in str(text).split(","))
    except ValueError:
        raise HarnessError(
            f"--seeds '{text}': expected comma-separated integers, e.g. 0,1,2"
        ) from None
    if len(seeds) < 2 or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise HarnessError(
            f"--seeds '{text}': expected at least two distinct seeds >= 0 (an interval)"
        )
    return seeds
