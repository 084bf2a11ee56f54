"""Property: the columnar fast path of validate_dataset accepts exactly what a naive line-by-line
reference (json made strict + rows.check_row) accepts, and names a genuinely bad line when both
reject. Chunked reading is exercised with small READ_CHUNK / ARROW_BLOCK sizes.

The inputs that broke the earlier pyarrow-based reader (an escaped-key null mask, a BOM on line 1,
`null` as the first line) are part of the mutation set, and so are the later hardening cases: Miles'
0.0/1.0 and false/true masks (valid), other mask values, lone surrogates, 5000-digit integers, deep
nesting, mse returns beyond 1e6 and lines of non-JSON whitespace (a form feed is not blank).
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import value_assets.core.dataset as dataset_mod
from tests.core.coretest_helpers import naive_stats, naive_validate, ref_for, rows_equal
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective

pytestmark = pytest.mark.unit

OBJECTIVES = [
    Objective(),
    Objective(loss_type="mse", num_bins=1),
    Objective(reward_range=(-1.0, 1.0), target_type="two_hot"),
]
RETURN_VALUES = [0.0, 1.0, 0.5, 0.25, -1.0, 2.0, 1]


@st.composite
def valid_row(draw, i):
    t = draw(st.integers(2, 6))
    rl = draw(st.integers(1, t - 1))
    tokens = draw(st.lists(st.integers(0, 50), min_size=t, max_size=t))
    lab = draw(st.sampled_from([0.0, 1.0, 0.5]))
    returns = (
        [lab] * rl
        if draw(st.booleans())
        else draw(st.lists(st.sampled_from([0.0, 1.0, 0.25]), min_size=rl, max_size=rl))
    )
    r = {"sample_id": f"id{i}", "tokens": tokens, "response_length": rl, "returns": returns}
    if draw(st.booleans()):
        m = draw(st.lists(st.integers(0, 1), min_size=rl, max_size=rl))
        m[draw(st.integers(0, rl - 1))] = 1
        r["loss_mask"] = m
    if draw(st.integers(0, 5)) == 0:
        r["meta"] = {"k": [1, "a:b"], "z": None}
    return r


def enc(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _set(key, value):
    def f(r, other):
        r = dict(r)
        r[key] = value(r) if callable(value) else value
        return enc(r)

    return f


def _del(key):
    def f(r, other):
        r = dict(r)
        r.pop(key, None)
        return enc(r)

    return f


def _text(fn):
    return lambda r, other: fn(enc(r), other)


def _insert(fragment: bytes):
    """Insert a raw fragment right after the opening brace."""
    return _text(lambda b, o: b"{" + fragment + b"," + b[1:])


MUTATIONS = {
    "sid_empty": _set("sample_id", ""),
    "sid_int": _set("sample_id", 7),
    "sid_null": _set("sample_id", None),
    "sid_dup": lambda r, o: enc({**r, "sample_id": o["sample_id"]}),
    "sid_space": lambda r, o: enc({**r, "sample_id": o["sample_id"] + " "}),  # valid: distinct id
    "del_sid": _del("sample_id"),
    "del_tokens": _del("tokens"),
    "del_rl": _del("response_length"),
    "del_returns": _del("returns"),
    "del_mask": _del("loss_mask"),  # valid
    "tokens_short": _set("tokens", lambda r: r["tokens"][:1]),
    "tokens_neg": _set("tokens", lambda r: [-1] + r["tokens"][1:]),
    "tokens_float": _set("tokens", lambda r: [float(r["tokens"][0])] + r["tokens"][1:]),
    "tokens_bool": _set("tokens", lambda r: [True] + r["tokens"][1:]),
    "tokens_str": _set("tokens", lambda r: ["1"] + r["tokens"][1:]),
    "tokens_huge": _set("tokens", lambda r: [2**63] + r["tokens"][1:]),
    "tokens_nested": _set("tokens", lambda r: [[1]] + r["tokens"][1:]),
    "rl_zero": _set("response_length", 0),
    "rl_too_big": _set("response_length", lambda r: len(r["tokens"])),
    "rl_float": _set("response_length", lambda r: float(r["response_length"])),
    "rl_bool": _set("response_length", True),
    "rl_str": _set("response_length", lambda r: str(r["response_length"])),
    "ret_short": _set("returns", lambda r: r["returns"][:-1]),
    "ret_long": _set("returns", lambda r: r["returns"] + [0.0]),
    "ret_out": _set("returns", lambda r: [1.5] + r["returns"][1:]),
    "ret_neg": _set("returns", lambda r: [-0.5] + r["returns"][1:]),
    "ret_bool": _set("returns", lambda r: [True] + r["returns"][1:]),
    "ret_str": _set("returns", lambda r: ["0"] + r["returns"][1:]),
    "ret_null": _set("returns", lambda r: [None] + r["returns"][1:]),
    "ret_big": _set("returns", lambda r: [1e300] + r["returns"][1:]),
    "ret_mse_limit": _set("returns", lambda r: [-1e6] + r["returns"][1:]),  # mse: valid
    "ret_mse_over": _set("returns", lambda r: [1000000.5] + r["returns"][1:]),
    "ret_int400": _text(lambda b, o: b.replace(b'"returns":[', b'"returns":[' + b"9" * 400 + b",", 1)),
    "mask_null": _set("loss_mask", None),
    "mask_short": _set("loss_mask", lambda r: [1] * (r["response_length"] - 1)),
    "mask_long": _set("loss_mask", lambda r: [1] * (r["response_length"] + 1)),
    "mask_two": _set("loss_mask", lambda r: [2] + [1] * (r["response_length"] - 1)),
    "mask_bool": _set("loss_mask", lambda r: [True] * r["response_length"]),  # valid (Miles)
    "mask_float": _set("loss_mask", lambda r: [1.0] * r["response_length"]),  # valid (Miles)
    "mask_mixed": _set(
        "loss_mask", lambda r: ([0.0, False, True] * r["response_length"])[: r["response_length"] - 1] + [1]
    ),
    "mask_bool_zero": _set("loss_mask", lambda r: [False] * r["response_length"]),
    "mask_half": _set("loss_mask", lambda r: [0.5] + [1] * (r["response_length"] - 1)),
    "mask_two_float": _set("loss_mask", lambda r: [1.0] * (r["response_length"] - 1) + [2.0]),
    "mask_str_elem": _set("loss_mask", lambda r: ["1"] * r["response_length"]),
    "mask_null_elem": _set("loss_mask", lambda r: [1] * (r["response_length"] - 1) + [None]),
    "mask_true_half": _set("loss_mask", lambda r: [True] * (r["response_length"] - 1) + [0.5]),
    "mask_zero": _set("loss_mask", lambda r: [0] * r["response_length"]),
    "mask_str": _set("loss_mask", "1"),
    "masked_out_of_range": lambda r, o: enc(
        {
            **r,
            "loss_mask": [0] + [1] * (r["response_length"] - 1) if r["response_length"] > 1 else [1],
            "returns": [3.0] + r["returns"][1:],
        }
    ),
    "extra_ok": _set("extra", {"a": [1, 2], "b": "x:y"}),
    "dup_known": _insert(b'"sample_id":"shadow"'),
    "dup_returns": _text(lambda b, o: b[:-1] + b',"returns":[0.0]}'),
    "dup_extra": _insert(b'"x":1,"x":2'),
    "dup_nested": _insert(b'"x":{"a":{"b":1,"b":2}}'),
    "nan_extra": _insert(b'"x":NaN'),
    "inf_extra": _insert(b'"x":[Infinity]'),
    "ninf_extra": _insert(b'"x":-Infinity'),
    "big_extra": _insert(b'"x":1e999'),
    "nan_returns": _text(lambda b, o: b.replace(b'"returns":[', b'"returns":[NaN,', 1)),
    "big_returns": _text(lambda b, o: b.replace(b'"returns":[', b'"returns":[1e999,', 1)),
    "utf8_sid": _text(lambda b, o: b.replace(b'"sample_id":"', b'"sample_id":"\xff', 1)),
    "utf8_extra": _insert(b'"x":"\xe2\x82"'),
    "utf8_ok": _insert(b'"x":"\xc3\xa9\xe2\x82\xac"'),  # valid
    "two_objects": _text(lambda b, o: b + enc(o)),
    "array_line": lambda r, o: enc([r]),
    "null_line": lambda r, o: b"null",
    "truncated": _text(lambda b, o: b[: len(b) // 2]),
    "trailing_garbage": _text(lambda b, o: b + b" x"),
    "trailing_space": _text(lambda b, o: b + b"  "),  # valid
    "leading_space": _text(lambda b, o: b"  " + b),  # valid
    "cr_end": _text(lambda b, o: b + b"\r"),  # valid
    "escaped_null_mask": _text(lambda b, o: b[:-1] + b',"loss\\u005fmask":null}' if b'"loss_mask"' not in b else b),
    "bom": _text(lambda b, o: b"\xef\xbb\xbf" + b),
    "control_char": _text(lambda b, o: b.replace(b'"sample_id":"', b'"sample_id":"\x01', 1)),
    "sid_surrogate": _text(lambda b, o: b.replace(b'"sample_id":"', b'"sample_id":"\\ud800', 1)),
    "sid_surrogate_pair": _text(lambda b, o: b.replace(b'"sample_id":"', b'"sample_id":"\\ud83d\\ude00', 1)),  # valid
    "extra_surrogate": _insert(b'"x":"\\udc00"'),
    "int5000_extra": _insert(b'"x":' + b"7" * 5000),
    "int5000_token": _text(lambda b, o: b.replace(b'"tokens":[', b'"tokens":[' + b"7" * 5000 + b",", 1)),
    "deep_extra": _insert(b'"x":' + b"[" * 3000 + b"]" * 3000),
}
LINE_MUTATIONS = {
    "blank_before": b"",
    "ws_before": b" \t ",
    "ff_before": b"\x0c",
    "vt_before": b" \x0b",
    "nbsp_before": b"\xc2\xa0",
}


@st.composite
def corrupted_file(draw):
    n = draw(st.integers(1, 7))
    rows = [draw(valid_row(i)) for i in range(n)]
    lines = [enc(r) for r in rows]
    muts = draw(
        st.lists(
            st.tuples(
                st.sampled_from(sorted(MUTATIONS) + sorted(LINE_MUTATIONS)),
                st.integers(0, n - 1),
                st.integers(0, n - 1),
            ),
            min_size=1,
            max_size=3,
        )
    )
    inserts = []
    for name, k, other in muts:
        if name in LINE_MUTATIONS:
            inserts.append((k, LINE_MUTATIONS[name]))
        else:
            lines[k] = MUTATIONS[name](rows[k], rows[other])
    for k, text in sorted(inserts, reverse=True):
        lines.insert(k, text)
    trailing = draw(st.booleans())
    delta = draw(st.sampled_from([0, 0, 0, 1, -1]))
    return lines, trailing, delta, [m[0] for m in muts]


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(case=corrupted_file(), objective=st.sampled_from(OBJECTIVES), chunk=st.sampled_from([None, 64, 97]))
def test_fast_path_agrees_with_naive_reference(tmp_path_factory, monkeypatch, case, objective, chunk):
    lines, trailing, delta, muts = case
    path = tmp_path_factory.mktemp("eq") / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if trailing else b""))
    nonblank = sum(1 for line in lines if line.strip(b" \t\r"))
    num_samples = max(1, nonblank + delta)
    ref = naive_validate(path, objective, num_samples)
    with monkeypatch.context() as m:
        if chunk:
            m.setattr(dataset_mod, "READ_CHUNK", chunk)
            m.setattr(dataset_mod, "BATCH_BYTES", chunk * 2)
        try:
            ds = dataset_mod.validate_dataset(ref_for(path, num_samples), objective)
            err = None
        except InputError as exc:
            err = exc
    if ref["ok"]:
        assert err is None, f"fast path refused a valid file ({muts}): {err}"
        expected = [r for _, r in ref["rows"]]
        assert len(ds) == len(expected)
        for i, r in enumerate(expected):
            assert rows_equal(ds.row(i), r)
            assert ds.location(i) == f"{path}:{ref['rows'][i][0]}"
        ns = naive_stats(expected)
        assert (ds.stats.rows, ds.stats.tokens, ds.stats.active_targets, ds.stats.label_counts) == (
            ns["rows"],
            ns["tokens"],
            ns["active_targets"],
            ns["label_counts"],
        )
        return
    assert err is not None, (
        f"fast path accepted an invalid file ({muts}); naive bad lines {ref['bad_lines']}, count ok {ref['count_ok']}"
    )
    if err.where == str(path):
        # A file-level verdict (row count) is only right when every row is fine.
        assert not ref["bad_lines"] and not ref["count_ok"], f"{err} ({muts})"
    else:
        line = int(err.where.rsplit(":", 1)[1])
        assert line in ref["bad_lines"], (
            f"reported line {line} is not bad ({muts}): {err}; bad lines {ref['bad_lines']}"
        )
