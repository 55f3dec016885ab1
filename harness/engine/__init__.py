"""Training, evaluation of a model, distributed runs, grid sweeps and Optuna tuning."""
