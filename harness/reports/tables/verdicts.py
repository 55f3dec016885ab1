"""Which paired comparisons a table may mark: every p-value of the table adjusted as one
family, and the comparisons the evidence cannot carry whatever their p left unmarked.

A table compares many rows with their baseline over several datasets, metrics and two
tests (the paired t-test over seeds and the bootstrap over the test set). Read one at a
time at p < 0.05, a table of a few hundred comparisons between identical methods marks
some cell almost always. The rules, applied in :func:`judge`:

1. **Seeds.** A comparison over fewer than :data:`MIN_SEEDS_FOR_MARK` paired seeds is
   not tested for a mark: with two seeds the t quantile is 12.7 and the bootstrap over the
   test set sees one or two training runs, not the spread between them. Its interval is
   still printed.
2. **One family.** The p-values of the remaining comparisons (t-tests and bootstraps
   together) are adjusted with the table's correction (:data:`harness.reports.stats.CORRECTIONS`,
   Holm's by default); a comparison is marked when its adjusted p is below
   :data:`SIGNIFICANCE`. The notes name the correction and the family's size.
3. **Chance.** Where the table has a chance row (the same evaluation on random
   embeddings of the same test set, :mod:`~harness.reports.tables.chance`), a comparison
   in which neither the row nor the baseline lies above the chance interval is not
   marked: a difference between two models that retrieve no better than random
   embeddings is not a finding about either method.

Rules 1 and 3 depend on the design (seeds) and on the level of the rows, not on the
difference between them; they are applied after the correction, so the family counts
every comparison with enough seeds, including those rule 3 then leaves unmarked (a
conservative family).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from harness.reports.stats import CORRECTIONS, adjust_p_values
from harness.reports.tables.columns import MIN_SEEDS_FOR_MARK, VERDICT_COLUMNS

__all__ = ["judge", "is_judged", "FEW_SEEDS", "AT_CHANCE"]

#: Why a comparison is unmarked (the ``unmarked`` column), as the paired-tests table prints it.
FEW_SEEDS = f"fewer than {MIN_SEEDS_FOR_MARK} seeds"
AT_CHANCE = "both rows at chance"


def is_judged(tests: pd.DataFrame) -> bool:
    """Whether ``tests`` already carry :func:`judge`'s columns."""
    return all(c in tests for c in VERDICT_COLUMNS)


def judge(
    tests: pd.DataFrame, *, correction: str = "holm", chance: pd.DataFrame | None = None
) -> pd.DataFrame:
    """The paired tests (``TEST_COLUMNS``) with ``VERDICT_COLUMNS`` added: ``p_t_adjusted``
    and ``p_boot_adjusted`` (NaN where the comparison has fewer paired seeds than
    :data:`MIN_SEEDS_FOR_MARK` or the test was not made), the ``correction`` and the
    ``family`` size it covered (the number of p-values adjusted together), and
    ``unmarked``: :data:`FEW_SEEDS`, :data:`AT_CHANCE` (``chance``: a frame of
    ``dataset, metric, mean, half_width`` in percent) or empty. A mark is then earned by
    an adjusted p below :data:`SIGNIFICANCE` with ``unmarked`` empty."""
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction {correction!r}")
    out = tests.copy()
    if out.empty:
        return out.assign(**{c: pd.Series(dtype=object) for c in VERDICT_COLUMNS})
    enough = out["pairs"].to_numpy() >= MIN_SEEDS_FOR_MARK
    p_t = np.where(enough, out["p_t"].to_numpy(np.float64), np.nan)
    p_boot = np.where(enough, out["p_boot"].to_numpy(np.float64), np.nan)
    adjusted = adjust_p_values(np.concatenate([p_t, p_boot]), correction)
    out["p_t_adjusted"], out["p_boot_adjusted"] = adjusted[: len(out)], adjusted[len(out) :]
    out["correction"] = correction
    out["family"] = int((~np.isnan(p_t)).sum() + (~np.isnan(p_boot)).sum())
    at_chance = _at_chance(out, chance)
    out["unmarked"] = np.where(~enough, FEW_SEEDS, np.where(at_chance, AT_CHANCE, ""))
    return out


def _at_chance(tests: pd.DataFrame, chance: pd.DataFrame | None) -> np.ndarray:
    """Per comparison: whether neither its row's nor its baseline's mean lies above the
    upper end of the chance interval of its dataset and metric (False where the table has
    no chance value for them)."""
    if chance is None or chance.empty:
        return np.zeros(len(tests), bool)
    upper = {
        (c.dataset, c.metric): c.mean + (0.0 if math.isnan(c.half_width) else c.half_width)
        for c in chance.itertuples(index=False)
    }
    top = np.array(
        [upper.get((t.dataset, t.metric), math.nan) for t in tests.itertuples(index=False)]
    )
    with np.errstate(invalid="ignore"):
        return (
            ~np.isnan(top)
            & (tests["row_mean"].to_numpy(np.float64) <= top)
            & (tests["baseline_mean"].to_numpy(np.float64) <= top)
        )
