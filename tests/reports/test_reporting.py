"""The results table printed by ``run``."""

from harness.reports.results import format_results


def _record(method, metrics, seed=0, selection="validation"):
    return {
        "dataset": "synthetic",
        "method": method,
        "loss": "margin",
        "seed": seed,
        "protocol": "smoke",
        "fingerprint": "abc",
        "selection": selection,
        "metrics": metrics,
    }


def test_columns_are_the_union_and_seeds_give_mean_and_t_interval():
    text = format_results(
        [
            _record("plain", {"precision_at_1": 0.5}, 0),
            _record("plain", {"precision_at_1": 0.7}, 1),
            _record("diml", {"precision_at_1": 0.6, "global_precision_at_1": 0.5}),
        ]
    )
    header, _, plain, diml, interval, footer = text.splitlines()[:6]
    assert header.split()[-2:] == ["P@1", "cos:P@1"]
    assert plain.split()[-2:] == [
        "60.00±127.06",
        "-",
    ]  # 95% t half-width: t(0.975, 1) * 14.14 / sqrt(2)
    assert diml.split()[-2:] == ["60.00", "50.00"]
    assert interval == "mean ± half-width of the 95% Student t-interval over seeds"
    assert "fingerprint abc" in footer


def test_test_set_selection_is_flagged():
    assert "TEST-SET SELECTION" in format_results(
        [_record("plain", {"precision_at_1": 0.5}, selection="test-paper")]
    )
