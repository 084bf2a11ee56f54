"""docs/rules.md#manifest (manifest) and the data-root rule of docs/rules.md#bad-input-and-safety."""

import json
import os
from pathlib import Path

import pytest

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.manifest import load_manifest
from value_assets.core.objective import Objective

pytestmark = pytest.mark.unit

SHA = "0123456789abcdef" * 4


def base(**over):
    m = {
        "schema": "miles.value-pretrain.v1",
        "train": {"path": "data/train.jsonl", "sha256": SHA, "num_samples": 4},
        "objective": {},
    }
    m.update(over)
    return m


def write(tmp_path, obj=None, raw=None, name="m.json"):
    p = tmp_path / name
    p.write_bytes(raw if raw is not None else json.dumps(obj).encode())
    return p


def refuse(path, *needles, **kw):
    with pytest.raises(InputError) as ei:
        load_manifest(path, **kw)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def test_minimal_manifest_defaults_and_does_not_read_datasets(tmp_path):
    p = write(tmp_path, base())
    m = load_manifest(p)  # data/train.jsonl does not exist: loading must not read it
    assert m.heldout is None
    assert m.train.path == tmp_path / "data" / "train.jsonl"
    assert m.train.sha256 == SHA and m.train.num_samples == 4
    assert m.sha256 == sha256_bytes(p.read_bytes())
    assert m.objective == Objective()
    assert m.objective.canonical() == {
        "loss_type": "classification",
        "num_bins": 51,
        "reward_range": [0.0, 1.0],
        "target_type": "hl_gauss",
        "hl_gauss_sigma_ratio": 0.75,
    }


def test_canonical_objective_uses_floats(tmp_path):
    p = write(tmp_path, base(objective={"reward_range": [-1, 2], "hl_gauss_sigma_ratio": 1, "num_bins": 3}))
    c = load_manifest(p).objective.canonical()
    assert c["reward_range"] == [-1.0, 2.0] and all(type(v) is float for v in c["reward_range"])
    assert type(c["hl_gauss_sigma_ratio"]) is float
    assert json.dumps(c, sort_keys=True) == (
        '{"hl_gauss_sigma_ratio": 1.0, "loss_type": "classification", "num_bins": 3, '
        '"reward_range": [-1.0, 2.0], "target_type": "hl_gauss"}'
    )
    # Spelling the defaults out gives the same canonical objective as leaving them out.
    p2 = write(tmp_path, base(objective=Objective().canonical()), name="m2.json")
    p3 = write(tmp_path, base(objective={}), name="m3.json")
    assert load_manifest(p2).objective.canonical() == load_manifest(p3).objective.canonical()


def test_heldout_null_absent_and_present(tmp_path):
    assert load_manifest(write(tmp_path, base(heldout=None))).heldout is None
    m = load_manifest(
        write(tmp_path, base(heldout={"path": "h.jsonl", "sha256": SHA, "num_samples": 2}), name="h.json")
    )
    assert m.heldout.path == tmp_path / "h.jsonl" and m.heldout.num_samples == 2
    assert [r.split for r in m.splits()] == ["train", "heldout"]


def test_relative_paths_resolve_against_manifest_folder_not_cwd(tmp_path, monkeypatch):
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    p = write(sub, base(train={"path": "../d/t.jsonl", "sha256": SHA, "num_samples": 1}))
    monkeypatch.chdir(tmp_path)
    m = load_manifest(Path("a/b/m.json"))
    assert m.train.path == tmp_path / "a" / "d" / "t.jsonl"
    assert m.train.declared_path == "../d/t.jsonl"
    assert m.path == p


def test_absolute_path_kept(tmp_path):
    m = load_manifest(write(tmp_path, base(train={"path": "/abs/t.jsonl", "sha256": SHA, "num_samples": 1})))
    assert m.train.path == Path("/abs/t.jsonl")


def test_provenance_kept(tmp_path):
    prov = {"generator": "x", "nested": {"a": [1, 2]}}
    assert load_manifest(write(tmp_path, base(provenance=prov))).provenance == prov


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"schema":"miles.value-pretrain.v1","schema":"miles.value-pretrain.v1"}', "duplicate key 'schema'"),
        (b'{"a":1,"b":{"c":1,"c":2}}', "duplicate key 'c'"),
        (b'{"x":NaN}', "NaN"),
        (b'{"x":Infinity}', "Infinity"),
        (b'{"x":-Infinity}', "-Infinity"),
        (b'{"x":1e999}', "1e999"),
        (b'{"x":', "invalid JSON"),
        (b"[1,2]", "[1, 2]"),
        (b"\xff\xfe{}", "UTF-8"),
    ],
)
def test_strict_parse_errors_name_file_and_value(tmp_path, raw, needle):
    p = write(tmp_path, raw=raw)
    refuse(p, str(p), needle)


def test_nan_in_provenance_refused(tmp_path):
    text = json.dumps(base(provenance={"ev": 0.5})).replace("0.5", "NaN")
    p = write(tmp_path, raw=text.encode())
    refuse(p, str(p), "NaN")


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("num_samples", True, "True"),
        ("num_samples", 0, "0"),
        ("num_samples", 2.0, "2.0"),
        ("num_samples", "3", "'3'"),
        ("sha256", SHA.upper(), SHA.upper()),
        ("sha256", SHA[:-1], SHA[:-1]),
        ("sha256", None, "None"),
        ("path", "", "''"),
        ("path", 5, "5"),
    ],
)
def test_bad_dataset_ref_fields(tmp_path, field, value, needle):
    train = {"path": "t.jsonl", "sha256": SHA, "num_samples": 3}
    train[field] = value
    p = write(tmp_path, base(train=train))
    refuse(p, str(p), f"train.{field}", needle)


@pytest.mark.parametrize("missing", ["path", "sha256", "num_samples"])
def test_missing_dataset_ref_field(tmp_path, missing):
    train = {"path": "t.jsonl", "sha256": SHA, "num_samples": 3}
    del train[missing]
    p = write(tmp_path, base(heldout=train))
    refuse(p, str(p), "heldout", repr(missing))


def test_train_required_and_objective_required_and_schema(tmp_path):
    m = base()
    del m["train"]
    refuse(write(tmp_path, m, name="a.json"), "train", "required")
    m = base()
    del m["objective"]
    refuse(write(tmp_path, m, name="b.json"), "objective", "required")
    refuse(
        write(tmp_path, base(schema="miles.value-pretrain.v2"), name="c.json"), "schema", "'miles.value-pretrain.v2'"
    )
    refuse(write(tmp_path, base(objective=None), name="d.json"), "objective", "None")
    refuse(write(tmp_path, base(provenance=[1]), name="e.json"), "provenance", "[1]")


@pytest.mark.parametrize(
    "objective, field, needle",
    [
        ({"loss_type": "huber"}, "loss_type", "'huber'"),
        ({"num_bins": 1}, "num_bins", "1"),
        ({"num_bins": True}, "num_bins", "True"),
        ({"num_bins": 51.0}, "num_bins", "51.0"),
        ({"reward_range": [1.0, 0.0]}, "reward_range", "(1.0, 0.0)"),
        ({"reward_range": [0.5, 0.5]}, "reward_range", "0.5"),
        ({"reward_range": [0.0]}, "reward_range", "0.0"),
        ({"reward_range": [False, True]}, "reward_range", "False"),
        ({"reward_range": "0,1"}, "reward_range", "'0,1'"),
        ({"target_type": "gauss"}, "target_type", "'gauss'"),
        ({"hl_gauss_sigma_ratio": 0}, "hl_gauss_sigma_ratio", "0"),
        ({"hl_gauss_sigma_ratio": -0.5}, "hl_gauss_sigma_ratio", "-0.5"),
        ({"hl_gauss_sigma_ratio": True}, "hl_gauss_sigma_ratio", "True"),
    ],
)
def test_bad_objective_fields(tmp_path, objective, field, needle):
    p = write(tmp_path, base(objective=objective))
    msg = refuse(p, str(p), "objective", needle)
    assert field in msg


def test_mse_allows_one_bin_and_infinite_range_is_refused(tmp_path):
    assert load_manifest(write(tmp_path, base(objective={"loss_type": "mse", "num_bins": 1}))).objective.head_size == 1
    p = write(
        tmp_path,
        raw=json.dumps(base(objective={"reward_range": [0, 7]})).replace("7", "Infinity").encode(),
        name="i.json",
    )
    refuse(p, str(p), "Infinity")


def test_objective_constructor_refuses_non_finite():
    with pytest.raises(InputError, match="finite"):
        Objective(reward_range=(0.0, float("inf")))
    with pytest.raises(InputError, match="hl_gauss_sigma_ratio"):
        Objective(hl_gauss_sigma_ratio=float("nan"))


# -- pins -------------------------------------------------------------------------------------


def test_pin_matches(tmp_path):
    p = write(tmp_path, base())
    assert load_manifest(p, pinned_sha256=sha256_bytes(p.read_bytes())).sha256 == sha256_bytes(p.read_bytes())


@pytest.mark.parametrize("pin", ["A" * 64, "abc", "g" * 64, "a" * 65, "", 123])
def test_malformed_pin_is_an_error(tmp_path, pin):
    p = write(tmp_path, base())
    msg = refuse(p, "pinned", pinned_sha256=pin)
    assert repr(pin) in msg


def test_uppercase_version_of_the_right_digest_is_refused(tmp_path):
    p = write(tmp_path, base())
    right = sha256_bytes(p.read_bytes())
    refuse(p, right.upper(), pinned_sha256=right.upper())


def test_wrong_pin_checked_before_parsing(tmp_path):
    p = write(tmp_path, raw=b"this is not json")
    msg = refuse(p, str(p), SHA, sha256_bytes(b"this is not json"), pinned_sha256=SHA)
    assert "invalid JSON" not in msg
    # with the right pin, parsing runs (and fails on the JSON)
    refuse(p, "invalid JSON", pinned_sha256=sha256_bytes(b"this is not json"))


def test_missing_manifest_and_directory(tmp_path):
    refuse(tmp_path / "nope.json", "nope.json", "does not exist")
    refuse(tmp_path, str(tmp_path), "directory")


# -- data roots -------------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path):
    data = tmp_path / "data"
    data2 = tmp_path / "data2"
    outside = tmp_path / "outside"
    for d in (data, data2, outside):
        d.mkdir()
    return data, data2, outside


def _m(tmp_path, path, name="m.json"):
    return write(tmp_path, base(train={"path": str(path), "sha256": SHA, "num_samples": 1}), name=name)


def test_path_inside_root_accepted(tmp_path, roots):
    data, _, _ = roots
    assert (
        load_manifest(_m(tmp_path, data / "sub" / "t.jsonl"), data_roots=[data]).train.path == data / "sub" / "t.jsonl"
    )
    # no roots configured: anything goes
    assert load_manifest(_m(tmp_path, "/elsewhere/t.jsonl", "n.json")).train.path == Path("/elsewhere/t.jsonl")


def test_string_prefix_trap(tmp_path, roots):
    data, data2, _ = roots
    p = _m(tmp_path, data2 / "t.jsonl")
    refuse(p, str(p), "train.path", str(data2 / "t.jsonl"), data_roots=[data])
    # with a trailing slash on the root too
    refuse(p, "outside the configured data roots", data_roots=[str(data) + "/"])


def test_dotdot_escape_refused(tmp_path, roots):
    data, _, outside = roots
    p = _m(tmp_path, f"{data}/../outside/t.jsonl")
    refuse(p, "outside the configured data roots", str(outside / "t.jsonl"), data_roots=[data])


def test_relative_dotdot_escape_refused(tmp_path, roots):
    data, _, _ = roots
    p = write(data, base(train={"path": "../outside/t.jsonl", "sha256": SHA, "num_samples": 1}))
    refuse(p, "outside the configured data roots", data_roots=[data])


def test_symlink_escape_refused(tmp_path, roots):
    data, _, outside = roots
    (outside / "t.jsonl").write_text("{}\n")
    os.symlink(outside / "t.jsonl", data / "link.jsonl")
    os.symlink(outside, data / "dirlink")
    refuse(
        _m(tmp_path, data / "link.jsonl"),
        "outside the configured data roots",
        str(outside / "t.jsonl"),
        data_roots=[data],
    )
    refuse(_m(tmp_path, data / "dirlink" / "x.jsonl", "n.json"), "outside the configured data roots", data_roots=[data])


def test_symlinked_root_and_symlink_pointing_inside(tmp_path, roots):
    data, _, _ = roots
    os.symlink(data, tmp_path / "alias")
    (data / "t.jsonl").write_text("")
    os.symlink(data / "t.jsonl", tmp_path / "outside" / "in.jsonl")
    assert load_manifest(_m(tmp_path, data / "t.jsonl"), data_roots=[tmp_path / "alias"])
    # a link outside the root whose target is inside the root is compared after resolution
    assert load_manifest(_m(tmp_path, tmp_path / "outside" / "in.jsonl", "n.json"), data_roots=[data])


def test_heldout_checked_against_roots_too(tmp_path, roots):
    data, _, outside = roots
    m = base(
        train={"path": str(data / "t.jsonl"), "sha256": SHA, "num_samples": 1},
        heldout={"path": str(outside / "h.jsonl"), "sha256": SHA, "num_samples": 1},
    )
    refuse(write(tmp_path, m), "heldout.path", data_roots=[data])
