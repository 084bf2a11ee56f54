"""core/miles.py: the docs/rules.md#hand-off contract, checked by the rules of Miles' `load_value_pretrain_contract`."""

from __future__ import annotations

import hashlib
import json

import pytest

from value_assets.core.errors import InputError
from value_assets.core.miles import (
    MILES_KEYS,
    build_miles_contract,
    check_miles_contract,
    miles_contract_bytes,
    read_miles_contract,
)
from value_assets.core.objective import Objective

pytestmark = pytest.mark.unit

OURS = {  # the fields of a value-assets.training-contract.v1 that the Miles contract takes
    "source_manifest_sha256": "a" * 64,
    "train_dataset_sha256": "b" * 64,
    "objective": Objective(num_bins=7, reward_range=(-1, 2)).canonical(),
    "batch_plan": {"seed": 3, "global_batch_size": 8, "drop_incomplete_batch": True, "algorithm": "x"},
    "batch_plan_sha256": "c" * 64,
    "completed_steps": 5,
}


def _miles_bytes(payload) -> bytes:
    """Miles' `_canonical_json_bytes` (miles/value_pretraining.py), restated."""
    return (json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def test_build_has_exactly_the_spec_keys_and_miles_bytes(tmp_path):
    c = build_miles_contract(OURS, "Qwen2.5-0.5B · actor")  # non-ASCII: bytes not escaped, as Miles writes
    assert sorted(c) == sorted(MILES_KEYS)
    assert c["batch_plan"] == {"seed": 3, "global_batch_size": 8, "drop_incomplete_batch": True}
    assert c["objective"]["reward_range"] == [-1.0, 2.0] and isinstance(c["objective"]["reward_range"][0], float)
    data = miles_contract_bytes(c)
    assert data == _miles_bytes(c)
    (tmp_path / "value_pretrain_contract.json").write_bytes(data)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    got, sha = read_miles_contract(tmp_path, hashlib.sha256(data).hexdigest())
    assert got == c and sha == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(extra=1), "unexpected \\['extra'\\]"),
        (lambda c: c.pop("model_identity"), "missing \\['model_identity'\\]"),
        (lambda c: c.update(schema="value-assets.training-contract.v1"), "schema"),
        (lambda c: c.update(train_dataset_sha256="A" * 64), "lowercase SHA-256"),
        (lambda c: c["batch_plan"].update(seed=True), "seed: must be an integer"),
        (lambda c: c["batch_plan"].update(drop_incomplete_batch=1), "must be true"),
        (lambda c: c["batch_plan"].update(algorithm="x"), "exactly the keys"),
        (lambda c: c.update(completed_steps=0), "positive integer"),
        (lambda c: c.update(model_identity=""), "non-empty string"),
        (lambda c: c["objective"].update(reward_range=[0, 1]), "canonical objective"),
    ],
)
def test_miles_rules_refuse(change, message):
    c = build_miles_contract(OURS, "m")
    change(c)
    with pytest.raises(InputError, match=message):
        check_miles_contract(c, "c")


def test_reader_refuses_pins_noncanonical_bytes_and_tracker_mismatch(tmp_path):
    c = build_miles_contract(OURS, "m")
    p = tmp_path / "value_pretrain_contract.json"
    p.write_bytes(json.dumps(c, indent=1).encode())
    with pytest.raises(InputError, match="not canonical"):
        read_miles_contract(tmp_path)
    p.write_bytes(miles_contract_bytes(c))
    with pytest.raises(InputError, match="was pinned"):
        read_miles_contract(tmp_path, "0" * 64)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(InputError, match="names iteration '4'.*5 completed steps"):
        read_miles_contract(tmp_path)
    with pytest.raises(InputError, match="completed_steps"):
        build_miles_contract({**OURS, "completed_steps": 0}, "m")
    with pytest.raises(InputError, match="--model-identity"):
        build_miles_contract(OURS, "")
