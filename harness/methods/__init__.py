"""Method plugins: one module per paper, registered by name.

Every module of this package is imported here (``base`` first), so a new file
``methods/<name>.py`` whose class carries ``@register_method`` is registered without
editing anything else. The modules of a plugin's larger pieces (``diml_rerank.py``,
``avsl_graph.py``) and of the figure dataclasses (``figures.py``) register nothing. An
installed package registers plugins through the entry-point group ``dml_harness.methods``
(:data:`~harness.methods.base.PLUGIN_GROUP`); the registry imports them at its first lookup.

>>> from harness.methods import create_method, list_methods
>>> list_methods('*grouping')
['agrouping', 'cgrouping', 'ggrouping', 'mgrouping', 'ngrouping']
"""

from harness.base.registry import import_modules
from harness.methods.base import (
    METHODS,
    HeadOutput,
    Method,
    PaperInfo,
    TrainingBatch,
    check_method_options,
    create_method,
    list_methods,
    register_method,
    register_variant,
    training_base,
)
from harness.methods.roles import (
    ROLES,
    Explainer,
    FigureMaker,
    HostReader,
    IdReranker,
    LossShaper,
    PairExplainer,
    PairScorer,
    ProcessBound,
    Reranker,
    TrainsAsAnother,
    Tunable,
)

# Every module of the package, in name order: importing one registers its methods.
import_modules(__name__, __path__, skip=("base",))

__all__ = [
    "METHODS",
    "ROLES",
    "Explainer",
    "FigureMaker",
    "HostReader",
    "IdReranker",
    "LossShaper",
    "PairExplainer",
    "PairScorer",
    "ProcessBound",
    "Reranker",
    "TrainsAsAnother",
    "Tunable",
    "HeadOutput",
    "Method",
    "PaperInfo",
    "TrainingBatch",
    "check_method_options",
    "create_method",
    "list_methods",
    "register_method",
    "register_variant",
    "training_base",
]
