"""Explanations: a finished run's attribution maps, their part scores and sanity checks,
and the strips of maps (``python -m harness explain`` and ``explain-table``).
"""

from harness.engine.explain.explain_run import (
    SCORE_KEYS,
    explain_run,
    record_to_run,
)
from harness.engine.explain.maps import (
    PairMaps,
    Pairs,
    RunContext,
    compute_maps,
    load_images,
    load_run,
    near_miss_class_pairs,
    near_miss_pairs,
    neighbour_pairs,
    output_rows,
    part_labels,
    scored_maps,
    similarity_gradcam,
    to_pictures,
)
from harness.engine.explain.parts import (
    part_scores,
    uniform_if_empty,
)
from harness.engine.explain.sanity import (
    SANITY_SCORES,
    feature_grid,
    randomised_scores,
    reference_maps,
    sanity_metrics,
    sanity_verdicts,
    trained_parts_stage,
)
from harness.engine.explain.strip import (
    explain_strip,
)

__all__ = [
    "explain_run",
    "record_to_run",
    "SCORE_KEYS",
    "RunContext",
    "Pairs",
    "PairMaps",
    "load_run",
    "near_miss_class_pairs",
    "near_miss_pairs",
    "neighbour_pairs",
    "load_images",
    "to_pictures",
    "part_labels",
    "similarity_gradcam",
    "output_rows",
    "compute_maps",
    "scored_maps",
    "uniform_if_empty",
    "part_scores",
    "feature_grid",
    "reference_maps",
    "randomised_scores",
    "sanity_verdicts",
    "sanity_metrics",
    "trained_parts_stage",
    "SANITY_SCORES",
    "explain_strip",
]
