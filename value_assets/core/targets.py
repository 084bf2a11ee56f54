"""Target distributions over the value support (docs/rules.md#critic), numpy float64 reference.

The GPU code computes the same in torch; tests hold both to these functions and to the golden
values of docs/rules.md#critic.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import numpy.typing as npt

from value_assets.core.objective import Objective

_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_f64(x: np.ndarray) -> npt.NDArray[np.float64]:
    """math.erf of each element, as float64. `_erf` of an array is an object array (its stubs also
    allow the float it gives for a scalar)."""
    return cast(np.ndarray, _erf(x)).astype(np.float64)


def support(objective: Objective) -> npt.NDArray[np.float64]:
    """Bin centres linspace(low, high, K), float64 shape (K,)."""
    low, high = objective.reward_range
    return np.linspace(low, high, objective.num_bins, dtype=np.float64)


def bin_width(objective: Objective) -> float:
    low, high = objective.reward_range
    return (high - low) / (objective.num_bins - 1)


def hl_gauss(returns: np.ndarray, objective: Objective) -> np.ndarray:
    """HL-Gauss targets: returns float (n,) -> probabilities float64 (n, K), rows sum to 1."""
    r = np.asarray(returns, dtype=np.float64).reshape(-1)
    low, high = objective.reward_range
    c = support(objective)
    w = bin_width(objective)
    sigma = objective.hl_gauss_sigma_ratio * w
    mu = np.clip(r, low, high)[:, None]
    scale = sigma * math.sqrt(2.0)
    upper = _erf_f64((c[None, :] + w / 2 - mu) / scale)
    lower = _erf_f64((c[None, :] - w / 2 - mu) / scale)
    p = 0.5 * (upper - lower)
    row_sums: npt.NDArray[np.float64] = p.sum(axis=1, keepdims=True)  # numpy's stubs say Any
    return p / row_sums


def two_hot(returns: np.ndarray, objective: Objective) -> np.ndarray:
    """Two-hot targets: linear split between the two nearest centres, float64 (n, K)."""
    r = np.asarray(returns, dtype=np.float64).reshape(-1)
    low, high = objective.reward_range
    k = objective.num_bins
    x = (np.clip(r, low, high) - low) / bin_width(objective)
    i = np.minimum(np.floor(x).astype(np.int64), k - 2)
    frac = x - i
    p = np.zeros((r.size, k), dtype=np.float64)
    rows = np.arange(r.size)
    p[rows, i] = 1.0 - frac
    p[rows, i + 1] += frac
    return p


def target_distribution(returns: np.ndarray, objective: Objective) -> np.ndarray:
    if objective.loss_type != "classification":
        raise ValueError("target distributions exist only for the classification objective")
    fn = hl_gauss if objective.target_type == "hl_gauss" else two_hot
    return fn(returns, objective)


def expected_value(probs: np.ndarray, objective: Objective) -> np.ndarray:
    """V = p . support for probabilities float (n, K) -> float64 (n,)."""
    return np.asarray(probs, dtype=np.float64) @ support(objective)
