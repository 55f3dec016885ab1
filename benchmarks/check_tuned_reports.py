"""A tuned table's separated and concatenated cells recomputed from the fold models' embeddings.

For each row of ``--methods`` (default ``plain`` and ``agrouping``; trained methods, not a
test-time re-ranking) in a tuned grid's experiment, every seed's fold models (the
``tune_fold_runs`` of its report runs) are loaded from their recorded weights and
protocol, the test split embedded again, and:

* **separated**: each fold model's embeddings scored alone, the metrics averaged over
  the models;
* **concatenated**: the models' L2-normalised embeddings joined and scored once.

Each recomputed value is printed beside the report run's recorded metric, and the mean
over seeds beside the table's cell (:func:`harness.reports.tables.summarize` of the
report). The check is independent of the code that wrote the reports
(``harness.engine.tuning.runs``): it reads the store as a user would and embeds with the
public embedding path.

Usage: ``python benchmarks/check_tuned_reports.py --experiment fair-tuned-roth2020-smoke
[--methods plain,agrouping] [--metrics precision_at_1,mean_average_precision_at_r]``; exit 1 when a value
differs from the table by more than ``--tolerance`` (default 1e-5, in the metric's units).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np
import torch

from harness.base.errors import HarnessError
from harness.components.data.transforms import build_transform
from harness.components.evaluation import evaluate_embeddings, l2_normalize
from harness.config.protocol import protocol_from_dict
from harness.engine.audit.rerun import method_options
from harness.engine.run.data import prepare_splits
from harness.engine.run.embedding import embed_images
from harness.engine.run.model import build_model
from harness.reports.tables import summarize
from harness.reports.tables.load import load_runs, select_report
from harness.store.records import read_json_artifact, read_record
from harness.store.weights import load_finished_weights


def fold_embeddings(run_id: str, cache: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """A fold model's test embeddings (L2-normalised), the test labels and its protocol's
    evaluation settings, from its record and weights alone."""
    record = read_record(run_id)
    protocol = protocol_from_dict(read_json_artifact(run_id, "protocol/resolved.json"))
    method, dataset = record.tag("method"), record.tag("dataset")
    model = build_model(protocol, method, method_options(record))
    load_finished_weights(model, run_id, flag="a fold model")
    key = (dataset, repr(protocol.splits))
    if key not in cache:
        cache[key] = prepare_splits(protocol, dataset, None, seed=int(record.tag("seed")))
    test = cache[key].test
    with torch.no_grad():
        embedded, _ = embed_images(
            model.eval(),
            test,
            build_transform(protocol.image, train=False),
            protocol.image,
            batch_size=protocol.evaluation.batch_size,
            device=torch.device("cpu"),
            workers=0,
            keep=(),
            precision=protocol.numerics.precision,
        )
    settings = {
        "recall_k": protocol.evaluation.recall_k_for(dataset),
        "metrics": protocol.evaluation.metrics,
    }
    return l2_normalize(np.asarray(embedded, np.float32)), np.asarray(test.labels), settings


def recompute(fold_runs: list[str], cache: dict) -> dict[str, dict[str, float]]:
    """``{"separated": metrics, "concatenated": metrics}`` of one seed's fold models."""
    parts = [fold_embeddings(r, cache) for r in fold_runs]
    labels, settings = parts[0][1], parts[0][2]
    alone = [evaluate_embeddings(e, labels, **settings) for e, _, _ in parts]
    joined = evaluate_embeddings(
        np.concatenate([e for e, _, _ in parts], axis=1), labels, **settings
    )
    separated = {k: float(np.mean([a[k] for a in alone])) for k in alone[0] if k in joined}
    return {"separated": separated, "concatenated": dict(joined)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--methods", default="plain,agrouping")
    parser.add_argument("--metrics", default="precision_at_1,mean_average_precision_at_r")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    metrics = args.metrics.split(",")
    try:
        runs = load_runs([args.experiment])
    except HarnessError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    wanted = args.methods.split(",")
    rows = list(dict.fromkeys(zip(runs["method"], runs["loss"], runs["dataset"], strict=True)))
    chosen_rows = [r for r in rows if r[0] in wanted]
    if runs.empty or "tune_report" not in runs or not chosen_rows:
        print(
            f"error: experiment {args.experiment!r} has no tuned grid's report runs of "
            f"{', '.join(wanted)} (expected the experiment a tuned sweep wrote its tables from)",
            file=sys.stderr,
        )
        return 2
    worst, cache = 0.0, {}
    for method, loss, dataset in chosen_rows:
        chosen = runs[
            (runs["method"] == method) & (runs["loss"] == loss) & (runs["dataset"] == dataset)
        ]
        by_report: dict[str, list[dict]] = defaultdict(list)
        for run in chosen.itertuples(index=False):
            fold_runs = read_record(run.run_id).tag("tune_fold_runs").split()
            ours = recompute(fold_runs, cache)[run.tune_report]
            by_report[run.tune_report].append(ours)
            for m in metrics:
                recorded = float(getattr(run, f"test_{m}"))
                worst = max(worst, abs(recorded - ours[m]))
                print(
                    f"{method} {loss} {dataset} seed {run.seed} {run.tune_report:12s} {m}: "
                    f"recorded {recorded:.6f}, recomputed {ours[m]:.6f}"
                )
        for report, values in by_report.items():
            cells = summarize(select_report(chosen, report), metrics).set_index("metric")
            for m in metrics:
                mean = 100 * float(np.mean([v[m] for v in values]))
                table = float(cells.loc[m, "mean"])
                worst = max(worst, abs(mean - table) / 100)
                print(
                    f"{method} {loss} {dataset} {report:12s} {m}: table {table:.4f}%, "
                    f"recomputed mean over {len(values)} seeds {mean:.4f}%"
                )
    print(f"largest difference: {worst:.2e} (tolerance {args.tolerance:g})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
