"""Every command that writes, under fault injection (issue 33): a user-named output path stays in its
folder, every refusal is exit 2 with a location, and no command leaves a partial file, whether the
write fails (ENOSPC on a small tmpfs where the tests run as root; EFBIG from a file-size limit
anywhere; EACCES) or the process is killed in the middle of it (SIGXFSZ).

import-rollouts runs here with a character tokenizer (tests/core/test_rollouts.py); the Hugging Face
path (chat templates, --max-seq-len) is in tests/core/test_rollouts_hf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.core.test_rollouts import CharTokenizer, records, write_jsonl
from value_assets.cli import main
from value_assets.core.errors import InputError
from value_assets.core.rollouts import PRESETS, import_rollouts

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GENERIC = PRESETS["generic"]


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


# ---- defect 3: --name is a file name inside the output folder -----------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "sub/x", "", ".hidden", ".."])
@pytest.mark.parametrize("inbox", [False, True])
def test_import_rollouts_name_stays_inside_out_and_nothing_is_written(tmp_path, name, inbox):
    """`--name ../../x` wrote the manifest outside --out (or --inbox), over an existing file, then
    exited 2 leaving it; `--name ""` wrote a hidden `.json`."""
    (tmp_path / "in").mkdir()
    src = write_jsonl(tmp_path / "in" / "r.jsonl", records(prompts=4, samples=2))
    victim = tmp_path / "x.json"
    victim.write_text("precious")
    before = files_under(tmp_path)
    extra = {"inbox": tmp_path / "a" / "inbox"} if inbox else {}
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(InputError, match="--name"):
        import_rollouts([src], CharTokenizer(), out, fields=GENERIC, name=name, heldout_fraction=0.25, **extra)
    assert files_under(tmp_path) == before and victim.read_text() == "precious"


def test_make_demo_data_name_stays_inside_its_folder(tmp_path, capsys):
    rc, err = run(capsys, "make-demo-data", tmp_path / "out", "--rows", 4, "--name", "../escaped")
    assert rc == 2 and "--name" in err, err
    assert files_under(tmp_path) == []


# ---- defect 14: a syntax error's column ----------------------------------------------------------------------------


def test_a_truncated_line_is_placed_at_its_end(tmp_path, capsys):
    """A JSONL row cut short was placed at 'column 1' (of the line after it: Python's parser stops
    after the trailing newline); a multi-line document lost the line."""
    from tests.core.coretest_helpers import dumps, row
    from value_assets.core.hashing import sha256_file

    good = dumps(row("a")).decode()
    cut = good[:36]
    data = tmp_path / "train.jsonl"
    data.write_text(good + "\n" + cut + "\n")
    manifest = tmp_path / "m.json"
    manifest.write_text(
        json.dumps(
            {
                "schema": "miles.value-pretrain.v1",
                "objective": {},
                "train": {"path": "train.jsonl", "sha256": sha256_file(data), "num_samples": 2},
            }
        )
    )
    rc, err = run(capsys, "validate", manifest)
    assert rc == 2 and f"{data}:2: invalid JSON" in err and "at column 37 (the end of the text" in err, err
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "p", "response": "r", "reward": 1.0}\n{"prompt": "p", "response": "r", "rew\n')
    with pytest.raises(InputError, match=r"r.jsonl:2: invalid JSON: Invalid control character at column 38 \(the end"):
        import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC)
    manifest.write_text('{\n  "schema": "miles.value-pretrain.v1",\n  "train": {"path": "x"}\n  "objective": {}\n}\n')
    rc, err = run(capsys, "validate", manifest)
    assert rc == 2 and "at line 4 column 3" in err, err
