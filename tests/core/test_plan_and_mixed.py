"""docs/rules.md#batch-plan batch plans, exact-coverage planner, topology, round-robin; docs/rules.md#evaluation
mixed-label batches."""

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.mixed import mixed_label_batches
from value_assets.core.plan import (
    assign_to_ranks,
    build_plan,
    check_topology,
    choose_exact_coverage,
    coverage,
    plan_from_json,
)
from value_assets.core.strict_json import canonical_bytes

pytestmark = pytest.mark.unit


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 60), g=st.integers(1, 60), epochs=st.integers(1, 4), seed=st.integers(-1000, 10**6))
def test_plan_properties(n, g, epochs, seed):
    if n < g:
        with pytest.raises(InputError, match=str(g)):
            build_plan(n, g, epochs, seed)
        return
    plan = build_plan(n, g, epochs, seed)
    per = n // g
    assert plan.num_steps == per * epochs
    for e in range(epochs):
        rows = [i for s in plan.steps[e * per : (e + 1) * per] for i in s]
        assert len(rows) == len(set(rows)) == per * g  # each row at most once per epoch
        order = list(range(n))
        random.Random(seed + e).shuffle(order)
        assert rows == order[: per * g]
    assert all(len(s) == g for s in plan.steps)
    assert plan.coverage() == {"dropped": (n % g) * epochs, "repeated": 0}
    again = build_plan(n, g, epochs, seed)
    assert again.steps == plan.steps and again.sha256 == plan.sha256
    assert plan.batch(1) == plan.steps[0] and plan.batch(plan.num_steps) == plan.steps[-1]


def test_plan_artifact_sha_and_round_trip():
    plan = build_plan(10, 3, 2, 5)
    doc = plan.to_json()
    assert doc["seed"] == 5 and doc["global_batch_size"] == 3 and doc["epochs"] == 2 and doc["algorithm"]
    assert doc["steps"] == [list(s) for s in plan.steps] and doc["drop_incomplete_batch"] is True
    assert plan.sha256 == sha256_bytes(canonical_bytes(doc))
    assert build_plan(10, 3, 2, 6).sha256 != plan.sha256
    assert plan_from_json(doc, "p").steps == plan.steps
    doc["steps"][0] = list(reversed(doc["steps"][0]))
    with pytest.raises(InputError, match="do not match"):
        plan_from_json(doc, "p")


@pytest.mark.parametrize(
    "args, name, needle",
    [
        ((0, 1), "num_rows", "0"),
        ((5, 0), "global_batch_size", "0"),
        ((5, -2), "global_batch_size", "-2"),
        ((5, True), "global_batch_size", "True"),
        ((5, 2.0), "global_batch_size", "2.0"),
        ((5, 2, 0), "epochs", "0"),
        ((5, 2, 1, 1.5), "seed", "1.5"),
        ((5, 2, 1, True), "seed", "True"),
        ((3, 4), "global_batch_size", "4"),
    ],
)
def test_plan_errors(args, name, needle):
    with pytest.raises(InputError) as ei:
        build_plan(*args)
    assert ei.value.where == name and needle in ei.value.message
    with pytest.raises(IndexError):
        build_plan(4, 2).batch(3)


def test_coverage_counts_repeats():
    assert coverage(4, [(0, 1), (1, 1)], 1) == {"dropped": 2, "repeated": 2}
    assert coverage(4, [(0, 1), (2, 3)], 1) == {"dropped": 0, "repeated": 0}


def _brute_exact(n, gpus, maxg):
    dp = max(d for d in range(1, n + 1) if d <= min(n, gpus, maxg) and n % d == 0)
    g = max(m for m in range(1, n + 1) if m <= min(n, maxg) and m % dp == 0 and n % m == 0)
    return dp, g


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 400), gpus=st.integers(1, 64), maxg=st.integers(1, 512))
def test_exact_coverage_against_brute_force(n, gpus, maxg):
    c = choose_exact_coverage(n, gpus, maxg)
    assert (c.dp, c.global_batch_size) == _brute_exact(n, gpus, maxg)
    assert c.dropped == 0 and c.repeated == 0
    assert c.global_batch_size % c.dp == 0 and n % c.global_batch_size == 0
    plan = build_plan(n, c.global_batch_size, 2, 0)
    assert plan.coverage() == {"dropped": 0, "repeated": 0}


def test_exact_coverage_examples_and_errors():
    c = choose_exact_coverage(1000, 8, 256)
    assert (c.dp, c.global_batch_size) == (8, 200)
    c = choose_exact_coverage(7, 8, 64)  # prime N: dp 7, G 7
    assert (c.dp, c.global_batch_size) == (7, 7)
    c = choose_exact_coverage(7, 4, 64)
    assert (c.dp, c.global_batch_size) == (1, 7)
    for args in [(0, 1, 1), (5, 0, 1), (5, 1, 0), (5, -1, 4)]:
        with pytest.raises(InputError):
            choose_exact_coverage(*args)


def test_topology():
    assert check_topology(total_gpus=8, tensor_parallel=2, global_batch_size=8, micro_batch_size=2) == 4
    assert (
        check_topology(total_gpus=8, tensor_parallel=2, pipeline_parallel=2, global_batch_size=6, micro_batch_size=3)
        == 2
    )
    with pytest.raises(InputError) as ei:
        check_topology(total_gpus=6, tensor_parallel=4, global_batch_size=8)
    assert ei.value.where == "gpus" and "6" in ei.value.message and "4" in ei.value.message
    with pytest.raises(InputError) as ei:
        check_topology(total_gpus=8, global_batch_size=12)
    assert ei.value.where == "global_batch_size" and "12" in ei.value.message and "8" in ei.value.message
    with pytest.raises(InputError) as ei:
        check_topology(total_gpus=4, global_batch_size=12, micro_batch_size=2)
    assert ei.value.where == "micro_batch_size" and "3" in ei.value.message and "2" in ei.value.message
    with pytest.raises(InputError):
        check_topology(total_gpus=0, global_batch_size=1)


def test_round_robin_assignment():
    assert assign_to_ranks((10, 11, 12, 13, 14, 15), 3) == [[10, 13], [11, 14], [12, 15]]
    assert assign_to_ranks([7, 8], 1) == [[7, 8]]


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(st.integers(0, 1000), min_size=1, max_size=40, unique=True), dp=st.integers(1, 8))
def test_round_robin_property(batch, dp):
    ranks = assign_to_ranks(batch, dp)
    assert len(ranks) == dp
    assert sorted(i for r in ranks for i in r) == sorted(batch)
    for pos, idx in enumerate(batch):
        assert idx in ranks[pos % dp]


# --- mixed-label batches --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    labels=st.lists(st.sampled_from([0.0, 1.0, 0.5, 0.25]), min_size=2, max_size=60),
    g=st.integers(2, 8),
    b=st.integers(1, 8),
    seed=st.integers(0, 10**6),
)
def test_mixed_label_properties(labels, g, b, seed):
    counts = Counter(labels)
    try:
        batches = mixed_label_batches(labels, g, b, seed)
    except InputError as exc:
        # refused only for the documented reasons
        assert g * b > len(labels) or len(counts) < 2 or sum(sorted(counts.values())[:-1]) < b, str(exc)
        return
    assert len(batches) == b and all(len(x) == g for x in batches)
    flat = [i for x in batches for i in x]
    assert len(flat) == len(set(flat)) and all(0 <= i < len(labels) for i in flat)
    assert all(len({labels[i] for i in x}) >= 2 for x in batches)
    assert mixed_label_batches(labels, g, b, seed) == batches


def test_mixed_label_errors():
    with pytest.raises(InputError, match="two distinct labels"):
        mixed_label_batches([1.0] * 10, 2, 2, 0)
    with pytest.raises(InputError, match="too scarce"):
        mixed_label_batches([0.0] * 9 + [1.0], 2, 2, 0)
    with pytest.raises(InputError) as ei:
        mixed_label_batches([0.0, 1.0] * 3, 4, 2, 0)
    assert "8" in ei.value.message and "6" in ei.value.message
    with pytest.raises(InputError, match="global_batch_size|>= 2"):
        mixed_label_batches([0.0, 1.0] * 3, 1, 2, 0)
    with pytest.raises(InputError):
        mixed_label_batches([0.0, 1.0] * 3, 2, 0, 0)
