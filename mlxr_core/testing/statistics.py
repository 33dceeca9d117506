"""Statistics the tests of samplers and drafters share."""

from __future__ import annotations

from math import erfc, sqrt

import numpy as np


def chi_square_p(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """The p-value of Pearson's chi-square test of ``observed`` counts against the probabilities
    ``expected_p`` (categories of zero probability left out), by Wilson-Hilferty's normal
    approximation of the chi-square tail (good to about 1e-3 for a handful of degrees of freedom)."""
    keep = expected_p > 0
    observed, expected_p = observed[keep], expected_p[keep]
    expected = expected_p / expected_p.sum() * observed.sum()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))
    return 0.5 * erfc(z / sqrt(2))
