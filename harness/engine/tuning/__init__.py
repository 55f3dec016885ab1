"""Tuning: Optuna studies over a method's search space, with the same trial budget for
every method: a tuned grid's sweep (``python -m harness tune`` sweeps a grid of one
method).
"""

from harness.engine.tuning.runs import (
    run_final_cell,
    run_trial,
    separated_per_query,
)
from harness.engine.tuning.studies import (
    Study,
    best_trial,
    finished_final_cells,
    fold_plan,
    folds_experiment,
    is_random_trial,
    log,
    record_storage,
    record_study,
    round_start,
    search_cell,
    search_experiment,
    search_seed,
    search_summary,
    settled,
    trial_setting,
    tuned_studies,
)
from harness.engine.tuning.sweep import (
    TASK_ATTR,
    check_search_size,
    check_tuned_folds,
    check_tuned_grid,
    plan_tasks,
    run_worker,
    study_progress,
    tuned_worker_loop,
    unfinished_tuned_cells,
)

__all__ = [
    "run_trial",
    "run_final_cell",
    "separated_per_query",
    "Study",
    "tuned_studies",
    "search_experiment",
    "search_seed",
    "search_cell",
    "folds_experiment",
    "record_study",
    "record_storage",
    "settled",
    "round_start",
    "is_random_trial",
    "search_summary",
    "trial_setting",
    "fold_plan",
    "best_trial",
    "finished_final_cells",
    "log",
    "TASK_ATTR",
    "plan_tasks",
    "tuned_worker_loop",
    "study_progress",
    "unfinished_tuned_cells",
    "run_worker",
    "check_tuned_grid",
    "check_tuned_folds",
    "check_search_size",
]
