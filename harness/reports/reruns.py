"""The verdict of a rerun and the tables ``rerun`` prints: what differs between a run's
record and this machine, the comparison of every metric, and one line per run.

The verdict, per run:

* **IDENTICAL**: every compared metric of the rerun equals the recorded one, float for
  float (expected wherever every recorded input matches: code, protocol, data, device,
  thread count and the packages that change numbers);
* **WITHIN NOISE**: some differ, and each ``test/`` metric that does lies within the noise
  interval of its cell, while the counts of the test set are equal;
* **DIFFERS**: a ``test/`` metric outside its interval, a count of the test set that
  changed, or a metric the rerun did not log.

The noise interval of a metric is ``t(0.975, n - 1) * s * sqrt(2)`` around the recorded
value, with ``s`` the standard deviation over the ``n`` seeds of the run's cell: the 95%
interval of the difference between two runs whose values scatter as the seeds do. A rerun
of the same seed usually lies far closer; the interval bounds what a change of software or
hardware may move a number before it is called a different result. With one seed in the
cell, a stated tolerance (``--tolerance``) takes its place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scipy import stats

__all__ = [
    "IDENTICAL",
    "WITHIN_NOISE",
    "DIFFERS",
    "VERDICTS",
    "InputDifference",
    "MetricComparison",
    "Comparison",
    "compared_keys",
    "noise_half_width",
    "compare_metrics",
    "format_differences",
    "format_summary_line",
    "format_comparisons",
    "format_metric_table",
]

IDENTICAL = "IDENTICAL"
WITHIN_NOISE = "WITHIN NOISE"
DIFFERS = "DIFFERS"
#: The verdicts, from the best to the worst.
VERDICTS = (IDENTICAL, WITHIN_NOISE, DIFFERS)
#: Metric groups that describe the machine, not the result (timings, memory).
MACHINE_GROUPS = ("system/",)


@dataclass(frozen=True)
class InputDifference:
    """One recorded input of a run that this machine does not reproduce as recorded.
    ``numeric``: an input that can change numbers (code, protocol, data, device, threads,
    the numeric packages); the others (e.g. MLflow's version) are listed for completeness."""

    name: str
    recorded: str
    here: str
    numeric: bool = True


@dataclass(frozen=True)
class MetricComparison:
    """A metric's recorded and new values, and the half-width of its noise interval
    (None: not judged, as for training curves, whose test metrics are judged instead)."""

    key: str
    recorded: float
    new: float | None
    half_width: float | None = None

    @property
    def equal(self) -> bool:
        return self.new is not None and (
            self.new == self.recorded or (math.isnan(self.new) and math.isnan(self.recorded))
        )

    @property
    def difference(self) -> float:
        return math.nan if self.new is None else self.new - self.recorded

    @property
    def within(self) -> bool:
        """Equal, or (a judged metric) within its interval."""
        if self.equal:
            return True
        if self.new is None or self.half_width is None:
            return False
        return abs(self.difference) <= self.half_width


@dataclass(frozen=True)
class Comparison:
    """A run, its rerun and the verdict, with every compared metric and how noise was
    judged (``noise``: "3 seeds of the cell" or "tolerance 0.01")."""

    run_id: str
    rerun_id: str
    label: str
    verdict: str
    metrics: tuple[MetricComparison, ...]
    noise: str
    differences: tuple[InputDifference, ...] = field(default=())

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "rerun_id": self.rerun_id,
            "label": self.label,
            "verdict": self.verdict,
            "noise": self.noise,
            "differences": [d.__dict__ for d in self.differences],
            "metrics": [
                {
                    "key": m.key,
                    "recorded": m.recorded,
                    "new": m.new,
                    "difference": None if m.new is None else m.difference,
                    "half_width": m.half_width,
                }
                for m in self.metrics
            ],
        }


def compared_keys(recorded: Iterable[str]) -> list[str]:
    """The recorded metrics a rerun must give again: all but the machine's (``system/``)
    and the UI's display copies (``P at 1``: names with a space, derived from the
    fractions)."""
    return sorted(k for k in recorded if not k.startswith(MACHINE_GROUPS) and " " not in k)


def noise_half_width(seed_values: Sequence[float], tolerance: float) -> float:
    """Half-width of the noise interval of one metric (see the module docstring):
    ``t(0.975, n - 1) * s * sqrt(2)`` over the cell's ``n`` seed values, ``tolerance``
    with fewer than two."""
    values = [v for v in seed_values if not math.isnan(v)]
    if len(values) < 2:
        return tolerance
    mean = sum(values) / len(values)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return float(stats.t.ppf(0.975, len(values) - 1)) * s * math.sqrt(2)


def _is_count(key: str) -> bool:
    return key.rpartition("/")[2].startswith("num_")


def compare_metrics(
    recorded: Mapping[str, float],
    new: Mapping[str, float],
    half_widths: Mapping[str, float],
) -> tuple[str, tuple[MetricComparison, ...]]:
    """The verdict of a rerun whose last metric values are ``new`` against the ``recorded``
    ones, and each compared metric; ``half_widths``: the noise interval of each ``test/``
    metric (counts of the test set, ``num_*``, must be equal)."""
    rows = tuple(
        MetricComparison(
            key,
            recorded[key],
            new.get(key),
            None if _is_count(key) or not key.startswith("test/") else half_widths.get(key),
        )
        for key in compared_keys(recorded)
    )
    if all(row.equal for row in rows):
        return IDENTICAL, rows
    missing = any(row.new is None for row in rows)
    judged = [row for row in rows if row.key.startswith("test/")]
    if missing or not all(row.within for row in judged):
        return DIFFERS, rows
    return WITHIN_NOISE, rows


def format_differences(label: str, differences: Sequence[InputDifference]) -> str:
    """What differs between ``label``'s record and this machine, as a Markdown table (one
    line when nothing does)."""
    if not differences:
        return f"{label}: the record and this machine agree on every input"
    lines = [
        f"{label}: what differs between the record and this machine",
        "| input | recorded | here | changes numbers |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {d.name} | {d.recorded} | {d.here} | {'yes' if d.numeric else 'no'} |"
        for d in differences
    ]
    return "\n".join(lines)


def _largest(comparison: Comparison) -> MetricComparison | None:
    differing = [m for m in comparison.metrics if not m.equal]
    return max(
        differing, key=lambda m: abs(m.difference) if m.new is not None else math.inf, default=None
    )


def format_summary_line(comparison: Comparison) -> str:
    """One line per run: its verdict, label and runs, and what it rests on."""
    equal = sum(m.equal for m in comparison.metrics)
    total = len(comparison.metrics)
    detail = f"{equal}/{total} metrics equal float for float"
    if (largest := _largest(comparison)) is not None:
        new = "missing" if largest.new is None else f"{largest.difference:+.6g}"
        detail += f"; largest difference {largest.key} {new} ({comparison.noise})"
    return (
        f"{comparison.verdict}: {comparison.label} (run {comparison.run_id}, rerun "
        f"{comparison.rerun_id}): {detail}"
    )


def format_comparisons(comparisons: Sequence[Comparison]) -> str:
    """The closing table: one row per run, its verdict and its largest difference."""
    lines = [
        "| run | rerun | verdict | metrics equal | largest difference | noise |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        largest = _largest(c)
        text = (
            "none"
            if largest is None
            else f"{largest.key} "
            + ("missing" if largest.new is None else f"{largest.difference:+.6g}")
        )
        equal = sum(m.equal for m in c.metrics)
        lines.append(
            f"| {c.label} ({c.run_id}) | {c.rerun_id} | {c.verdict} | "
            f"{equal}/{len(c.metrics)} | {text} | {c.noise} |"
        )
    counts = {v: sum(c.verdict == v for c in comparisons) for v in VERDICTS}
    lines.append("")
    lines.append(", ".join(f"{v} {n}" for v, n in counts.items()))
    return "\n".join(lines)


def format_metric_table(comparison: Comparison) -> str:
    """Every compared metric of one run (the rerun's ``rerun/comparison.md`` artifact, and
    what ``rerun`` prints for a run that DIFFERS): recorded, new, difference, interval."""
    lines = [
        f"{comparison.verdict}: {comparison.label}, run {comparison.run_id} re-run as "
        f"{comparison.rerun_id} (noise: {comparison.noise})",
        "",
        "| metric | recorded | new | difference | interval | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in comparison.metrics:
        new = "missing" if m.new is None else repr(m.new)
        diff = "" if m.new is None or m.equal else f"{m.difference:+.6g}"
        interval = "" if m.half_width is None else f"±{m.half_width:.6g}"
        mark = (
            "="
            if m.equal
            else (
                "within"
                if m.within
                else ("" if m.half_width is None and m.new is not None else "OUTSIDE")
            )
        )
        lines.append(f"| {m.key} | {m.recorded!r} | {new} | {diff} | {interval} | {mark} |")
    return "\n".join(lines)
