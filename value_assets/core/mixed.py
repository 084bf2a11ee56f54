"""Mixed-label evaluation batches (docs/rules.md#evaluation): every batch holds at least two labels, so that each
batch's Var(R) > 0 and a per-batch EV exists."""

from __future__ import annotations

import random
from collections.abc import Sequence

from value_assets.core.errors import InputError, require_int, show
from value_assets.core.strict_json import is_int


def mixed_label_batches(
    labels: Sequence[float], global_batch_size: int, num_batches: int, seed: int
) -> list[tuple[int, ...]]:
    """Pick `num_batches` disjoint batches of `global_batch_size` row indices from rows with `labels`.

    One `random.Random(seed)` drives every shuffle, in this order: each label group (sorted-label
    order), the leftover pool, then each batch. Golden value (docs/rules.md#evaluation): labels [0,1] x 6, G=4, B=3,
    seed=17 -> (3,0,8,2), (7,1,6,9), (11,4,10,5).
    """
    g, b = global_batch_size, num_batches
    if not is_int(g) or g < 2:
        raise InputError("global_batch_size", f"must be an integer >= 2 for mixed-label batches, got {show(g)}")
    require_int(b, "num_batches")
    n = len(labels)
    if g * b > n:
        raise InputError("num_batches", f"{b} batches of {g} rows need {g * b} rows, but only {n} rows have a label")
    groups: dict[float, list[int]] = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    if len(groups) < 2:
        raise InputError("labels", f"mixed-label batches need at least two distinct labels, found {sorted(groups)}")
    rng = random.Random(seed)
    for label in sorted(groups):
        rng.shuffle(groups[label])
    batches: list[list[int]] = [[] for _ in range(b)]
    for batch in batches:
        ranked = sorted(groups, key=lambda lab: (-len(groups[lab]), lab))
        first, second = ranked[0], ranked[1]
        if not groups[second]:
            raise InputError(
                "labels",
                f"labels too scarce for {b} mixed batches: counts { ({k: len(v) for k, v in groups.items()}) } ran out",
            )
        batch.append(groups[first].pop())
        batch.append(groups[second].pop())
    pool = [i for label in groups for i in groups[label]]  # groups keep first-appearance order
    rng.shuffle(pool)
    pos = 0
    for batch in batches:
        need = g - len(batch)
        batch.extend(pool[pos : pos + need])
        pos += need
    for batch in batches:
        rng.shuffle(batch)
    return [tuple(batch) for batch in batches]


def default_batch_size(num_rows: int, num_batches: int, dp: int = 1) -> int:
    """The evaluation G when none is given: min(64, rows / B), rounded down to a multiple of dp."""
    g = min(64, num_rows // num_batches)
    return g - g % dp
