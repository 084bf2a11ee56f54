"""Torch targets, losses and metrics against numpy/Python-loop references."""

import math
from itertools import pairwise

import numpy as np
import pytest
import torch

from value_assets.core import targets as ref
from value_assets.core.objective import Objective
from value_assets.gpu.model import losses as L

pytestmark = pytest.mark.unit

OBJ = Objective()


def test_hl_gauss_golden_and_matches_numpy():
    p = L.hl_gauss(torch.tensor([1.0]), OBJ)[0].numpy()
    top = sorted(p.tolist(), reverse=True)[:3]
    assert top == pytest.approx([0.662221, 0.307345, 0.029861], abs=1e-6)
    r = np.random.default_rng(0).uniform(-0.2, 1.2, 257)
    for obj in (OBJ, Objective(num_bins=11, reward_range=(-1.0, 3.0), hl_gauss_sigma_ratio=1.3)):
        got = L.hl_gauss(torch.tensor(r), obj).numpy()
        assert np.abs(got - ref.hl_gauss(r, obj)).max() < 1e-6


def test_two_hot_matches_numpy_including_edges():
    obj = Objective(target_type="two_hot", num_bins=7, reward_range=(-1.0, 2.0))
    r = np.concatenate([np.random.default_rng(1).uniform(-2, 3, 200), ref.support(obj), [-1.0, 2.0]])
    got = L.two_hot(torch.tensor(r), obj).numpy()
    assert np.abs(got - ref.two_hot(r, obj)).max() < 1e-6
    assert np.allclose(got.sum(1), 1.0, atol=1e-6)


def test_predicted_values_match_numpy():
    logits = torch.randn(13, OBJ.num_bins, generator=torch.Generator().manual_seed(0))
    v = L.predicted_values(logits, OBJ).numpy()
    p = torch.softmax(logits.double(), -1).numpy()
    assert np.abs(v - ref.expected_value(p, OBJ)).max() < 1e-6
    assert torch.equal(L.predicted_values(logits[:, :1], Objective(loss_type="mse")), logits[:, 0])


def _naive(head, returns, mask, cu, obj, g_rows):
    """Python-loop reference: row means, then / global rows; metrics by definition."""
    total, n_act, correct, ent, rs, es = 0.0, 0, 0, 0.0, [], []
    sup = ref.support(obj) if obj.loss_type == "classification" else None
    bounds = cu.tolist()
    for a, b in pairwise(bounds):
        row_l, row_n = 0.0, 0
        for t in range(a, b):
            if mask[t] == 0:
                continue
            R = float(returns[t])
            z = head[t].double().numpy()
            if obj.loss_type == "classification":
                q = np.exp(z - z.max())
                q /= q.sum()
                tgt = ref.target_distribution(np.array([R]), obj)[0]
                li = -float((tgt * np.log(q)).sum())
                V = float(q @ sup)
                correct += int(np.argmax(z) == np.argmax(tgt))
                ent += -float((q * np.log(q)).sum())
            else:
                V = float(z[0])
                li = (V - R) ** 2
            row_l += li
            row_n += 1
            n_act += 1
            rs.append(R)
            es.append(R - V)
        total += row_l / row_n
    rs, es = np.array(rs), np.array(es)
    ev = 1 - es.var() / rs.var() if len(rs) > 1 and rs.var() > 1e-8 else None
    return total / g_rows, n_act, correct, ent, ev


@pytest.mark.parametrize(
    "obj", [OBJ, Objective(target_type="two_hot", num_bins=9), Objective(loss_type="mse", num_bins=1)]
)
def test_loss_and_metrics_against_loop(obj):
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    t = 14
    head = torch.randn(t, obj.head_size, generator=g)
    returns = torch.rand(t, generator=g)
    mask = (torch.rand(t, generator=g) > 0.3).float()
    mask[0] = mask[5] = mask[6] = 1.0
    loss, stats = L.loss_and_stats(head, returns, mask, cu, obj, global_num_rows=7)
    want, n_act, correct, ent, ev = _naive(head, returns, mask, cu, obj, 7)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    m = L.finalize_metrics(stats, obj)
    assert m["active_targets"] == n_act and m["rows"] == 3
    assert m["explained_variance"] == pytest.approx(ev, rel=1e-5, abs=1e-7)  # V is float32
    if obj.loss_type == "classification":
        assert m["value_accuracy"] == pytest.approx(correct / n_act)
        assert m["entropy"] == pytest.approx(ent / n_act, rel=1e-5)
    else:
        assert m["value_accuracy"] is None and m["entropy"] is None


def test_loss_sums_over_shards_to_global_mean():
    """Two ranks each dividing by the GLOBAL row count sum to the single-rank loss."""
    g = torch.Generator().manual_seed(5)
    head = torch.randn(10, OBJ.num_bins, generator=g)
    ret, mask = torch.rand(10, generator=g), torch.ones(10)
    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    whole, _ = L.loss_and_stats(head, ret, mask, cu, OBJ, global_num_rows=3)
    a, _ = L.loss_and_stats(head[:3], ret[:3], mask[:3], cu[:2], OBJ, global_num_rows=3)
    b, _ = L.loss_and_stats(head[3:], ret[3:], mask[3:], cu[1:] - 3, OBJ, global_num_rows=3)
    assert float(a + b) == pytest.approx(float(whole), rel=1e-6)


def test_per_token_reduction_and_undefined_ev():
    head = torch.zeros(4, OBJ.num_bins)
    ret, mask = torch.full((4,), 0.5), torch.tensor([1.0, 1.0, 0.0, 1.0])
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    loss, stats = L.loss_and_stats(head, ret, mask, cu, OBJ, 2, per_token=True, global_num_active=3)
    assert float(loss) == pytest.approx(math.log(OBJ.num_bins), rel=1e-6)  # uniform logits
    assert L.finalize_metrics(stats, OBJ)["explained_variance"] is None  # constant returns


def test_row_without_active_target_is_an_error():
    with pytest.raises(ValueError, match="active target"):
        L.loss_and_stats(
            torch.zeros(3, 51),
            torch.zeros(3),
            torch.tensor([1.0, 0, 0]),
            torch.tensor([0, 1, 3], dtype=torch.int32),
            OBJ,
            2,
        )


def test_the_active_target_check_reads_the_host_copy_when_given():
    """On the GPU the check reads the host micro-batch, never the device tensors."""
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    full = torch.tensor([1.0, 1.0, 0.0])
    empty_row = torch.tensor([1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="active target"):
        L.loss_and_stats(torch.zeros(3, 51), torch.zeros(3), full, cu, OBJ, 2, host_mask=(empty_row, cu))
    loss, _ = L.loss_and_stats(torch.zeros(3, 51), torch.zeros(3), full, cu, OBJ, 2, host_mask=(full, cu))
    assert float(loss) == pytest.approx(math.log(OBJ.num_bins), rel=1e-6)
