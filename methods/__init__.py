"""Method plugins: one module per paper, registered by name.

>>> from methods import create_method, list_methods
>>> list_methods('*grouping')
['agrouping', 'cgrouping', 'ggrouping', 'mgrouping', 'ngrouping']
"""

from methods import (
    agrouping,  # noqa: F401  (registers)
    avsl,  # noqa: F401  (registers)
    diablo,  # noqa: F401  (registers)
    diml,  # noqa: F401  (registers)
    plain,  # noqa: F401  (registers)
    sam,  # noqa: F401  (registers)
)
from methods.base import (
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

__all__ = ["METHODS", "HeadOutput", "Method", "PaperInfo", "TrainingBatch", "check_method_options",
           "create_method", "list_methods", "register_method", "register_variant", "training_base"]
