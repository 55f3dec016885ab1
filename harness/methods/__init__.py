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

import importlib
import pkgutil

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


def _import_plugins() -> None:
    """Import every module of the package in name order; importing one registers it."""
    for module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        if module != "base" and not module.startswith("_"):
            importlib.import_module(f"{__name__}.{module}")


_import_plugins()

__all__ = [
    "METHODS",
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
