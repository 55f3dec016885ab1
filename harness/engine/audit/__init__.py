"""Audits of runs: a run re-run from its record, the run as built checked against the
recipe ledgers, and each deviation's measured effect (``rerun``, ``deviations --measure``).
"""

from harness.engine.audit.built_run import (
    CLAIMS,
    UNOBSERVED,
    BuiltRun,
    build_run,
    claim_holds,
    observe,
    observes,
)
from harness.engine.audit.deviation_effects import (
    EFFECT_METRICS,
    Effect,
    effect_lines,
    effect_sentences,
    measurable_deviations,
    measure_deviations,
)
from harness.engine.audit.rerun import (
    NUMERIC_PACKAGES,
    RERUN_EXPERIMENT_SUFFIX,
    RerunPlan,
    cell_half_widths,
    check_data,
    input_differences,
    method_options,
    plan_rerun,
    rerun,
)

__all__ = [
    "BuiltRun",
    "build_run",
    "observe",
    "observes",
    "claim_holds",
    "CLAIMS",
    "UNOBSERVED",
    "EFFECT_METRICS",
    "Effect",
    "measure_deviations",
    "measurable_deviations",
    "effect_lines",
    "effect_sentences",
    "NUMERIC_PACKAGES",
    "RERUN_EXPERIMENT_SUFFIX",
    "RerunPlan",
    "plan_rerun",
    "method_options",
    "input_differences",
    "check_data",
    "cell_half_widths",
    "rerun",
]
