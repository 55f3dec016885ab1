"""The tracking store: the one place that talks to MLflow."""
