"""Embeddings for the evaluation tests: continuous data whose only exact ties are
harmless, dyadic data with exact ties across classes (``test_evaluation.py`` says why
each), and wide data that a search covers in several chunks; and the comparison of two
rankings that BLAS may round apart."""

from __future__ import annotations

import numpy as np

PML_METRICS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


def class_sizes_with_lone(rng, num_classes: int, high: int) -> np.ndarray:
    """Unequal class sizes 1..high, at least three singleton (lone) classes."""
    sizes = rng.integers(1, high + 1, num_classes)
    sizes[:3] = 1
    return sizes


def continuous_data(seed: int = 0, dim: int = 16):
    """Clustered random vectors, unequal classes, lone classes, exact duplicates within classes."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(40), class_sizes_with_lone(rng, 40, 14))
    centres = rng.standard_normal((40, dim))
    x = centres[labels] + 1.3 * rng.standard_normal((len(labels), dim))
    n = len(labels)
    for i in rng.choice(n, 12, replace=False):  # duplicates within the class
        same = np.flatnonzero(labels == labels[i])
        x[same[0]] = x[i]
    order = rng.permutation(n)
    return x[order].astype(np.float32), labels[order]


def dyadic_data(seed: int = 0, n: int = 260, dim: int = 8):
    """Unit vectors with coordinates in {0, +-1/2}: exact inner products, many exact ties."""
    rng = np.random.default_rng(seed)
    pool = np.zeros((24, dim), np.float32)
    for row in pool:
        row[rng.choice(dim, 4, replace=False)] = rng.choice([-0.5, 0.5], 4)
    sizes = class_sizes_with_lone(rng, 30, 16)
    labels = np.repeat(np.arange(len(sizes)), sizes)[:n]
    home = rng.integers(0, len(pool), (len(sizes), 2))
    choice = home[labels, rng.integers(0, 2, len(labels))]
    stray = rng.random(len(labels)) < 0.3
    choice[stray] = rng.integers(0, len(pool), stray.sum())
    order = rng.permutation(len(labels))
    return pool[choice][order], labels[order]


def wide_data(seed: int = 0):
    """1,100 x 512: large enough for several chunks on faiss's BLAS path; a few duplicates."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 120, 1100)
    x = (rng.standard_normal((120, 512))[y] + 2.0 * rng.standard_normal((1100, 512))).astype(
        np.float32
    )
    x[5] = x[6]
    x[7] = x[6]
    x[900] = x[901]
    return x, y


#: How far two BLAS blockings of the same float32 product may round apart (unit vectors,
#: D = 512): observed up to 1.3e-7 on another x86 BLAS and 9e-8 on CUDA; 1e-6 leaves margin.
SIMILARITY_TOLERANCE = 1e-6


def assert_same_ranking_up_to_rounding(idx, sims, idx_ref, sims_ref, tol=SIMILARITY_TOLERANCE):
    """Similarities equal within ``tol``; neighbour lists equal except where two entries'
    similarities are within ``tol`` of each other (a near tie that rounding may order
    either way), in which case the swapped entries must hold the same similarity."""
    np.testing.assert_allclose(sims, sims_ref, rtol=0, atol=tol)
    rows, cols = np.nonzero(idx != idx_ref)
    for r, c in zip(rows, cols, strict=True):
        j = np.flatnonzero(idx_ref[r] == idx[r, c])  # where the reference put this item
        near = abs(sims_ref[r, c] - sims_ref[r, j[0]]) <= 2 * tol if j.size else False
        assert near, f"row {r}, rank {c}: item {idx[r, c]} vs {idx_ref[r, c]} is not a near tie"
