"""import-rollouts through the command line with a real Hugging Face tokenizer (SmolLM2's, kept in
tests/data): chat template, EOS, exit status 2 with a located message and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from value_assets.cli import main

pytestmark = pytest.mark.unit
TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "smollm2_tokenizer"


def _write(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_chat_rollouts_are_rendered_with_the_template_and_end_with_eos(tmp_path, capsys):
    from transformers import AutoTokenizer

    recs = [
        {
            "prompt": [{"role": "user", "content": f"Calculate {i} + 2."}],
            "response": str(i + 2 if i % 3 else i),
            "reward": float(i % 3 != 0),
        }
        for i in range(30)
    ]
    src = _write(tmp_path / "rollouts.jsonl", recs)
    assert (
        main(
            [
                "import-rollouts",
                str(src),
                "--tokenizer",
                str(TOKENIZER),
                "--out",
                str(tmp_path / "ds"),
                "--heldout-fraction",
                "0.2",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["train_rows"] + out["heldout_rows"] == 30 and out["heldout_prompts"] == 6
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    row = json.loads((tmp_path / "ds/train.jsonl").read_text().splitlines()[0])
    i = int(row["sample_id"].split(":")[1]) - 1
    prompt = tok.apply_chat_template(recs[i]["prompt"], tokenize=False, add_generation_prompt=True)
    expect_prompt = tok(prompt, add_special_tokens=False)["input_ids"]
    expect_resp = tok(recs[i]["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["tokens"] == expect_prompt + expect_resp and row["response_length"] == len(expect_resp)
    assert tok.decode(row["tokens"]).startswith("<|im_start|>system")
    manifest = json.loads((tmp_path / "ds/rollouts.json").read_text())
    assert manifest["provenance"]["tokenizer"]["chat_template_applied"] is True
    assert len(manifest["provenance"]["tokenizer"]["sha256"]) == 64
    # The importer's output passes `validate` against the tokenizer's vocabulary.
    assert main(["validate", str(tmp_path / "ds/rollouts.json"), "--vocab-size", str(len(tok)), "--json"]) == 0


def test_bad_row_exits_2_with_location_and_writes_nothing(tmp_path, capsys):
    recs = [{"prompt": "Q", "response": "A", "reward": 0.5}, {"prompt": "Q2", "response": "A", "reward": 7.0}]
    src = _write(tmp_path / "r.jsonl", recs)
    assert main(["import-rollouts", str(src), "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert f"{src}:2: reward 7.0 is outside" in err
    assert not (tmp_path / "ds").exists()
    assert (
        main(
            [
                "import-rollouts",
                str(src),
                "--tokenizer",
                str(TOKENIZER),
                "--out",
                str(tmp_path / "ds"),
                "--reward-range",
                "auto",
                "--heldout-fraction",
                "0",
            ]
        )
        == 0
    )
    assert "reward range taken from the data: [0.5, 7.0]" in capsys.readouterr().err


def _tokenizer_with_template(tmp_path: Path, template: str) -> Path:
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize(
    "template, needle",
    [
        (
            "{% for m in messages %}{% if m['role'] not in ['system', 'user'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}",
            "unknown role assistant",
        ),
        ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),
    ],
)
def test_a_chat_template_that_refuses_exits_2_at_the_record(tmp_path, capsys, template, needle):
    """Issue 33, defect 7: a template's own raise_exception, or a template that does not parse, was
    exit 1 ('unexpected failure') without a location; it is exit 2 at the record's file:line."""
    folder = _tokenizer_with_template(tmp_path, template)
    recs = [
        {
            "prompt": [{"role": "user", "content": "q"}] + ([{"role": "assistant", "content": "a"}] if i == 1 else []),
            "response": "r",
            "reward": 1.0,
        }
        for i in range(3)
    ]
    src = _write(tmp_path / "r.jsonl", recs)
    assert main(["import-rollouts", str(src), "--tokenizer", str(folder), "--out", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    where = f"{src}:2" if "raise" in template else f"{src}:1"
    assert f"value-assets: error: {where}: {folder} chat template: refused this prompt" in err and needle in err, err
    assert not (tmp_path / "ds").exists()


def test_max_seq_len_is_an_import_option(tmp_path, capsys):
    """Issue 33, defect 13: a 3.5-million-token row was imported without a word. What training
    would refuse (a row longer than the backbone's maximum length) is refused at import, located;
    without the option the summary says how long the longest row is, and a row beyond the
    tokenizer's own model_max_length (where its files state one) is named in a warning."""
    import shutil

    recs = [
        {"prompt": f"Q{i}", "response": "word " * (3000 if i == 2 else 3), "reward": float(i % 2)} for i in range(4)
    ]
    src = _write(tmp_path / "r.jsonl", recs)
    args = ["import-rollouts", str(src), "--heldout-fraction", "0.25"]
    assert main([*args, "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "ds"), "--max-seq-len", "512"]) == 2
    assert f"{src}:3: " in capsys.readouterr().err and not (tmp_path / "ds").exists()
    assert main([*args, "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "ds"), "--max-seq-len", "1"]) == 2
    assert "--max-seq-len: must be an integer >= 2" in capsys.readouterr().err
    assert main([*args, "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["longest_row_tokens"] > 3000
    assert "warning" not in out.err  # SmolLM2's files state no context length (transformers' 1e30 placeholder)
    manifest = json.loads((tmp_path / "ds" / "rollouts.json").read_text())
    assert manifest["provenance"]["longest_row_tokens"] > 3000 and manifest["provenance"]["max_seq_len"] is None
    limited = tmp_path / "tok"
    shutil.copytree(TOKENIZER, limited)
    config = json.loads((limited / "tokenizer_config.json").read_text())
    (limited / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 2048}))
    assert main([*args, "--tokenizer", str(limited), "--out", str(tmp_path / "ds2")]) == 0
    err = capsys.readouterr().err
    assert f"warning: the longest row ({src}:3) has" in err and "model_max_length 2048" in err, err
