"""The settings of the deletion and insertion curves that the command line offers
(``explain --curve-pairs``, ``--insertion-canvas``), in a module without torch so that
``--help`` shows them at once; the curves themselves are
:mod:`harness.components.explanation.scores`."""

from __future__ import annotations

__all__ = ["CURVE_PAIRS", "CANVASES"]

#: Pairs whose deletion / insertion curves are measured by default: each pair costs 19
#: inner steps x (deletion, insertion) + 1 intact image, x 3 pixel orders = 117 forward
#: passes, so 48 pairs take 5,616, the bulk of the command's time on a CPU
#: (``--curve-pairs`` sets it).
CURVE_PAIRS = 48

#: What the insertion curve reveals pixels on: ``mean``, the normalised input's 0 (the
#: protocol's mean colour, also what deletion leaves), or ``blur``, the query itself
#: blurred by a Gaussian of :data:`~harness.components.explanation.scores.BLUR_SIGMA` of
#: the image's side (RISE's insertion substrate, Petsiuk et al. 2018, Sec. 4.1: sigma 5
#: at 224 px).
CANVASES = ("mean", "blur")
