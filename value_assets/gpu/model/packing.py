"""Rows -> packed micro-batches under a token budget, with docs/rules.md#critic target alignment.

A row (one trajectory) is tokens [L], response_length r, returns [r], loss_mask [r]. The value for
response token j is read at absolute position `P + j - 1` with P = L - r (the state before token j
is emitted), so a row's last token is never a prediction position and is not fed to the model:
each row contributes L - 1 tokens. Rows are packed whole, in the given order (deterministic), into
micro-batches of at most `micro_batch_tokens` tokens; a row longer than the budget gets a
micro-batch of its own. No padding is added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True)
class Row:
    row_id: int
    tokens: np.ndarray  # int64 [L]
    response_length: int
    returns: np.ndarray  # float [r]
    loss_mask: np.ndarray | None = None  # int [r]; None means all ones

    def __post_init__(self) -> None:
        L, r = len(self.tokens), self.response_length
        if not 1 <= r < L:
            raise ValueError(f"row {self.row_id}: response_length {r} must be in [1, {L})")
        if len(self.returns) != r:
            raise ValueError(f"row {self.row_id}: {len(self.returns)} returns for response_length {r}")
        if self.loss_mask is not None and len(self.loss_mask) != r:
            raise ValueError(f"row {self.row_id}: {len(self.loss_mask)} loss_mask values for response_length {r}")


@dataclass
class MicroBatch:
    """One packed micro-batch. t = packed tokens, n = rows.

    tokens int64 [t]; position_ids int64 [t] (restart at 0 per row); cu_seqlens int32 [n+1];
    max_seqlen int; returns float32 [t] (0 off-target); mask float32 [t] (1 on active targets);
    row_ids int64 [n] (caller's row ids); response_lengths int64 [n];
    response_start int64 [n]: packed index of the position that predicts response token 0.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    returns: torch.Tensor
    mask: torch.Tensor
    row_ids: torch.Tensor
    response_lengths: torch.Tensor
    response_start: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_rows(self) -> int:
        return int(self.row_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        # Everything moves; callers keep the host MicroBatch and hand its cu_seqlens to
        # `critic_forward(..., cu_seqlens_host=)` so that no layer reads it back from the device.
        return MicroBatch(**moved)


def row_model_length(row: Row) -> int:
    return len(row.tokens) - 1


def _pack(rows: Sequence[Row]) -> MicroBatch:
    toks, pos, rets, masks, cu, starts = [], [], [], [], [0], []
    for row in rows:
        L, r = len(row.tokens), row.response_length
        n = L - 1
        p = L - r
        toks.append(np.asarray(row.tokens[:n], dtype=np.int64))
        pos.append(np.arange(n, dtype=np.int64))
        ret = np.zeros(n, dtype=np.float32)
        msk = np.zeros(n, dtype=np.float32)
        lm = np.ones(r) if row.loss_mask is None else np.asarray(row.loss_mask)
        ret[p - 1 : p - 1 + r] = np.asarray(row.returns, dtype=np.float64)
        msk[p - 1 : p - 1 + r] = lm
        rets.append(ret)
        masks.append(msk)
        starts.append(cu[-1] + p - 1)
        cu.append(cu[-1] + n)
    lengths = np.diff(cu)
    return MicroBatch(
        tokens=torch.from_numpy(np.concatenate(toks)),
        position_ids=torch.from_numpy(np.concatenate(pos)),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=int(lengths.max()),
        returns=torch.from_numpy(np.concatenate(rets)),
        mask=torch.from_numpy(np.concatenate(masks)),
        row_ids=torch.tensor([row.row_id for row in rows], dtype=torch.int64),
        response_lengths=torch.tensor([row.response_length for row in rows], dtype=torch.int64),
        response_start=torch.tensor(starts, dtype=torch.int64),
    )


def pack_rows(rows: Sequence[Row], micro_batch_tokens: int) -> list[MicroBatch]:
    """Greedy, order-preserving packing into micro-batches of <= micro_batch_tokens tokens."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    out: list[MicroBatch] = []
    cur: list[Row] = []
    used = 0
    for row in rows:
        n = row_model_length(row)
        if cur and used + n > micro_batch_tokens:
            out.append(_pack(cur))
            cur, used = [], 0
        cur.append(row)
        used += n
    if cur:
        out.append(_pack(cur))
    return out


def response_slices(mb: MicroBatch) -> list[tuple[int, slice]]:
    """(row_id, packed slice of the r prediction positions of that row's response tokens)."""
    return [
        (int(rid), slice(int(s), int(s) + int(r)))
        for rid, s, r in zip(mb.row_ids.tolist(), mb.response_start.tolist(), mb.response_lengths.tolist(), strict=True)
    ]
