"""Golden values from docs/rules.md#batch-plan, 4 and 7, and target distributions against naive loops."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from value_assets.core.mixed import mixed_label_batches
from value_assets.core.objective import Objective
from value_assets.core.plan import build_plan
from value_assets.core.targets import expected_value, hl_gauss, support, target_distribution, two_hot

pytestmark = pytest.mark.unit


def test_plan_golden_two_epochs():
    plan = build_plan(6, 2, 2, 17)
    assert plan.steps == ((0, 5), (1, 2), (3, 4), (2, 4), (5, 3), (0, 1))


def test_plan_golden_drops_incomplete_batch():
    plan = build_plan(7, 3, 1, 0)
    assert plan.steps == ((4, 2, 1), (0, 5, 3))
    assert 6 not in {i for s in plan.steps for i in s}


def test_mixed_label_golden():
    labels = [0.0, 1.0] * 6
    assert mixed_label_batches(labels, 4, 3, 17) == [(3, 0, 8, 2), (7, 1, 6, 9), (11, 4, 10, 5)]


def test_hl_gauss_golden_top_bins():
    p = hl_gauss(np.array([1.0]), Objective())[0]
    top = np.sort(p)[::-1][:3]
    np.testing.assert_allclose(top, [0.662221, 0.307345, 0.029861], atol=5e-7)
    # The mass sits at the top of the support, in order.
    assert list(np.argsort(p)[::-1][:3]) == [50, 49, 48]


def _naive_hl_gauss(r, obj):
    low, high = obj.reward_range
    k = obj.num_bins
    w = (high - low) / (k - 1)
    sigma = obj.hl_gauss_sigma_ratio * w
    mu = min(max(r, low), high)
    p = []
    for j in range(k):
        c = low + j * w
        p.append(
            0.5
            * (
                math.erf((c + w / 2 - mu) / (sigma * math.sqrt(2)))
                - math.erf((c - w / 2 - mu) / (sigma * math.sqrt(2)))
            )
        )
    s = sum(p)
    return [x / s for x in p]


def _naive_two_hot(r, obj):
    low, high = obj.reward_range
    k = obj.num_bins
    w = (high - low) / (k - 1)
    mu = min(max(r, low), high)
    p = [0.0] * k
    # the two nearest centres: lower index i with c_i <= mu <= c_{i+1}
    for i in range(k - 1):
        c0, c1 = low + i * w, low + (i + 1) * w
        if c0 - 1e-12 <= mu <= c1 + 1e-12:
            frac = (mu - c0) / w
            frac = min(max(frac, 0.0), 1.0)
            p[i] = 1.0 - frac
            p[i + 1] = frac
            return p
    raise AssertionError("unreachable")


objectives = st.builds(
    lambda k, lo, width, ratio: Objective(num_bins=k, reward_range=(lo, lo + width), hl_gauss_sigma_ratio=ratio),
    st.integers(2, 64),
    st.floats(-5, 5),
    st.floats(0.1, 10),
    st.floats(0.1, 3),
)


@settings(max_examples=60, deadline=None)
@given(objectives, st.lists(st.floats(-20, 20), min_size=1, max_size=6))
def test_hl_gauss_matches_naive_loop(obj, rs):
    got = hl_gauss(np.array(rs), obj)
    assert got.shape == (len(rs), obj.num_bins) and got.dtype == np.float64
    for row, r in zip(got, rs, strict=True):
        np.testing.assert_allclose(row, _naive_hl_gauss(r, obj), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-12)


@settings(max_examples=80, deadline=None)
@given(objectives, st.lists(st.floats(-20, 20), min_size=1, max_size=6))
def test_two_hot_matches_naive_loop(obj, rs):
    got = two_hot(np.array(rs), obj)
    for row, r in zip(got, rs, strict=True):
        np.testing.assert_allclose(row, _naive_two_hot(r, obj), atol=1e-9)
        assert np.count_nonzero(row > 1e-12) <= 2
    low, high = obj.reward_range
    # The expectation of a two-hot target is the clamped return itself.
    np.testing.assert_allclose(expected_value(got, obj), np.clip(rs, low, high), rtol=1e-9, atol=1e-9)


def test_two_hot_on_centres_and_ends():
    obj = Objective(num_bins=5, target_type="two_hot")  # centres 0, .25, .5, .75, 1
    p = two_hot(np.array([0.0, 0.25, 1.0, 2.0, -1.0, 0.375]), obj)
    np.testing.assert_allclose(p[0], [1, 0, 0, 0, 0])
    np.testing.assert_allclose(p[1], [0, 1, 0, 0, 0])
    np.testing.assert_allclose(p[2], [0, 0, 0, 0, 1])
    np.testing.assert_allclose(p[3], [0, 0, 0, 0, 1])
    np.testing.assert_allclose(p[4], [1, 0, 0, 0, 0])
    np.testing.assert_allclose(p[5], [0, 0.5, 0.5, 0, 0])


def test_target_distribution_dispatch_and_support():
    obj = Objective(target_type="two_hot", num_bins=3)
    np.testing.assert_array_equal(support(obj), [0.0, 0.5, 1.0])
    np.testing.assert_allclose(target_distribution(np.array([0.25]), obj), [[0.5, 0.5, 0.0]])
    with pytest.raises(ValueError):
        target_distribution(np.array([0.5]), Objective(loss_type="mse", num_bins=1))
