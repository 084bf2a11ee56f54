"""Inputs that used to crash with a traceback, pass validation but break training, or cost memory
without bound; and the Miles-compatible leniencies (docs/rules.md#dataset item 7, docs/rules.md#hand-off). Each test
names the defect it holds fixed: a located InputError (exit 2 from the command line, nothing written)."""

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import value_assets.core.dataset as dataset_mod
from tests.core.coretest_helpers import dumps, ref_for, row, write_jsonl, write_lines, write_parquet
from value_assets.cli import main
from value_assets.core.dataset import validate_dataset
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.manifest import load_manifest
from value_assets.core.objective import Objective
from value_assets.core.rows import check_row

pytestmark = pytest.mark.unit

CLS = Objective()
MSE = Objective(loss_type="mse", num_bins=1)
GOOD = dumps(row("g"))
HUGE_INT = b"1" * 5000
DEEP = b"[" * 100_000


def refuse(fn, *needles, where=None):
    with pytest.raises(InputError) as ei:
        fn()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    if where is not None:
        assert ei.value.where == where, ei.value.where
    assert len(msg) < 1000, "a huge offending value must be truncated in the message"
    return ei.value


def manifest_bytes(train_path="t.jsonl", sha="a" * 64, n=1, objective=None, **extra) -> bytes:
    m = {
        "schema": "miles.value-pretrain.v1",
        "train": {"path": train_path, "sha256": sha, "num_samples": n},
        "objective": objective if objective is not None else {},
        **extra,
    }
    return json.dumps(m).encode()


def write_manifest_for(folder: Path, data: Path, n: int, objective=None, name="m.json") -> Path:
    p = folder / name
    p.write_bytes(manifest_bytes(os.path.relpath(data, folder), sha256_file(data), n, objective))
    return p


def snapshot(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


# ---- 1. crashes that must be located refusals -----------------------------------------------------


def test_nul_byte_in_dataset_path_is_a_located_error_not_a_valueerror(tmp_path):
    p = tmp_path / "m.json"
    p.write_bytes(manifest_bytes("data/a\u0000b.jsonl"))
    for roots in ([tmp_path], None):
        refuse(
            lambda roots=roots: load_manifest(p, data_roots=roots),
            "train.path",
            "NUL",
            "'data/a\\x00b.jsonl'",
            where=f"{p}: train.path",
        )


def test_nul_byte_in_data_root_or_manifest_path_is_an_input_error(tmp_path):
    p = tmp_path / "m.json"
    p.write_bytes(manifest_bytes("t.jsonl"))
    refuse(lambda: load_manifest(p, data_roots=["/da\x00ta"]), "not a valid file system path")
    refuse(lambda: load_manifest(str(tmp_path / "m\x00.json")), "not a valid file system path")


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"schema":"miles.value-pretrain.v1","x":' + HUGE_INT + b"}", "5000 digits"),
        (b'{"schema":"miles.value-pretrain.v1","x":-' + HUGE_INT + b"}", "5000 digits"),
        (b'{"schema":"miles.value-pretrain.v1","x":' + DEEP + b"}", "nested too deeply"),
        (b'{"schema":"miles.value-pretrain.v1","x":"\\ud800"}', "lone surrogate"),
    ],
)
def test_huge_integer_deep_nesting_and_lone_surrogate_in_manifest_are_located_errors(tmp_path, raw, needle):
    p = tmp_path / "m.json"
    p.write_bytes(raw)
    refuse(lambda: load_manifest(p), "invalid JSON", needle, where=str(p))


def _row_with(**fields) -> bytes:
    base = {"sample_id": '"x"', "tokens": "[5,6,7]", "response_length": "2", "returns": "[1.0,0.0]"}
    base.update(fields)
    return ("{" + ",".join(f'"{k}":{v}' for k, v in base.items()) + "}").encode()


CRASHING_ROWS = [
    (_row_with(extra=HUGE_INT.decode()), ["5000 digits"]),
    (_row_with(tokens="[5," + HUGE_INT.decode() + ",7]"), ["5000 digits"]),
    (_row_with(extra=DEEP.decode()), ["nested too deeply"]),
    (_row_with(returns="[" + "1" * 400 + ",1.0]"), ["returns[0]", "finite"]),  # int beyond float range
    (_row_with(sample_id='"\\ud800"'), ["lone surrogate"]),
    (_row_with(sample_id='"a\\udfff"'), ["lone surrogate"]),
]


@pytest.mark.parametrize(
    "line, needles",
    CRASHING_ROWS,
    ids=["int5000-extra", "int5000-token", "deep", "int400-return", "surrogate", "low-surrogate"],
)
def test_rows_that_crashed_validation_are_located_errors(tmp_path, line, needles):
    p = write_lines(tmp_path / "d.jsonl", [GOOD, line])
    refuse(lambda: validate_dataset(ref_for(p, 2), CLS), *needles, where=f"{p}:2")


def test_nesting_limit_is_the_same_whatever_the_caller_stack(tmp_path):
    import sys

    from value_assets.core.strict_json import MAX_DEPTH, loads

    ok, deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)

    def nested(k):  # parse from under k extra stack frames, as a Dagster sensor does
        return nested(k - 1) if k else loads(ok, "w")

    assert loads(ok, "w") and nested(sys.getrecursionlimit() - MAX_DEPTH - 150)
    refuse(lambda: loads(deep, "w"), "more than 256 levels", where="w")
    p = write_lines(tmp_path / "d.jsonl", [GOOD, _row_with(extra=deep.decode())])
    refuse(lambda: validate_dataset(ref_for(p, 2), CLS), "more than 256 levels", where=f"{p}:2")


def test_unreadable_dataset_path_is_an_input_error_not_an_oserror(tmp_path):
    long = tmp_path / ("x" * 300 + ".jsonl")  # ENAMETOOLONG from stat()
    refuse(lambda: validate_dataset(ref_for(long, 1, sha="a" * 64), CLS), "cannot read the train dataset", "too long")
    p = tmp_path / "m.json"
    p.write_bytes(manifest_bytes("x" * 300 + ".jsonl"))
    assert load_manifest(p).train.declared_path == "x" * 300 + ".jsonl"  # loading reads no dataset
    refuse(lambda: load_manifest(tmp_path / ("y" * 300 + ".json")), "cannot read the manifest")


@pytest.mark.parametrize("n", [2**63, int("9" * 4000)], ids=["2**63", "4000-digits"])
def test_num_samples_beyond_int64_is_refused(tmp_path, n):
    p = tmp_path / "m.json"
    p.write_bytes(manifest_bytes(n=n))
    refuse(lambda: load_manifest(p), "num_samples", "int64", where=f"{p}: train.num_samples")


def test_surrogate_pair_sample_id_is_valid_and_lone_surrogate_refused_by_check_row(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [_row_with(sample_id='"\\ud83d\\ude00"')])
    assert validate_dataset(ref_for(p, 1), CLS).row(0).sample_id == "\U0001f600"
    refuse(lambda: check_row(row("\ud800"), "here", CLS), "sample_id", "'\\ud800'", "UTF-8", where="here")


def test_parquet_duplicate_column_name_is_a_located_error_not_a_keyerror(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.Table.from_arrays(
        [pa.array(["a"]), pa.array(["b"]), pa.array([[1, 2, 3]]), pa.array([2]), pa.array([[1.0, 1.0]])],
        names=["sample_id", "sample_id", "tokens", "response_length", "returns"],
    )
    p = tmp_path / "d.parquet"
    pq.write_table(t, p)
    refuse(lambda: validate_dataset(ref_for(p, 1), CLS), "duplicate column", "'sample_id'", where=str(p))


def test_parquet_corrupt_data_page_is_a_located_error_not_an_oserror(tmp_path):
    p = write_parquet(
        tmp_path / "d.parquet", [row(f"s{i}", tokens=[i % 50, 2, 3], returns=[1.0, 0.5]) for i in range(5000)]
    )
    data = bytearray(p.read_bytes())
    for k in range(1000, 1040):  # inside the first column chunk's data page, far from the footer
        data[k] ^= 0x5A
    p.write_bytes(bytes(data))
    e = refuse(lambda: validate_dataset(ref_for(p, 5000), CLS), "cannot read the Parquet data")
    assert e.where.startswith(f"{p}:row ")


def test_parquet_invalid_utf8_sample_id_is_a_located_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = pa.Array.from_buffers(
        pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 2], dtype=np.int32).tobytes()), pa.py_buffer(b"a\xff")]
    )
    t = pa.table({"sample_id": ids, "tokens": [[1, 2, 3]] * 2, "response_length": [2, 2], "returns": [[1.0, 0.5]] * 2})
    p = tmp_path / "d.parquet"
    pq.write_table(t, p)
    refuse(lambda: validate_dataset(ref_for(p, 2), CLS), "sample_id", "UTF-8", "xff", where=f"{p}:row 1")


def _cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


CLI_CASES = {
    "nul-path": lambda d: (manifest_bytes("a\u0000b.jsonl"), None, "train.path"),
    "int5000-manifest": lambda d: (b'{"schema":"miles.value-pretrain.v1","n":' + HUGE_INT + b"}", None, "5000 digits"),
    "deep-manifest": lambda d: (b'{"x":' + DEEP + b"}", None, "nested too deeply"),
    "int5000-row": lambda d: (None, _row_with(extra=HUGE_INT.decode()), "t.jsonl:1"),
    "deep-row": lambda d: (None, _row_with(extra=DEEP.decode()), "t.jsonl:1"),
    "surrogate-row": lambda d: (None, _row_with(sample_id='"\\ud800"'), "t.jsonl:1"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_validate_exits_2_with_a_located_paragraph_for_former_crashes(tmp_path, capsys, case):
    manifest, line, needle = CLI_CASES[case](tmp_path)
    data = tmp_path / "t.jsonl"
    if line is not None:
        data.write_bytes(line + b"\n")
        manifest = manifest_bytes("t.jsonl", sha256_file(data))
    p = tmp_path / "m.json"
    p.write_bytes(manifest)
    before = snapshot(tmp_path)
    rc, out, err = _cli(capsys, "validate", p, "--data-root", tmp_path, "--json")
    assert rc == 2 and out == "", err
    assert err.startswith("value-assets: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert needle in err and len(err) < 1000
    assert snapshot(tmp_path) == before


def test_cli_unexpected_exception_is_one_paragraph_exit_1_without_traceback(tmp_path, capsys, monkeypatch):
    import value_assets.cli as cli

    def boom(args):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(cli, "cmd_validate", boom)
    monkeypatch.delenv("VALUE_ASSETS_TRACEBACK", raising=False)
    rc, out, err = _cli(capsys, "validate", tmp_path / "m.json")
    assert rc == 1 and out == ""
    assert "Traceback" not in err and err.count("\n") == 1
    assert "RuntimeError: first line second line" in err and "VALUE_ASSETS_TRACEBACK=1" in err
    monkeypatch.setenv("VALUE_ASSETS_TRACEBACK", "1")
    rc, _, err = _cli(capsys, "validate", tmp_path / "m.json")
    assert rc == 1 and "Traceback" in err


# ---- 2. accepted by validate, fatal in training ---------------------------------------------------


@pytest.mark.parametrize(
    "objective, field, needle",
    [
        ({"reward_range": [-1e308, 1e308]}, "reward_range", "1e+308"),  # high - low overflows to inf
        ({"reward_range": [0.0, 2e6]}, "reward_range", "2000000.0"),
        ({"loss_type": "mse", "num_bins": 1, "reward_range": [-1e300, 1e300]}, "reward_range", "1e+300"),
        ({"reward_range": [0.0, 5e-324]}, "reward_range", "width"),  # bin width underflows to 0
        ({"reward_range": [1.0, 1.0000000000000002]}, "reward_range", "strictly increasing"),  # equal centres
        ({"hl_gauss_sigma_ratio": 5e-324}, "hl_gauss_sigma_ratio", "sigma"),  # sigma underflows to 0
        ({"reward_range": [0, int("1" * 400)]}, "reward_range", "finite"),  # an int beyond float range
        ({"hl_gauss_sigma_ratio": int("1" * 400)}, "hl_gauss_sigma_ratio", "finite"),
        ({"num_bins": 1_000_000_000}, "num_bins", "4096"),
        ({"num_bins": 4097}, "num_bins", "4096"),
        ({"loss_type": "mse", "num_bins": 4097}, "num_bins", "4096"),
    ],
)
def test_objective_that_validated_but_cannot_train_is_refused(tmp_path, objective, field, needle):
    p = tmp_path / "m.json"
    p.write_bytes(manifest_bytes(objective=objective))
    e = refuse(lambda: load_manifest(p), needle)
    assert e.where == f"{p}: objective.{field}"


def test_widest_head_and_largest_range_accepted():
    assert Objective(num_bins=4096).head_size == 4096
    assert Objective(reward_range=(-1e6, 1e6), num_bins=4096).reward_range == (-1e6, 1e6)
    assert Objective(target_type="two_hot", hl_gauss_sigma_ratio=1e-320).target_type == "two_hot"  # sigma unused


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_mse_returns_whose_square_overflows_are_refused(tmp_path, fmt):
    rows = [row("a", returns=[-1e6, 1e6]), row("b", returns=[1e300, 0.0]), row("c")]
    p = tmp_path / f"d.{fmt}"
    (write_jsonl if fmt == "jsonl" else write_parquet)(p, rows)
    where = f"{p}:2" if fmt == "jsonl" else f"{p}:row 1"
    refuse(lambda: validate_dataset(ref_for(p, 3), MSE), "returns[0]", "1e+300", "1e+06", "rescale", where=where)
    ok = tmp_path / f"ok.{fmt}"
    (write_jsonl if fmt == "jsonl" else write_parquet)(ok, [rows[0], rows[2]])
    assert validate_dataset(ref_for(ok, 2), MSE).row(0).returns.tolist() == [-1e6, 1e6]


# ---- 3. bounded row size ----------------------------------------------------------------------------


def test_jsonl_line_over_max_row_bytes_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    big = _row_with(extra='"' + "x" * (32 << 20) + '"')
    p = write_lines(tmp_path / "d.jsonl", [GOOD, big, GOOD])
    monkeypatch.setattr(dataset_mod, "READ_CHUNK", 1 << 20)  # the hash pass reads in chunks of this size
    ref = ref_for(p, 3)
    tracemalloc.start()
    try:
        e = refuse(
            lambda: validate_dataset(ref, CLS, max_row_bytes=1 << 20),
            "maximum row size of 1048576 bytes",
            "max_row_bytes",
            "--max-row-bytes",
            where=f"{p}:2",
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, f"peak {peak / 2**20:.1f} MiB: the 32 MiB line was read whole"
    assert "line" in e.message


def test_max_row_bytes_boundary_is_the_line_without_its_newline(tmp_path):
    line = _row_with(extra='"pad"')
    n = len(line)
    for trailing in (True, False):
        p = write_lines(tmp_path / f"d{trailing}.jsonl", [line], trailing_newline=trailing)
        assert len(validate_dataset(ref_for(p, 1), CLS, max_row_bytes=n)) == 1
        refuse(
            lambda p=p: validate_dataset(ref_for(p, 1), CLS, max_row_bytes=n - 1), "maximum row size", where=f"{p}:1"
        )
    blank = write_lines(tmp_path / "blank.jsonl", [line, b" " * (n + 5)])
    refuse(lambda: validate_dataset(ref_for(blank, 1), CLS, max_row_bytes=n), "maximum row size", where=f"{blank}:2")
    refuse(lambda: validate_dataset(ref_for(blank, 1), CLS, max_row_bytes=0), "max_row_bytes", "0")


def test_parquet_decoded_row_over_max_row_bytes_is_refused(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [row("a"), row("b", tokens=list(range(1000)), rl=2)])
    refuse(lambda: validate_dataset(ref_for(p, 2), CLS, max_row_bytes=4096), "decoded row", "4096", where=f"{p}:row 1")
    assert len(validate_dataset(ref_for(p, 2), CLS, max_row_bytes=8 * 1004 + 1)) == 2


def test_cli_max_row_bytes_option(tmp_path, capsys):
    data = write_lines(tmp_path / "t.jsonl", [GOOD])
    p = write_manifest_for(tmp_path, data, 1)
    rc, _, err = _cli(capsys, "validate", p, "--max-row-bytes", 10)
    assert rc == 2 and f"{data}:1" in err and "--max-row-bytes" in err
    rc, _, err = _cli(capsys, "validate", p, "--max-row-bytes", len(GOOD))
    assert rc == 0, err
    rc, _, err = _cli(capsys, "validate", p, "--max-row-bytes", 0)
    assert rc == 2 and "0" in err


# ---- 4. smaller ------------------------------------------------------------------------------------


def test_dictionary_encoded_parquet_sample_id_is_accepted(tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = pd.DataFrame(
        {
            "sample_id": pd.Categorical(["a", "b", "c"]),
            "tokens": [[1, 2, 3]] * 3,
            "response_length": [2] * 3,
            "returns": [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]],
        }
    )
    p1 = tmp_path / "cat.parquet"
    df.to_parquet(p1)
    t = pa.table(
        {
            "sample_id": pa.array(["x", "y", "x"]).dictionary_encode(),
            "tokens": [[1, 2, 3]] * 3,
            "response_length": pa.array([2, 2, 2]).dictionary_encode(),
            "returns": [[1.0, 0.0]] * 3,
        }
    )
    p2 = tmp_path / "dict.parquet"
    pq.write_table(t, p2)
    ds = validate_dataset(ref_for(p1, 3), CLS)
    assert [ds.row(i).sample_id for i in range(3)] == ["a", "b", "c"]
    refuse(lambda: validate_dataset(ref_for(p2, 3), CLS), "duplicate sample_id", "'x'", where=f"{p2}:row 2")


@pytest.mark.parametrize("ws", [b"\x0c", b"\x0b", b" \x0c ", b"\x1c", b"\xc2\xa0"])
def test_line_of_non_json_whitespace_is_invalid_json_not_blank(tmp_path, ws):
    p = write_lines(tmp_path / "d.jsonl", [GOOD, b" \t\r", ws, dumps(row("h"))])
    refuse(lambda: validate_dataset(ref_for(p, 2), CLS), "invalid", where=f"{p}:3")


def test_symlinked_manifest_resolves_relative_paths_against_the_file_it_reads(tmp_path):
    real_dir, link_dir = tmp_path / "real", tmp_path / "links"
    real_dir.mkdir()
    link_dir.mkdir()
    data = write_jsonl(real_dir / "t.jsonl", [row("a")])
    target = write_manifest_for(real_dir, data, 1)
    (link_dir / "t.jsonl").write_bytes(b"a decoy beside the link\n")
    link = link_dir / "m.json"
    link.symlink_to(target)
    m = load_manifest(link)
    assert m.path == target and m.train.path == data
    assert len(validate_dataset(m.train, m.objective)) == 1


# ---- 6. Miles compatibility ---------------------------------------------------------------------------

MILES_MASKS = [
    ([1.0, 0.0, 1.0], [1, 0, 1]),
    ([True, False, True], [1, 0, 1]),
    ([0.0, True, 1], [0, 1, 1]),
    ([False, False, True], [0, 0, 1]),
    ([-0.0, 1.0, 1.0], [0, 1, 1]),
]


def test_loss_mask_float_and_bool_are_accepted_and_normalised_on_the_fast_path(tmp_path, monkeypatch):
    rows = [
        row(f"m{i}", tokens=[1, 2, 3, 4], rl=3, returns=[0.5, 1.0, 0.5], mask=m) for i, (m, _) in enumerate(MILES_MASKS)
    ]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    calls = []
    monkeypatch.setattr(dataset_mod, "check_row", lambda *a, **k: calls.append(a) or check_row(*a, **k))
    ds = validate_dataset(ref_for(p, len(rows)), CLS)
    assert not calls, "float/bool masks must not need the exact per-row path"
    for i, (_, want) in enumerate(MILES_MASKS):
        assert ds.row(i).loss_mask.tolist() == want and ds.row(i).loss_mask.dtype == np.int8
    assert ds.active_targets.tolist() == [sum(w) for _, w in MILES_MASKS]


def test_loss_mask_float_and_bool_are_accepted_by_the_exact_path(tmp_path):
    # A leading space and an extra key send each line to the strict stdlib parser.
    lines = [
        b" " + dumps(row(f"m{i}", tokens=[1, 2, 3, 4], rl=3, mask=m, meta={"k": 1}))
        for i, (m, _) in enumerate(MILES_MASKS)
    ]
    ds = validate_dataset(ref_for(write_lines(tmp_path / "d.jsonl", lines), len(lines)), CLS)
    assert [ds.row(i).loss_mask.tolist() for i in range(len(lines))] == [w for _, w in MILES_MASKS]


@pytest.mark.parametrize(
    "mask, needle",
    [
        ([0.5, 1, 1], "0.5"),
        ([1, 2, 1], "2"),
        ([1, 2.0, 1], "2.0"),
        ([1, "1", 1], "'1'"),
        ([1, None, 1], "None"),
        ([1.0, 1.0, float("nan")], "nan"),
        ([False] * 3, "no 1"),
        ([0.0] * 3, "no 1"),
    ],
)
@pytest.mark.parametrize("path", ["fast", "exact"])
def test_loss_mask_values_other_than_0_1_false_true_are_still_refused(tmp_path, mask, needle, path):
    r = row("x", tokens=[1, 2, 3, 4], rl=3, mask=mask)
    line = json.dumps(r).encode() if path == "fast" else b" " + json.dumps(r).encode()
    if "nan" in needle:
        line = line.replace(b"NaN", b"0.5")
        needle = "0.5"
    p = write_lines(tmp_path / "d.jsonl", [GOOD, line])
    refuse(lambda: validate_dataset(ref_for(p, 2), CLS), "loss_mask", needle, where=f"{p}:2")


@pytest.mark.parametrize(
    "pa_type, values, ok",
    [
        ("bool_", [True, False], [1, 0]),
        ("float64", [1.0, 0.0], [1, 0]),
        ("float32", [0.0, 1.0], [0, 1]),
        ("int8", [1, 1], [1, 1]),
        ("float64", [1.0, 0.5], None),
        ("float64", [1.0, 2.0], None),
        ("float64", [1.0, float("nan")], None),
    ],
)
def test_parquet_bool_and_float_loss_mask_columns(tmp_path, pa_type, values, ok):
    import pyarrow as pa

    schema = pa.schema(
        [
            ("sample_id", pa.string()),
            ("tokens", pa.list_(pa.int64())),
            ("response_length", pa.int64()),
            ("returns", pa.list_(pa.float64())),
            ("loss_mask", pa.list_(getattr(pa, pa_type)())),
        ]
    )
    one = True if pa_type == "bool_" else 1
    rows = [row("a", mask=[one, one]), row("b", mask=values)]
    p = write_parquet(tmp_path / "d.parquet", rows, schema=schema)
    if ok is None:
        refuse(lambda: validate_dataset(ref_for(p, 2), CLS), "loss_mask[1]", where=f"{p}:row 1")
        return
    ds = validate_dataset(ref_for(p, 2), CLS)
    assert ds.row(1).loss_mask.tolist() == ok and ds.active_targets.tolist() == [2, sum(ok)]


def test_unknown_objective_keys_are_ignored_and_listed(tmp_path, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", [row("a")])
    p = tmp_path / "m.json"
    p.write_bytes(manifest_bytes("t.jsonl", sha256_file(data), 1, {"num_bins": 21, "value_clip": 0.2, "gamma": 1.0}))
    m = load_manifest(p)
    assert m.objective == Objective(num_bins=21) and m.ignored_objective_keys == ("gamma", "value_clip")
    rc, out, err = _cli(capsys, "validate", p, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["ignored_objective_keys"] == ["gamma", "value_clip"]
    assert doc["objective"] == Objective(num_bins=21).canonical()
    rc, out, _ = _cli(capsys, "validate", p)
    assert rc == 0 and "ignored" in out and "'gamma', 'value_clip'" in out
    # Contracts keep their exact five fields: the strict default still refuses unknown keys.
    refuse(lambda: Objective.from_json({"gamma": 1.0}), "unknown field", "'gamma'")


@pytest.mark.parametrize(
    "raw, needles",
    [
        (
            b'{"schema":"miles.value-pretrain.v1","objective":{"num_bins":3,"num_bins":5}}',
            ["duplicate key 'num_bins'", "Python's json keeps the last value silently"],
        ),
        (b'{"schema":"miles.value-pretrain.v1","objective":{"x":NaN}}', ["NaN", "not JSON"]),
        (b'{"schema":"miles.value-pretrain.v1","objective":{"x":1e999}}', ["1e999", "not finite", "inf"]),
    ],
)
def test_refusals_of_what_miles_would_misread_say_why(tmp_path, raw, needles):
    p = tmp_path / "m.json"
    p.write_bytes(raw)
    refuse(lambda: load_manifest(p), *needles, where=str(p))
