"""The memory settings and the memory model (value_assets.core.memory): validation, the model's
shape (monotonic, recompute and the distributed optimizer reduce what they should) and its
calibration against the H200 measurements."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from value_assets.core.errors import InputError
from value_assets.core.memory import (
    GIB,
    MEASURED,
    QWEN2_5,
    Layout,
    MemoryConfig,
    activation_bytes,
    auto_micro_batch_tokens,
    host_bytes,
    max_tokens,
    more_recompute,
    predict_peak,
    static_bytes,
)

pytestmark = pytest.mark.unit

S15 = QWEN2_5["1.5b"]


def test_memory_config_refuses_unknown_values_naming_the_flag():
    with pytest.raises(InputError, match=r"recompute.*'partial'"):
        MemoryConfig(recompute="partial")
    with pytest.raises(InputError, match="distributed_optimizer"):
        MemoryConfig(distributed_optimizer="yes")
    with pytest.raises(InputError, match=r"sequence_parallel.*tensor_parallel 1"):
        MemoryConfig(sequence_parallel=True).check_layout(tensor_parallel=1)
    MemoryConfig(sequence_parallel=True).check_layout(tensor_parallel=2)
    with pytest.raises(TypeError):
        MemoryConfig("full")  # keyword-only
    m = MemoryConfig(recompute="full", distributed_optimizer=True)
    assert MemoryConfig.from_json(m.to_json()) == m


def test_recompute_layers_rules_name_the_field():
    for kw, needle in (
        (dict(recompute_layers=2), "needs recompute 'full', got recompute 'none'"),
        (dict(recompute="selective", recompute_layers=2), "got recompute 'selective'"),
        (dict(recompute="full", recompute_layers=0), "must be an integer >= 1"),
        (dict(recompute="full", recompute_layers=True), "must be an integer >= 1"),
    ):
        with pytest.raises(InputError) as err:
            MemoryConfig(**kw)
        assert err.value.where == "recompute_layers" and needle in err.value.message
    m = MemoryConfig(recompute="full", recompute_layers=14)
    m.check_layers(num_layers=28, pipeline_parallel=2)  # megatron counts layers per stage
    with pytest.raises(InputError, match=r"recompute_layers: .*at most 14 \(28 layers over 2 stage\(s\)\), got 15"):
        MemoryConfig(recompute="full", recompute_layers=15).check_layers(num_layers=28, pipeline_parallel=2)
    MemoryConfig(recompute="full").check_layers(num_layers=28, pipeline_parallel=28)
    assert MemoryConfig.from_json(m.to_json()) == m and m.to_json()["recompute_layers"] == 14
    # unset: the JSON (and so the contract's execution facts) is what it was before the setting
    assert MemoryConfig(recompute="full").to_json() == {
        "recompute": "full",
        "distributed_optimizer": False,
        "sequence_parallel": False,
    }
    assert MemoryConfig.from_json({"recompute": "full", "distributed_optimizer": False}).recompute_layers is None


@pytest.mark.parametrize("pp", [1, 2])
def test_partial_recompute_lies_between_none_and_full(pp):
    lay, t = Layout(pp=pp), 32768
    per_stage = S15.backbone.num_layers // pp
    act = {
        k: activation_bytes(S15, lay, MemoryConfig(recompute="full", recompute_layers=k), t)
        for k in range(1, per_stage + 1)
    }
    none = activation_bytes(S15, lay, MemoryConfig(), t)
    full = activation_bytes(S15, lay, MemoryConfig(recompute="full"), t)
    assert act[per_stage] == full  # every layer of the stage: plain full
    assert none > act[1] and all(act[k] > act[k + 1] > full for k in range(1, per_stage - 2))
    assert act[per_stage - 2] > act[per_stage - 1] > 0.95 * full  # all but one: plain full less one input
    # linear in K, from `none` at K = 0: each recomputed layer (pp in flight) keeps only its input
    assert 2 * act[1] - act[2] == pytest.approx(none, rel=1e-6)
    assert act[1] - act[2] == pytest.approx((none - full) / (S15.backbone.num_layers - 1) * pp, rel=0.05)
    # the predicted peak follows, and the auto micro-batch grows with K
    peaks = [predict_peak(S15, lay, MemoryConfig(recompute="full", recompute_layers=k), t) for k in (1, 2)]
    assert (
        predict_peak(S15, lay, MemoryConfig(), t)
        > peaks[0]
        > peaks[1]
        > predict_peak(S15, lay, MemoryConfig(recompute="full"), t)
    )
    sizes = [
        auto_micro_batch_tokens(S15, lay, m, free_bytes=80 * GIB, longest_row=1024)
        for m in (MemoryConfig(), MemoryConfig(recompute="full", recompute_layers=2), MemoryConfig(recompute="full"))
    ]
    assert sizes[0] < sizes[1] < sizes[2]


def test_more_recompute_is_ordered_cheapest_first():
    names = [(m.recompute, m.recompute_layers) for m in more_recompute(S15, Layout(pp=4), MemoryConfig())]
    assert names == [("selective", None)] + [("full", k) for k in range(1, 7)] + [("full", None)]
    assert [
        m.recompute_layers
        for m in more_recompute(S15, Layout(pp=4), MemoryConfig(recompute="full", recompute_layers=5))
    ] == [6, None]
    assert more_recompute(S15, Layout(), MemoryConfig(recompute="full")) == []


def test_hints_name_the_least_recompute_layers_that_fit_before_full():
    def hints(free_gib, memory=None):
        memory = memory or MemoryConfig()
        with pytest.raises(InputError) as err:
            auto_micro_batch_tokens(S15, Layout(), memory, free_bytes=free_gib * GIB, longest_row=32767)
        situation, hints = str(err.value).split("it would fit with: ")
        assert f"recompute {memory.recompute}" in situation
        return situation, hints.split("; or ")

    first = hints(60)[1][0]
    assert first.startswith("--recompute full --recompute-layers ")
    k = int(first.split()[-1])
    assert 1 < k < S15.backbone.num_layers - 1
    budget = int(60 * GIB * 0.9)
    assert max_tokens(S15, Layout(), MemoryConfig(recompute="full", recompute_layers=k), budget) >= 32767
    assert max_tokens(S15, Layout(), MemoryConfig(recompute="full", recompute_layers=k - 1), budget) < 32767
    assert hints(60)[1][1].startswith("--tensor-parallel 2")
    # already recomputing K layers: the message says so, and suggests more
    situation, more = hints(60, MemoryConfig(recompute="full", recompute_layers=3))
    assert "recompute full of 3 layers per stage" in situation and more[0] == first


def test_parameter_count_matches_the_qwen_shapes():
    # Qwen2.5 sizes with the LM head replaced by a 51-bin value head (embeddings untied).
    assert QWEN2_5["0.5b"].num_params() == pytest.approx(0.494e9, rel=0.01)
    assert S15.num_params() == pytest.approx(1.544e9, rel=0.01)
    assert QWEN2_5["7b"].num_params() == pytest.approx(7.07e9, rel=0.02)


def test_peak_grows_with_tokens_and_recompute_reduces_activations():
    lay, none = Layout(), MemoryConfig()
    peaks = [predict_peak(S15, lay, none, t) for t in (1024, 4096, 16384, 65536)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    act = {rc: activation_bytes(S15, lay, MemoryConfig(recompute=rc), 16384) for rc in ("none", "selective", "full")}
    assert act["full"] < act["selective"] < act["none"]
    assert act["full"] < act["none"] / 5  # one layer's input kept per layer
    assert max_tokens(S15, lay, MemoryConfig(recompute="full"), 80 * GIB) > 4 * max_tokens(S15, lay, none, 80 * GIB)


def test_distributed_optimizer_divides_optimizer_state_by_dp():
    plain, dist = MemoryConfig(), MemoryConfig(distributed_optimizer=True)
    p = S15.num_params()
    for dp in (1, 2, 8):
        lay = Layout(dp=dp)
        assert static_bytes(S15, lay, plain) == pytest.approx(18 * p, rel=1e-6)  # 2 + 4 + 12 bytes/param
        assert static_bytes(S15, lay, dist) == pytest.approx(6 * p + 12 * p / dp, rel=1e-6)
    assert static_bytes(S15, Layout(dp=1), dist) == static_bytes(S15, Layout(dp=1), plain)


def test_optimizer_offload_is_a_fraction_of_the_distributed_optimizer_named_in_its_errors():
    for bad in (-0.1, 1.5, True, "half", float("nan")):
        with pytest.raises(InputError) as err:
            MemoryConfig(distributed_optimizer=True, optimizer_offload=bad)
        assert err.value.where == "optimizer_offload" and "fraction from 0 to 1" in err.value.message
    with pytest.raises(InputError, match=r"optimizer_offload: 0.5 needs the distributed optimizer"):
        MemoryConfig(optimizer_offload=0.5)
    m = MemoryConfig(distributed_optimizer=True, optimizer_offload=1)
    assert m.to_json()["optimizer_offload"] == 1.0 and MemoryConfig.from_json(m.to_json()) == m
    # unset: older contracts' execution facts keep their bytes
    assert "optimizer_offload" not in MemoryConfig(distributed_optimizer=True).to_json()


def test_optimizer_offload_moves_its_fraction_of_the_optimizer_state_to_the_host():
    """Per parameter, bf16: weights 2 + fp32 grads 4 bytes stay on the GPU; of the fp32 master
    weight and two moments (12 bytes) the fraction f goes to the host, with an fp32 copy of the
    gradient (16 bytes per offloaded parameter)."""
    p = S15.num_params()
    for dp in (1, 2):
        for f in (0.0, 0.25, 1.0):
            m = MemoryConfig(distributed_optimizer=True, optimizer_offload=f)
            assert static_bytes(S15, Layout(dp=dp), m) == pytest.approx(6 * p + (1 - f) * 12 * p / dp, rel=1e-6)
            assert host_bytes(S15, Layout(dp=dp), m) == pytest.approx(f * 16 * p / dp, rel=1e-6)
            # pinned gradient copies: each rounded up to a power of two, at most doubled
            assert host_bytes(S15, Layout(dp=dp), m, pinned=True) == pytest.approx(f * 20 * p / dp, rel=1e-6)
    # a Qwen2.5-7B-shaped critic on an 80 GB GPU: weights, grads and optimizer alone overflow it
    # (18 bytes a parameter, ~119 GiB); offloaded, 4k rows fit
    s7 = QWEN2_5["7b"]
    plain = MemoryConfig(recompute="full", distributed_optimizer=True)
    off = MemoryConfig(recompute="full", distributed_optimizer=True, optimizer_offload=1.0)
    assert max_tokens(s7, Layout(), plain, 78 * GIB) == 0
    assert max_tokens(s7, Layout(), off, 78 * GIB) >= 4096
    assert host_bytes(s7, Layout(), off) < 112 * GIB  # within the device machine's 128 GiB of host memory
    # measured on an H100 at offload 0.75: master weights and moments 60.0 GiB + pinned gradients
    # 37.6 GiB (tensor by tensor, the first 76% of the parameters); the bound holds it
    at = replace(off, optimizer_offload=0.75)
    assert host_bytes(s7, Layout(), at) / GIB == pytest.approx(79.0, abs=0.05)
    assert 97.6 <= host_bytes(s7, Layout(), at, pinned=True) / GIB < 100


def test_auto_names_optimizer_offload_when_the_optimizer_does_not_fit():
    with pytest.raises(InputError) as e:
        auto_micro_batch_tokens(
            QWEN2_5["7b"], Layout(), MemoryConfig(recompute="full"), free_bytes=78 * GIB, longest_row=4095
        )
    assert re.search(r"--distributed-optimizer --optimizer-offload 1 \(105 to 132 GiB of host memory", str(e.value))
    t = auto_micro_batch_tokens(
        QWEN2_5["7b"],
        Layout(),
        MemoryConfig(recompute="full", distributed_optimizer=True, optimizer_offload=1.0),
        free_bytes=78 * GIB,
        longest_row=4095,
    )
    assert t >= 4095


def test_tensor_and_pipeline_parallel_split_the_model():
    m = MemoryConfig()
    one = static_bytes(S15, Layout(), m)
    assert static_bytes(S15, Layout(tp=2), m) < 0.51 * one
    assert static_bytes(S15, Layout(pp=2), m) < 0.6 * one  # the first stage also holds the embedding
    sp = activation_bytes(S15, Layout(tp=2), MemoryConfig(sequence_parallel=True), 8192)
    assert sp < activation_bytes(S15, Layout(tp=2), m, 8192) < activation_bytes(S15, Layout(), m, 8192)


@pytest.mark.parametrize("point", MEASURED, ids=lambda p: f"{p['model']}-{p['mode']}")
def test_measured_h200_peaks_within_15_percent(point):
    memory = MemoryConfig(recompute=point.get("recompute", "none"), recompute_layers=point.get("recompute_layers"))
    pred = (
        predict_peak(
            QWEN2_5[point["model"]], Layout(), memory, point["micro_batch_tokens"], train=point["mode"] == "train"
        )
        / GIB
    )
    assert pred == pytest.approx(point["peak_gib"], rel=0.15)
    if point["mode"] == "train":  # on the safe side for --micro-batch-tokens auto
        assert pred >= point["peak_gib"]


def test_auto_picks_the_largest_fitting_micro_batch():
    lay, m = Layout(), MemoryConfig()
    free = 139 * GIB
    t = auto_micro_batch_tokens(S15, lay, m, free_bytes=free, longest_row=4095)
    assert t % 256 == 0 and t >= 4095
    assert predict_peak(S15, lay, m, t) <= 0.9 * free < predict_peak(S15, lay, m, t + 256)


def test_auto_refuses_a_row_that_cannot_fit_and_says_what_would():
    with pytest.raises(InputError) as e:
        auto_micro_batch_tokens(
            S15,
            Layout(dp=2),
            MemoryConfig(),
            free_bytes=40 * GIB,
            longest_row=32768,
            longest_row_where="row 7 of train.parquet",
        )
    msg = str(e.value)
    assert msg.startswith("micro_batch_tokens") and "row 7 of train.parquet" in msg and "32768" in msg
    assert "--recompute full" in msg and "GiB free" in msg
    with pytest.raises(InputError, match="GiB free"):  # weights and optimizer alone do not fit
        auto_micro_batch_tokens(QWEN2_5["14b"], Layout(), MemoryConfig(), free_bytes=80 * GIB, longest_row=10)


def test_critic_shape_is_the_backbone_and_its_head():
    from value_assets.core.backbone import BackboneConfig, CriticShape

    b = BackboneConfig.tiny(hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=100)
    s = CriticShape(b, head_size=3)
    assert (b.q_size, b.kv_size, s.head_size) == (64, 32, 3)
    # embedding + layers + final norm + head (weights and bias): counted once, from the backbone
    assert s.num_params() == 100 * 64 + b.num_layers * b.layer_params() + 64 + 64 * 3 + 3


def test_hints_for_a_qwen3_5_critic_offer_only_flags_it_accepts():
    # Gated DeltaNet layers refuse sequence parallelism (gpt_critic.build_critic): a hint naming it
    # would send the user to an error (the 4B-shaped row on an H100, 2026-12-06, got one).
    from value_assets.core.backbone import qwen3_5
    from value_assets.core.memory import DEFAULT_HEAD_SIZE, CriticShape

    shape = CriticShape(qwen3_5("4b"), DEFAULT_HEAD_SIZE)
    with pytest.raises(InputError) as err:
        auto_micro_batch_tokens(shape, Layout(), MemoryConfig(), free_bytes=40 * GIB, longest_row=32767)
    hints = str(err.value).split("it would fit with: ")[1].split("; or ")
    assert "--sequence-parallel" not in str(err.value)
    tp_hints = [h for h in hints if h.startswith("--tensor-parallel")]
    assert tp_hints, hints
    tp = int(tp_hints[0].split()[1])
    assert shape.backbone.linear_attention.key_heads % tp == 0
    # the layout it names does fit by the same model
    assert max_tokens(shape, Layout(tp=tp), MemoryConfig(recompute="full"), int(40 * GIB * 0.9)) >= 32767
