"""bench/train_throughput.py's idle-gap attribution: each stretch with no kernel running is charged
to the part of the step (forward, backward, optimizer, between) whose kernel ends it, checked
against intervals worked out by hand; the phase of an op comes from its real profiler ancestry."""

from __future__ import annotations

import pytest
import torch

from bench.train_throughput import (
    IDLE_PHASES,
    OPTIMIZER_RANGE,
    SCHEDULE_RANGE,
    _ancestry,
    _group,
    host_window,
    idle_by_phase,
    kernel_phase,
)

pytestmark = pytest.mark.unit
FWD, BWD, OPT, BETWEEN = IDLE_PHASES


def test_each_gap_is_charged_to_the_kernel_that_ends_it():
    # window 0..100; kernels (overlapping ones on two streams count as one busy stretch)
    kernels = [
        (5, 20, BETWEEN),  # gap 0-5 -> between (copies in)
        (18, 30, FWD),  # overlaps: no gap
        (40, 50, FWD),  # gap 30-40 -> forward
        (45, 60, BWD),  # inside the busy stretch
        (61, 70, BWD),  # gap 60-61 -> backward
        (80, 90, OPT),  # gap 70-80 -> optimizer
    ]
    got = idle_by_phase(list(reversed(kernels)), 0, 100)  # order of the input does not matter
    assert got == {FWD: 10, BWD: 1, OPT: 10, BETWEEN: 5, "after the last kernel": 10}
    busy = 90 - 5 - 10 - 1 - 10  # the union of the intervals
    assert sum(got.values()) == 100 - busy


def test_no_kernels_is_all_after_and_a_busy_window_has_no_idle():
    assert idle_by_phase([], 0, 7)["after the last kernel"] == 7
    assert sum(idle_by_phase([(0, 10, FWD)], 0, 10).values()) == 0


def test_phases_from_real_profiler_ancestry():
    from torch.profiler import ProfilerActivity, profile, record_function

    w = torch.randn(8, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(SCHEDULE_RANGE):
            y = (w @ w).sum()
        y.backward()
        with record_function(OPTIMIZER_RANGE), torch.no_grad():
            w.mul_(0.5)
        torch.zeros(3).add_(1)
    phases = {}
    for e in prof.events():
        if e.name in ("aten::mm", "aten::mul_", "aten::add_"):
            phases.setdefault(e.name, set()).add(kernel_phase(_ancestry(e)))
    assert phases["aten::mm"] == {FWD, BWD}  # the forward's mm and the backward's two
    assert phases["aten::mul_"] == {OPT}
    assert BETWEEN in phases["aten::add_"]


def test_the_window_is_the_host_ops_span_not_the_block_around_the_profiler():
    # The H100 profile of 2026-12-07 charged 0.30 of 1.57 s to "after the last kernel": the window
    # was the wall around `with profile()`, which holds the profiler's own start and stop.
    import time

    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
        time.sleep(0.05)
        torch.ones(4).mul_(2)
    block_us = (time.perf_counter() - t) * 1e6
    ops = [(e.time_range.start, e.time_range.end) for e in prof.events()]
    start, end = host_window(ops)
    assert (start, end) == (min(a for a, _ in ops), max(b for _, b in ops))
    assert 0.05e6 <= end - start < block_us
    assert host_window([(5, 10), (7, 40), (12, 30)]) == (5, 40)


def test_norms_and_the_swiglu_get_groups_of_their_own_from_real_profiler_ancestry():
    # Which share of the step a fused residual + RMSNorm (or the SwiGLU kernels) could touch: the
    # kernels below the norm's and the SwiGLU's ops are split out of "elementwise / other".
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(4, 16, requires_grad=True)
    norm = torch.nn.RMSNorm(16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = norm(x)
        with record_function("TritonSwiGLUFunction"):
            z = torch.nn.functional.silu(y[:, :8]) * y[:, 8:]
        w = z + 1.0
    groups = {}
    for e in prof.events():
        groups.setdefault(_group(e.name, _ancestry(e)), set()).add(e.name)
    assert any("rms_norm" in n for n in groups["norm (RMSNorm / LayerNorm)"]), groups
    assert "aten::silu" in groups["SwiGLU"] and "aten::mul" in groups["SwiGLU"], groups
    assert "aten::add" in groups["elementwise / other"], groups
    assert _group("triton_poi_fused_mul_silu_0", ["SwiGLUFunction"]) == "SwiGLU"
    assert _group("vectorized_layer_norm_kernel", []) == "norm (RMSNorm / LayerNorm)"
    assert _group("nvjet_sm90_tst_192x192", ["aten::mm"]) == "matmul (gemm)"
    assert w.shape == (4, 8)
