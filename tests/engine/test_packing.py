"""Packing and docs/rules.md#critic alignment against a naive reference."""

import numpy as np
import pytest

from value_assets.gpu.model.packing import Row, pack_rows, response_slices

pytestmark = pytest.mark.unit


def _rows(seed=0, n=9):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(2, 20))
        r = int(rng.integers(1, L))
        mask = rng.integers(0, 2, r)
        mask[rng.integers(0, r)] = 1
        out.append(
            Row(
                row_id=100 + i,
                tokens=rng.integers(0, 1000, L),
                response_length=r,
                returns=rng.uniform(0, 1, r),
                loss_mask=mask if i % 2 else None,
            )
        )
    return out


def test_alignment_matches_naive_reference():
    rows = _rows()
    mbs = pack_rows(rows, micro_batch_tokens=25)
    by_id = {r.row_id: r for r in rows}
    seen = []
    for mb in mbs:
        assert mb.num_tokens <= 25 or mb.num_rows == 1
        assert mb.cu_seqlens[-1] == mb.num_tokens
        bounds = mb.cu_seqlens.tolist()
        for k, rid in enumerate(mb.row_ids.tolist()):
            row = by_id[rid]
            seen.append(rid)
            a, b = bounds[k], bounds[k + 1]
            L, r = len(row.tokens), row.response_length
            P = L - r
            assert b - a == L - 1
            assert mb.tokens[a:b].tolist() == row.tokens[: L - 1].tolist()
            assert mb.position_ids[a:b].tolist() == list(range(L - 1))
            lm = np.ones(r) if row.loss_mask is None else row.loss_mask
            for pos in range(L - 1):  # naive: which response token (if any) does pos predict?
                j = pos - P + 1
                if 0 <= j < r:
                    assert mb.returns[a + pos].item() == pytest.approx(row.returns[j], abs=1e-7)
                    assert mb.mask[a + pos].item() == lm[j]
                else:
                    assert mb.mask[a + pos].item() == 0 and mb.returns[a + pos].item() == 0
        for rid, sl in response_slices(mb):
            row = by_id[rid]
            assert np.allclose(mb.returns[sl].numpy(), row.returns, atol=1e-7)
    assert seen == [r.row_id for r in rows]  # order preserved, nothing dropped


def test_long_row_gets_its_own_microbatch_and_bad_rows_refused():
    rows = _rows(1, 4)
    assert all(mb.num_rows == 1 for mb in pack_rows(rows, 1))
    with pytest.raises(ValueError, match="response_length"):
        Row(row_id=0, tokens=np.arange(3), response_length=3, returns=np.zeros(3))
    with pytest.raises(ValueError, match="returns"):
        Row(row_id=0, tokens=np.arange(3), response_length=2, returns=np.zeros(1))
