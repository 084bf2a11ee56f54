"""import-rollouts (core/rollouts.py): by-prompt split, reward ranges, located refusals, nothing
written on bad input. A character-level tokenizer stands in for the actor's here; the real
Hugging Face tokenizer path is tested in tests/core/test_rollouts_hf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from value_assets.core.dataset import validate_dataset
from value_assets.core.errors import InputError
from value_assets.core.manifest import load_manifest
from value_assets.core.rollouts import PRESETS, Fields, import_rollouts, split_groups

pytestmark = pytest.mark.unit

GENERIC = PRESETS["generic"]


class CharTokenizer:
    sha256 = "0" * 64
    vocab_size = 2048

    def render_prompt(self, prompt, chat_template):
        if isinstance(prompt, list):
            return "".join(f"<{m['role']}>{m['content']}" for m in prompt) + "<assistant>", True
        return prompt, False

    def encode_prompt(self, text, templated):
        return ([] if templated else [1]) + [ord(c) % 1000 + 2 for c in text]

    def encode_response(self, text):
        return [ord(c) % 1000 + 2 for c in text] + ([3] if text else [])


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records(prompts=12, samples=4, reward=lambda p, s: float((p + s) % 2)):
    return [
        {"prompt": f"question {p}", "response": f"answer {p}.{s}", "reward": reward(p, s)}
        for p in range(prompts)
        for s in range(samples)
    ]


def rows_of(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_is_by_prompt_and_every_row_lands_once(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", records())
    res = import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25, seed=3)
    train, held = rows_of(tmp_path / "out/train.jsonl"), rows_of(tmp_path / "out/heldout.jsonl")
    assert len(train) + len(held) == 48 and res.heldout_groups == 3 and res.train_groups == 9

    def prompt_of(row):
        return bytes(t - 2 for t in row["tokens"][1 : len(row["tokens"]) - row["response_length"]]).decode()

    assert not {prompt_of(r) for r in train} & {prompt_of(r) for r in held}
    # Every sample of a held-out prompt is held out.
    assert len(held) == 4 * 3
    # The written files are valid Miles datasets for the manifest (validated with the training rules).
    m = load_manifest(res.manifest)
    assert m.train.num_samples == 36 and m.heldout.num_samples == 12
    for ref in m.splits():
        validate_dataset(ref, m.objective)
    prov = json.loads(res.manifest.read_text())["provenance"]
    assert prov["split"]["seed"] == 3 and prov["inputs"][0]["records"] == 48 and prov["tokenizer"]["sha256"] == "0" * 64


def test_rows_carry_the_reward_on_every_response_token(tmp_path):
    src = write_jsonl(
        tmp_path / "r.jsonl",
        [{"prompt": "p1", "response": "abc", "reward": 1.0}, {"prompt": "p2", "response": "de", "reward": 0.0}],
    )
    import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.0)
    rows = rows_of(tmp_path / "out/train.jsonl")
    assert rows[0]["tokens"] == [1, ord("p") + 2, ord("1") + 2, ord("a") + 2, ord("b") + 2, ord("c") + 2, 3]
    assert rows[0]["response_length"] == 4 and rows[0]["returns"] == [1.0] * 4
    assert rows[1]["returns"] == [0.0] * 3 and rows[0]["sample_id"] == "r:1" and rows[1]["sample_id"] == "r:2"
    assert not (tmp_path / "out/heldout.jsonl").exists()


def test_split_depends_on_seed_and_keys_not_on_file_order():
    keys = [f"prompt {i}" for i in range(50)]
    a = split_groups(keys, 0.2, seed=7)
    assert a == split_groups(list(reversed(keys)), 0.2, seed=7)
    assert len(a) == 10 and a != split_groups(keys, 0.2, seed=8)
    assert split_groups(keys, 0.0, seed=7) == set()
    assert len(split_groups(["a", "b"], 0.01, seed=0)) == 1  # at least one group each side
    with pytest.raises(InputError, match="at least 2 prompt groups"):
        split_groups(["only"], 0.5, seed=0)


def test_group_field_overrides_the_prompt_text(tmp_path):
    recs = [{"prompt": f"variant {i}", "response": "x", "reward": i % 2, "qid": i // 4} for i in range(16)]
    src = write_jsonl(tmp_path / "r.jsonl", recs)
    res = import_rollouts(
        [src],
        CharTokenizer(),
        tmp_path / "out",
        fields=Fields(prompt="prompt", response="response", reward="reward", group="qid"),
        heldout_fraction=0.25,
    )
    assert res.heldout_groups == 1 and res.heldout_rows == 4


def test_chat_messages_and_presets(tmp_path):
    recs = [{"input": [{"role": "user", "content": f"q{i}"}], "output": "a", "score": 1.0 * (i % 2)} for i in range(8)]
    src = write_jsonl(tmp_path / "v.jsonl", recs)
    res = import_rollouts(
        [src], CharTokenizer(), tmp_path / "out", fields=PRESETS["verl"], preset="verl", heldout_fraction=0.25
    )
    assert res.train_rows + res.heldout_rows == 8
    prov = json.loads(res.manifest.read_text())["provenance"]
    assert prov["preset"] == "verl" and prov["tokenizer"]["chat_template_applied"] is True


def test_reward_range_auto_given_and_refused(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", records(reward=lambda p, s: 2.0 * ((p + s) % 2) - 1.0))
    with pytest.raises(InputError) as exc:
        import_rollouts([src], CharTokenizer(), tmp_path / "o1", fields=GENERIC)
    assert (
        f"{src}:1:" in str(exc.value)
        and "reward -1.0 is outside" in str(exc.value)
        and "--reward-range auto" in str(exc.value)
    )
    assert not (tmp_path / "o1").exists()
    res = import_rollouts([src], CharTokenizer(), tmp_path / "o2", fields=GENERIC, reward_range="auto")
    assert res.reward_range == (-1.0, 1.0) and res.reward_range_source == "auto"
    assert load_manifest(res.manifest).objective.reward_range == (-1.0, 1.0)
    res = import_rollouts([src], CharTokenizer(), tmp_path / "o3", fields=GENERIC, reward_range=(-2.0, 2.0))
    assert res.reward_range_source == "given"
    const = write_jsonl(tmp_path / "c.jsonl", records(reward=lambda p, s: 1.0))
    with pytest.raises(InputError, match="every reward equals 1.0"):
        import_rollouts([const], CharTokenizer(), tmp_path / "o4", fields=GENERIC, reward_range="auto")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "p", "response": "r"}, "missing field 'reward'"),
        ({"prompt": "p", "response": "r", "reward": True}, "must be a finite number, got True"),
        ({"prompt": "p", "response": "r", "reward": "1"}, "must be a finite number, got '1'"),
        ({"prompt": "p", "response": "", "reward": 1.0}, "response tokenizes to no tokens"),
        ({"prompt": 5, "response": "r", "reward": 1.0}, "prompt text or a non-empty list of chat messages"),
        ({"prompt": [{"role": "user"}], "response": "r", "reward": 1.0}, "must be a chat message"),
        ({"prompt": "p", "response": {"text": "r"}, "reward": 1.0}, "must be a response text"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_records_are_located_and_nothing_is_written(tmp_path, bad, message):
    good = records(prompts=3, samples=1)
    src = write_jsonl(tmp_path / "r.jsonl", good[:2] + [bad] + good[2:])
    with pytest.raises(InputError, match=message) as exc:
        import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC)
    assert str(exc.value).startswith(f"{src}:3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_invalid_json_line_and_duplicate_ids_are_located(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "p", "response": "r", "reward": 1}\n{"prompt": "p", "prompt": "q"}\n')
    with pytest.raises(InputError, match=r"r.jsonl:2: invalid JSON: duplicate key 'prompt'"):
        import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC)
    src.write_text(
        "".join(json.dumps({"id": "same", "prompt": f"p{i}", "response": "r", "reward": 1}) + "\n" for i in range(2))
    )
    with pytest.raises(InputError, match=r"r.jsonl:2: sample id 'same' repeats .*r.jsonl:1"):
        import_rollouts(
            [src],
            CharTokenizer(),
            tmp_path / "out",
            fields=Fields(prompt="prompt", response="response", reward="reward", sample_id="id"),
        )
    assert not (tmp_path / "out").exists()


def test_parquet_input_and_non_empty_output_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = records(prompts=4, samples=2)
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "r.parquet")
    res = import_rollouts(
        [tmp_path / "r.parquet"], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25
    )
    assert res.train_rows + res.heldout_rows == 8
    assert rows_of(tmp_path / "out/train.jsonl")[0]["sample_id"].startswith("r:r")
    bad = [dict(r) for r in recs]
    bad[5]["reward"] = 3.0
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"b.parquet:row 5: reward 3.0 is outside"):
        import_rollouts([tmp_path / "b.parquet"], CharTokenizer(), tmp_path / "out2", fields=GENERIC)
    with pytest.raises(InputError, match="not empty; import-rollouts never overwrites"):
        import_rollouts([tmp_path / "r.parquet"], CharTokenizer(), tmp_path / "out", fields=GENERIC)


def test_mse_objective_keeps_rewards_outside_the_range(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", records(reward=lambda p, s: float(p)))
    res = import_rollouts(
        [src], CharTokenizer(), tmp_path / "out", fields=GENERIC, loss_type="mse", heldout_fraction=0.25
    )
    assert load_manifest(res.manifest).objective.loss_type == "mse"


def test_import_into_the_watched_folder_with_a_training_spec(tmp_path):
    """`--inbox`: the datasets under `out`, the manifest (last) in the watched folder with paths
    relative to it and the spec embedded; a manifest already there is never replaced, and nothing
    is left behind by the refusal (docs/rules.md#training-spec)."""
    src = write_jsonl(tmp_path / "r.jsonl", records())
    spec = {"schema": "value-assets.training.v1", "backbone": "tiny", "gate": {"mode": "interval"}}
    inbox = tmp_path / "manifests"
    res = import_rollouts([src], CharTokenizer(), tmp_path / "data" / "run1", fields=GENERIC, heldout_fraction=0.25,
                          name="run1", inbox=inbox, training=spec)  # fmt: skip
    assert res.manifest == inbox / "run1.json" and sorted(p.name for p in inbox.iterdir()) == ["run1.json"]
    assert sorted(p.name for p in (tmp_path / "data" / "run1").iterdir()) == ["heldout.jsonl", "train.jsonl"]
    m = load_manifest(res.manifest)
    assert m.train.path == (tmp_path / "data" / "run1" / "train.jsonl") and m.raw["training"] == spec
    for ref in m.splits():
        validate_dataset(ref, m.objective)
    before = res.manifest.read_bytes()
    with pytest.raises(InputError, match="already in the watched folder") as err:
        import_rollouts([src], CharTokenizer(), tmp_path / "data" / "run2", fields=GENERIC, name="run1", inbox=inbox)
    assert err.value.where == str(inbox / "run1.json")
    assert res.manifest.read_bytes() == before and not (tmp_path / "data" / "run2").exists()
