"""Shared by the GPU tier's training tests."""

from __future__ import annotations

import numpy as np


def two_task_rows(n: int = 32) -> list:
    """`n` rows of 41 tokens whose first token (1000 or 1001) decides the return (0 or 1) of their
    20 response tokens: a critic that reads it learns; seed 0."""
    from value_assets.gpu.model.packing import Row

    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        task = i % 2
        toks = np.concatenate([[1000 + task], rng.integers(2000, 49152, size=40)])
        rows.append(Row(row_id=i, tokens=toks, response_length=20, returns=np.full(20, float(task))))
    return rows
