"""dml-harness: a fair, reproducible benchmark harness for deep metric learning."""

__version__ = "0.1.0"
