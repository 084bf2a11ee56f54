"""docs/rules.md#dataset: dataset rules for JSONL and Parquet, located errors, random access and statistics."""

import json

import numpy as np
import pytest

from tests.core.coretest_helpers import (
    dumps,
    naive_stats,
    ref_for,
    row,
    rows_equal,
    write_jsonl,
    write_lines,
    write_parquet,
)
from value_assets.core.dataset import validate_dataset
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective
from value_assets.core.rows import check_row

pytestmark = pytest.mark.unit

CLS = Objective()
MSE = Objective(loss_type="mse", num_bins=1)
GOOD = [dumps(row(f"g{i}")) for i in range(3)]


def reject(path, n, *needles, objective=CLS, sha=None, **kw):
    with pytest.raises(InputError) as ei:
        validate_dataset(ref_for(path, n, sha=sha), objective, **kw)
    msg = str(ei.value)
    for nd in needles:
        assert nd in msg, f"{nd!r} not in {msg!r}"
    return ei.value


def accept(path, n, objective=CLS, **kw):
    return validate_dataset(ref_for(path, n), objective, **kw)


def raw_row(**fields):
    """A row line with exact JSON text per field (to write literals Python's json cannot)."""
    base = {"sample_id": '"x"', "tokens": "[5,6,7,8]", "response_length": "2", "returns": "[1.0,1.0]"}
    base.update(fields)
    return ("{" + ",".join(f'"{k}":{v}' for k, v in base.items() if v is not None) + "}").encode(
        "latin-1"
    )  # "\xff" -> byte 0xff


# --- JSONL: each rule, located at path:line with the offending value --------------------------------

BAD_LINES = [
    # (line bytes, needles)
    (raw_row(sample_id='""'), ["sample_id", "''"]),
    (raw_row(sample_id="7"), ["sample_id", "7"]),
    (raw_row(sample_id="null"), ["sample_id", "None"]),
    (raw_row(sample_id=None), ["sample_id"]),
    (raw_row(tokens="[5]", response_length="1", returns="[1.0]"), ["tokens", "1"]),
    (raw_row(tokens="[]"), ["tokens", "0"]),
    (raw_row(tokens="[5,-1,7,8]"), ["tokens[1]", "-1"]),
    (raw_row(tokens="[5,6.0,7,8]"), ["tokens[1]", "6.0"]),
    (raw_row(tokens="[5,6e0,7,8]"), ["tokens[1]", "6.0"]),
    (raw_row(tokens="[5,true,7,8]"), ["tokens[1]", "True"]),
    (raw_row(tokens='[5,"6",7,8]'), ["tokens[1]", "'6'"]),
    (raw_row(tokens="[5,9223372036854775808,7,8]"), ["tokens[1]", "9223372036854775808"]),
    (raw_row(tokens='"5678"'), ["tokens", "'5678'"]),
    (raw_row(tokens=None), ["tokens"]),
    (raw_row(response_length="0", returns="[]"), ["response_length", "0"]),
    (raw_row(response_length="-1", returns="[]"), ["response_length", "-1"]),
    (raw_row(response_length="4", returns="[1,1,1,1]"), ["response_length = 4", "len(tokens) = 4"]),
    (raw_row(response_length="2.0"), ["response_length", "2.0"]),
    (raw_row(response_length="true", returns="[1.0]"), ["response_length", "True"]),
    (raw_row(response_length=None), ["response_length"]),
    (raw_row(returns="[1.0]"), ["returns", "1 values", "2"]),
    (raw_row(returns="[1.0,1.0,1.0]"), ["returns", "3 values"]),
    (raw_row(returns="[1.0,1.5]"), ["returns[1]", "1.5"]),
    (raw_row(returns="[-0.25,1.0]"), ["returns[0]", "-0.25"]),
    (raw_row(returns="[true,1.0]"), ["returns[0]", "True"]),
    (raw_row(returns='["1",1.0]'), ["returns[0]", "'1'"]),
    (raw_row(returns="[null,1.0]"), ["returns[0]", "None"]),
    (raw_row(returns="[1e999,1.0]"), ["1e999"]),
    (raw_row(returns="[NaN,1.0]"), ["NaN"]),
    (raw_row(returns="[Infinity,1.0]"), ["Infinity"]),
    (raw_row(returns="[-Infinity,1.0]"), ["-Infinity"]),
    (raw_row(returns=None), ["returns"]),
    (raw_row(loss_mask="null"), ["loss_mask", "None"]),
    (raw_row(loss_mask="[1]"), ["loss_mask", "1 values"]),
    (raw_row(loss_mask="[1,1,1]"), ["loss_mask", "3 values"]),
    (raw_row(loss_mask="[1,2]"), ["loss_mask[1]", "2"]),
    (raw_row(loss_mask="[1,-1]"), ["loss_mask[1]", "-1"]),
    (raw_row(loss_mask="[0.5,1]"), ["loss_mask[0]", "0.5"]),
    (raw_row(loss_mask="[1,2.0]"), ["loss_mask[1]", "2.0"]),
    (raw_row(loss_mask='[1,"1"]'), ["loss_mask[1]", "'1'"]),
    (raw_row(loss_mask="[1,null]"), ["loss_mask[1]", "None"]),
    (raw_row(loss_mask="[false,false]"), ["loss_mask", "no 1"]),
    (raw_row(loss_mask="[0.0,-0.0]"), ["loss_mask", "no 1"]),
    (raw_row(loss_mask="[0,0]"), ["loss_mask", "no 1"]),
    (raw_row(loss_mask='"11"'), ["loss_mask", "'11'"]),
    (raw_row(loss_mask="[1,0]", returns="[1.0,7.0]"), ["returns[1]", "7.0"]),  # masked, still range-checked
    (raw_row(sample_id='"a","sample_id":"b"'), ["duplicate key 'sample_id'"]),
    (raw_row(returns='[1.0,1.0],"returns":[0.0,0.0]'), ["duplicate key 'returns'"]),
    (raw_row(extra='1,"extra":2'), ["duplicate key 'extra'"]),
    (raw_row(extra='{"a":{"b":1,"b":2}}'), ["duplicate key 'b'"]),
    (raw_row(extra="NaN"), ["NaN"]),
    (raw_row(extra="[1,-Infinity]"), ["-Infinity"]),
    (raw_row(extra="1e999"), ["1e999"]),
    (raw_row(extra='{"deep":[1e400]}'), ["1e400"]),
    (raw_row() + raw_row(sample_id='"y"'), ["Extra data"]),
    (b"[1,2,3]", ["row must be a JSON object", "[1, 2, 3]"]),
    (b"null", ["row must be a JSON object", "None"]),
    (b'"row"', ["row must be a JSON object", "'row'"]),
    (b"{}", ["sample_id"]),
    (raw_row()[:-5], ["invalid JSON"]),
    (raw_row() + b" garbage", ["invalid JSON"]),
    (raw_row(sample_id='"\xff"'), ["UTF-8"]),
    (raw_row(extra='"\xe2\x82"'), ["UTF-8"]),
    (raw_row(extra='"\xed\xa0\x80"'), ["UTF-8"]),  # an encoded surrogate is not UTF-8
    (raw_row(sample_id='"a\tb"'), ["invalid JSON"]),  # raw control character in a string
]


@pytest.mark.parametrize("line, needles", BAD_LINES, ids=[str(i) for i in range(len(BAD_LINES))])
def test_jsonl_bad_row_located(tmp_path, line, needles):
    # good line, blank line, whitespace line, good line, bad line (line 5), good line
    p = write_lines(tmp_path / "d.jsonl", [GOOD[0], b"", b"  \t", GOOD[1], line, GOOD[2]])
    err = reject(p, 4, *needles)
    assert err.where == f"{p}:5", err.where


@pytest.mark.parametrize("line, needles", BAD_LINES[:12], ids=[str(i) for i in range(12)])
def test_jsonl_bad_row_first_line_no_trailing_newline(tmp_path, line, needles):
    p = write_lines(tmp_path / "d.jsonl", [line, GOOD[0]], trailing_newline=False)
    assert reject(p, 2, *needles).where == f"{p}:1"


def test_mse_allows_out_of_range_but_not_non_finite(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [raw_row(returns="[-3.5,12.0]")])
    ds = accept(p, 1, objective=MSE)
    np.testing.assert_array_equal(ds.row(0).returns, [-3.5, 12.0])
    reject(p, 1, "returns[0]", "-3.5", objective=CLS)
    p2 = write_lines(tmp_path / "e.jsonl", [raw_row(returns="[1.0,1e999]")])
    reject(p2, 1, "1e999", objective=MSE)


def test_reward_range_inclusive_and_custom(tmp_path):
    obj = Objective(reward_range=(-1.0, 2.0))
    p = write_jsonl(tmp_path / "d.jsonl", [row("a", returns=[-1.0, 2.0]), row("b", returns=[0, 1])])
    assert len(accept(p, 2, objective=obj)) == 2
    p2 = write_jsonl(tmp_path / "e.jsonl", [row("a", returns=[-1.0, 2.0000001])])
    reject(p2, 1, "returns[1]", "2.0000001", objective=obj)


def test_vocab_and_max_len(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [row("a", tokens=[1, 2, 99]), row("b", tokens=[1, 2, 3, 4, 5])])
    assert len(accept(p, 2)) == 2
    assert len(accept(p, 2, vocab_size=100, max_seq_len=5)) == 2
    e = reject(p, 2, "tokens[2] = 99", "vocabulary size 99", vocab_size=99)
    assert e.where == f"{p}:1"
    e = reject(p, 2, "len(tokens) = 5", "4", max_seq_len=4)
    assert e.where == f"{p}:2"


def test_extra_keys_ignored(tmp_path):
    lines = [
        raw_row(sample_id='"a"', meta='{"x":[1,2,{"y":null}],"s":"a:b"}', note='"loss_mask"'),
        raw_row(sample_id='"b"', extra="1.5"),
    ]
    ds = accept(write_lines(tmp_path / "d.jsonl", lines), 2)
    assert [ds.row(i).sample_id for i in range(2)] == ["a", "b"]


def test_blank_lines_skipped_and_not_counted_but_numbered(tmp_path):
    lines = [b"", GOOD[0], b"   ", b"\t", GOOD[1], b"\r", b"", GOOD[2], b""]
    p = write_lines(tmp_path / "d.jsonl", lines)
    ds = accept(p, 3)
    assert [ds.location(i) for i in range(3)] == [f"{p}:2", f"{p}:5", f"{p}:8"]
    reject(p, 4, "3 rows", "num_samples = 4")


def test_crlf_line_endings_accepted(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\r\n".join(GOOD) + b"\r\n")
    assert len(accept(p, 3)) == 3


def test_duplicate_sample_id_exact_comparison(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [row("a"), row("a "), row("A"), row("\u00e9"), row("e\u0301")])
    assert len(accept(p, 5)) == 5
    p2 = write_lines(tmp_path / "e.jsonl", [dumps(row("a")), b"", dumps(row("b")), dumps(row("a"))])
    e = reject(p2, 3, "duplicate sample_id", "'a'", f"{p2}:1")
    assert e.where == f"{p2}:4"


def test_num_samples_mismatch(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [row("a"), row("b")])
    e = reject(p, 3, "2 rows", "num_samples = 3")
    assert e.where == str(p)
    reject(p, 1, "2 rows", "num_samples = 1")


def test_empty_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"")
    reject(p, 1, "0 rows")


def test_missing_file_and_directory(tmp_path):
    reject(tmp_path / "nope.jsonl", 1, "nope.jsonl", "does not exist", sha="a" * 64)
    reject(tmp_path, 1, "not a regular file", sha="a" * 64)


def test_sha_checked_before_rows(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [GOOD[0], raw_row(returns="[NaN,1]"), b"\xff\xff"])
    e = reject(p, 2, "sha256", "a" * 64, sha="a" * 64)
    assert "NaN" not in str(e) and "UTF-8" not in str(e)
    assert e.where == str(p)


def test_sha_checked_before_rows_parquet(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [row("a", returns=[5.0, 5.0])])
    e = reject(p, 1, "sha256", "b" * 64, sha="b" * 64)
    assert "returns" not in str(e)


# --- random access and statistics ----------------------------------------------------------------


def _mixed_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(2, 12))
        rl = int(rng.integers(1, t))
        lab = float(rng.choice([0.0, 1.0, 0.5]))
        rets = [lab] * rl if rng.random() < 0.7 else [float(v) for v in rng.choice([0.0, 0.25, 1.0], rl)]
        r = row(f"s{i}", tokens=rng.integers(0, 1000, t).tolist(), rl=rl, returns=rets)
        if rng.random() < 0.5:
            m = rng.integers(0, 2, rl).tolist()
            m[int(rng.integers(0, rl))] = 1
            r["loss_mask"] = m
        out.append(r)
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_random_access_and_stats_against_naive(tmp_path, fmt):
    rows = _mixed_rows(200)
    p = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        write_jsonl(p, rows)
    else:
        for r in rows:
            r.setdefault("loss_mask", [1] * r["response_length"])
        write_parquet(p, rows)
    ds = accept(p, 200)
    assert ds.format == fmt
    expected = [check_row(json.loads(json.dumps(r)), "x", CLS) for r in rows]
    for i in [0, 199, 57, 3, 57, 120]:
        assert rows_equal(ds.row(i), expected[i])
    s = ds.stats
    ns = naive_stats(expected)
    assert (s.rows, s.tokens, s.active_targets, s.label_counts) == (
        ns["rows"],
        ns["tokens"],
        ns["active_targets"],
        ns["label_counts"],
    )
    assert s.max_tokens == max(len(r["tokens"]) for r in rows)
    assert s.min_tokens == min(len(r["tokens"]) for r in rows)
    np.testing.assert_array_equal(ds.lengths, [len(r["tokens"]) for r in rows])
    np.testing.assert_array_equal(ds.active_targets, [e.active_targets for e in expected])
    labels = [e.label for e in expected]
    np.testing.assert_array_equal(np.isnan(ds.labels), [lab is None for lab in labels])
    with pytest.raises(IndexError):
        ds.row(200)
    with pytest.raises(IndexError):
        ds.row(-1)


def test_absent_mask_means_all_ones(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl", [row("a", rl=3, returns=[0, 0, 0]), row("b", rl=3, returns=[1, 0, 1], mask=[1, 0, 1])]
    )
    ds = accept(p, 2)
    np.testing.assert_array_equal(ds.row(0).loss_mask, [1, 1, 1])
    assert ds.stats.active_targets == 5
    assert ds.stats.label_counts == {"0.0": 1, "1.0": 1}  # row b's active returns are all 1


# --- Parquet ------------------------------------------------------------------------------------

PARQUET_BAD = [
    (dict(sample_id=""), ["sample_id", "''"]),
    (dict(sample_id=None), ["sample_id", "None"]),
    (dict(tokens=[5], response_length=1, returns=[1.0], loss_mask=[1]), ["tokens", "1"]),
    (dict(tokens=[5, -2, 7, 8]), ["tokens[1]", "-2"]),
    (dict(tokens=None), ["tokens"]),
    (dict(response_length=0, returns=[], loss_mask=[]), ["response_length", "0"]),
    (dict(response_length=4, returns=[1.0] * 4, loss_mask=[1] * 4), ["response_length = 4"]),
    (dict(returns=[1.0]), ["returns", "1 values"]),
    (dict(returns=[1.0, 1.5]), ["returns[1]", "1.5"]),
    (dict(returns=[float("nan"), 1.0]), ["returns[0]", "nan"]),
    (dict(returns=[float("inf"), 1.0]), ["returns[0]", "inf"]),
    (dict(returns=[None, 1.0]), ["returns[0]", "None"]),
    (dict(loss_mask=None), ["loss_mask", "None"]),
    (dict(loss_mask=[1]), ["loss_mask", "1 values"]),
    (dict(loss_mask=[1, 2]), ["loss_mask[1]", "2"]),
    (dict(loss_mask=[0, 0]), ["loss_mask", "no 1"]),
    (dict(loss_mask=[1, 0], returns=[1.0, -4.0]), ["returns[1]", "-4.0"]),
]


@pytest.mark.parametrize("change, needles", PARQUET_BAD, ids=[str(i) for i in range(len(PARQUET_BAD))])
def test_parquet_bad_row_located(tmp_path, change, needles):
    rows = [row(f"g{i}", mask=[1, 1]) for i in range(4)]
    rows[2].update(change)
    p = write_parquet(tmp_path / "d.parquet", rows, with_mask=True)
    e = reject(p, 4, *needles)
    assert e.where == f"{p}:row 2", e.where


def test_parquet_mask_column_absent_means_all_ones(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [row("a"), row("b", returns=[0.0, 0.0])], with_mask=False)
    ds = accept(p, 2)
    np.testing.assert_array_equal(ds.row(1).loss_mask, [1, 1])
    assert ds.stats.active_targets == 4 and ds.stats.label_counts == {"0.0": 1, "1.0": 1}


def test_parquet_duplicate_ids_vocab_count(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [row("a"), row("b"), row("a")], with_mask=False)
    e = reject(p, 3, "duplicate sample_id", "'a'")
    assert e.where == f"{p}:row 2"
    p2 = write_parquet(tmp_path / "e.parquet", [row("a"), row("b", tokens=[1, 2, 3, 500])], with_mask=False)
    assert reject(p2, 2, "500", vocab_size=500).where == f"{p2}:row 1"
    assert reject(p2, 2, "len(tokens) = 4", max_seq_len=3).where == f"{p2}:row 0"
    reject(p2, 3, "2 rows", "num_samples = 3")
    p3 = write_parquet(tmp_path / "f.parquet", [row("a"), row("a ")], with_mask=False)
    assert len(accept(p3, 2)) == 2


def test_parquet_float_tokens_column_refused(tmp_path):
    import pyarrow as pa

    schema = pa.schema(
        [
            ("sample_id", pa.string()),
            ("tokens", pa.list_(pa.float64())),
            ("response_length", pa.int64()),
            ("returns", pa.list_(pa.float64())),
        ]
    )
    rows = [{"sample_id": "a", "tokens": [1.0, 2.0, 3.0], "response_length": 1, "returns": [1.0]}]
    p = write_parquet(tmp_path / "d.parquet", rows, schema=schema)
    reject(p, 1, "tokens", "double")


def test_parquet_missing_column_refused(tmp_path):
    import pyarrow as pa

    schema = pa.schema([("sample_id", pa.string()), ("tokens", pa.list_(pa.int64())), ("response_length", pa.int64())])
    p = write_parquet(
        tmp_path / "d.parquet", [{"sample_id": "a", "tokens": [1, 2], "response_length": 1}], schema=schema
    )
    reject(p, 1, "returns")


def test_parquet_mse_out_of_range_allowed(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [row("a", returns=[-9.0, 9.0])], with_mask=False)
    assert accept(p, 1, objective=MSE).row(0).returns.tolist() == [-9.0, 9.0]


# --- fast path vs the exact reference: known divergences -----------------------------------------


def test_escaped_key_null_loss_mask_refused(tmp_path):
    line = b'{"sample_id":"x","tokens":[1,2,3],"response_length":2,"returns":[1.0,0.0],"loss\\u005fmask":null}'
    with pytest.raises(InputError):
        check_row(json.loads(line), "ref", CLS)  # the reference refuses it
    p = write_lines(tmp_path / "d.jsonl", [GOOD[0], line])
    e = reject(p, 2, "loss_mask", "None")
    assert e.where == f"{p}:2"


def test_bom_on_first_line_treated_like_any_line(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [b"\xef\xbb\xbf" + GOOD[0], GOOD[1]])
    try:
        ds = validate_dataset(ref_for(p, 2), CLS)
    except InputError as e:
        assert e.where == f"{p}:1"
        return
    ds.row(0)  # an accepted dataset must serve every row


def test_bom_on_second_line_refused(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [GOOD[0], b"\xef\xbb\xbf" + GOOD[1]])
    assert reject(p, 2, "invalid JSON").where == f"{p}:2"


_SEGV_SCRIPT = r"""
import sys
from pathlib import Path
from value_assets.core.dataset import validate_dataset
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.manifest import DatasetRef
from value_assets.core.objective import Objective
p = Path(sys.argv[1])
ref = DatasetRef(split="train", path=p, declared_path=str(p), sha256=sha256_file(p), num_samples=2)
try:
    validate_dataset(ref, Objective())
    print("ACCEPTED")
except InputError as e:
    print("WHERE", e.where)
"""


def test_null_first_line_is_an_input_error_not_a_crash(tmp_path):
    import os
    import subprocess
    import sys

    p = write_lines(tmp_path / "d.jsonl", [b"null", GOOD[0]])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(
        [sys.executable, "-c", _SEGV_SCRIPT, str(p)], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-300:]}"
    assert res.stdout.strip() == f"WHERE {p}:1"


def test_null_later_line_is_an_input_error(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [GOOD[0], b"null"])
    assert reject(p, 2, "row must be a JSON object", "None").where == f"{p}:2"
