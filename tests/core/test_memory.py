"""The memory settings and the memory model (value_assets.core.memory): validation, the model's
shape (monotonic, recompute and the distributed optimizer reduce what they should) and its
calibration against the H200 measurements."""

from __future__ import annotations

import pytest

from value_assets.core.errors import InputError
from value_assets.core.memory import (
    GIB, MEASURED, QWEN2_5, Layout, MemoryConfig, ModelShape, activation_bytes, auto_micro_batch_tokens,
    max_tokens, predict_peak, static_bytes,
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


def test_tensor_and_pipeline_parallel_split_the_model():
    m = MemoryConfig()
    one = static_bytes(S15, Layout(), m)
    assert static_bytes(S15, Layout(tp=2), m) < 0.51 * one
    assert static_bytes(S15, Layout(pp=2), m) < 0.6 * one  # the first stage also holds the embedding
    sp = activation_bytes(S15, Layout(tp=2), MemoryConfig(sequence_parallel=True), 8192)
    assert sp < activation_bytes(S15, Layout(tp=2), m, 8192) < activation_bytes(S15, Layout(), m, 8192)


@pytest.mark.parametrize("point", MEASURED, ids=lambda p: f"{p['model']}-{p['mode']}")
def test_measured_h200_peaks_within_15_percent(point):
    pred = predict_peak(QWEN2_5[point["model"]], Layout(), MemoryConfig(), point["micro_batch_tokens"],
                        train=point["mode"] == "train") / GIB
    assert pred == pytest.approx(point["peak_gib"], rel=0.15)


def test_auto_picks_the_largest_fitting_micro_batch():
    lay, m = Layout(), MemoryConfig()
    free = 139 * GIB
    t = auto_micro_batch_tokens(S15, lay, m, free_bytes=free, longest_row=4095)
    assert t % 256 == 0 and t >= 4095
    assert predict_peak(S15, lay, m, t) <= 0.9 * free < predict_peak(S15, lay, m, t + 256)


def test_auto_refuses_a_row_that_cannot_fit_and_says_what_would():
    with pytest.raises(InputError) as e:
        auto_micro_batch_tokens(S15, Layout(dp=2), MemoryConfig(), free_bytes=40 * GIB, longest_row=32768,
                                longest_row_where="row 7 of train.parquet")
    msg = str(e.value)
    assert msg.startswith("micro_batch_tokens") and "row 7 of train.parquet" in msg and "32768" in msg
    assert "--recompute full" in msg and "GiB free" in msg
    with pytest.raises(InputError, match="GiB free"):  # weights and optimizer alone do not fit
        auto_micro_batch_tokens(QWEN2_5["14b"], Layout(), MemoryConfig(), free_bytes=80 * GIB, longest_row=10)


def test_model_shape_of_a_backbone_like_object():
    class B:
        num_layers, hidden_size, ffn_hidden_size = 2, 64, 128
        num_attention_heads, num_query_groups, vocab_size, head_dim = 4, 2, 100, 16

    s = ModelShape.of(B(), head_size=3)
    assert (s.q, s.kv, s.head_size) == (64, 32, 3)
