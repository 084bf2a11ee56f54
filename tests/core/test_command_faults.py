"""Every command that writes, under fault injection (issue 33): a user-named output path stays in its
folder, every refusal is exit 2 with a location, and no command leaves a partial file, whether the
write fails (ENOSPC on a small tmpfs where the tests run as root; EFBIG from a file-size limit
anywhere; EACCES) or the process is killed in the middle of it (SIGXFSZ).

import-rollouts runs here with a character tokenizer (tests/core/test_rollouts.py); the Hugging Face
path (chat templates, --max-seq-len) is in tests/core/test_rollouts_hf.py."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.test_rollouts import CharTokenizer, records, write_jsonl
from tests.tmpfs import small_tmpfs
from value_assets.cli import main
from value_assets.core.errors import InputError
from value_assets.core.publish import PublishError
from value_assets.core.rollouts import PRESETS, import_rollouts

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GENERIC = PRESETS["generic"]


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """In this process: a write that would grow any file past `nbytes` fails with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


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


# ---- defect 9: inputs with the same stem ------------------------------------------------------------------------


def test_inputs_with_the_same_stem_get_distinct_default_ids(tmp_path):
    """Two valid inputs d1/r.jsonl and d2/r.jsonl were refused as repeated ids (default ids were
    FILE-STEM:LINE)."""
    for d in ("d1", "d2"):
        (tmp_path / d).mkdir()
    a = write_jsonl(tmp_path / "d1" / "r.jsonl", records(prompts=4, samples=2))
    b = write_jsonl(tmp_path / "d2" / "r.jsonl", records(prompts=4, samples=2))
    res = import_rollouts([a, b], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25)
    ids = [
        json.loads(line)["sample_id"]
        for split in ("train", "heldout")
        for line in (tmp_path / "out" / f"{split}.jsonl").read_text().splitlines()
    ]
    assert len(ids) == len(set(ids)) == 16 == res.train_rows + res.heldout_rows
    assert {"d1/r:1", "d2/r:1"} <= set(ids)
    # one input alone keeps the documented FILE-STEM:LINE ids
    import_rollouts([a], CharTokenizer(), tmp_path / "one", fields=GENERIC, heldout_fraction=0.0)
    assert json.loads((tmp_path / "one" / "train.jsonl").read_text().splitlines()[0])["sample_id"] == "r:1"
    # the same file twice still repeats its ids, refused by name
    with pytest.raises(InputError, match="sample id 'r:1' repeats"):
        import_rollouts([a, a], CharTokenizer(), tmp_path / "twice", fields=GENERIC, heldout_fraction=0.0)


# ---- defect 8: refusals are located at the input row, not in a staged file -----------------------------------


def test_an_mse_reward_beyond_the_limit_is_located_at_its_input_line(tmp_path):
    """The dataset rules ran only on the staged train.jsonl: the refusal named a temporary file
    (deleted by then) and its line, not the input's file:line."""
    recs = records(prompts=4, samples=2)
    recs[5]["reward"] = 1e300
    src = write_jsonl(tmp_path / "r.jsonl", recs)
    with pytest.raises(InputError) as err:
        import_rollouts(
            [src], CharTokenizer(), tmp_path / "out", fields=GENERIC, loss_type="mse", heldout_fraction=0.25
        )
    assert err.value.where == f"{src}:6" and "1e+300" in err.value.message
    assert files_under(tmp_path) == ["r.jsonl"]


def test_a_token_beyond_the_vocabulary_is_located_at_its_input_line(tmp_path):
    class SmallVocab(CharTokenizer):
        vocab_size = 100

    src = write_jsonl(tmp_path / "r.jsonl", records(prompts=4, samples=2))
    with pytest.raises(InputError) as err:
        import_rollouts([src], SmallVocab(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25)
    assert err.value.where == f"{src}:1" and "vocabulary size 100" in err.value.message


def test_a_refusal_of_the_staged_file_is_mapped_back_to_the_input_row(tmp_path):
    """What the staged file's validation still finds is named at the input row it was made from."""
    from value_assets.core.rollouts import _at_input, _Row

    staged = tmp_path / ".out.x" / "train.jsonl"
    rows = [_Row("a", "g", [1, 2], 1, 0.0, "in.jsonl:3"), _Row("b", "g", [1, 2], 1, 0.0, "in.jsonl:7")]
    mapped = _at_input(InputError(f"{staged}:2", "a rule"), staged, rows)
    assert (mapped.where, mapped.message) == ("in.jsonl:7", "a rule (in the imported row)")
    other = _at_input(InputError(str(staged), "file-level"), staged, rows)
    assert (other.where, other.message) == (str(staged), "file-level")


# ---- defect 13: --max-seq-len refuses at import what training would refuse ------------------------------------


def test_max_seq_len_refuses_a_long_row_at_import(tmp_path):
    recs = records(prompts=4, samples=2)
    recs[3]["response"] = "x" * 5000
    src = write_jsonl(tmp_path / "r.jsonl", recs)
    with pytest.raises(InputError) as err:
        import_rollouts(
            [src], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25, max_seq_len=512
        )
    assert err.value.where == f"{src}:4" and "exceed --max-seq-len 512" in err.value.message
    res = import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25)
    assert res.longest_row_tokens > 5000 and res.longest_row_where == f"{src}:4"  # what the CLI reports


# ---- defect 7: chat roles -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["", "usr", "User", " user"])
def test_unknown_or_empty_chat_roles_are_refused(tmp_path, role):
    """A template renders an unknown or empty role silently (as a role the actor never saw, or not at
    all): the critic would train on prompts the actor never saw."""
    recs = [
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user" if i != 2 else role, "content": f"q{i}"}],
            "response": "a",
            "reward": float(i % 2),
        }
        for i in range(4)
    ]
    src = write_jsonl(tmp_path / "r.jsonl", recs)
    with pytest.raises(InputError, match=r"field 'prompt'\[1\] has role .* not a chat role") as err:
        import_rollouts([src], CharTokenizer(), tmp_path / "out", fields=GENERIC, heldout_fraction=0.25)
    assert err.value.where == f"{src}:3"
    assert files_under(tmp_path) == ["r.jsonl"]


# ---- defect 11: write failures and kills leave nothing, and exit 2 naming the path ---------------------------------


def test_make_demo_data_write_failure_exits_2_naming_the_path_and_leaves_nothing(tmp_path, capsys):
    """make-demo-data wrote its files in place: a full disk (here EFBIG) left a half-written
    train.jsonl and exited 1 'unexpected failure' without a path."""
    out = tmp_path / "out"
    with file_size_limit(64 << 10):
        rc, err = run(capsys, "make-demo-data", out, "--rows", 256, "--heldout-rows", 16)
    assert rc == 2 and f"{out / 'demo' / 'train.jsonl'}: could not publish (File too large)" in err, err
    assert files_under(out) == []  # no train.jsonl, half or whole, and no staging folder


def test_import_rollouts_write_failure_exits_2_naming_the_path_and_leaves_nothing(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", records(prompts=64, samples=8))
    out = tmp_path / "out"
    with file_size_limit(16 << 10), pytest.raises(PublishError) as err:
        import_rollouts([src], CharTokenizer(), out, fields=GENERIC, heldout_fraction=0.25)
    assert f"{out / 'train.jsonl'}: could not publish (File too large)" in str(err.value)
    assert files_under(tmp_path) == ["r.jsonl"]


def test_disk_full_and_read_only_folders_exit_2_and_leave_nothing(tmp_path, capsys):
    with small_tmpfs(tmp_path / "small"):
        rc, err = run(capsys, "make-demo-data", tmp_path / "small", "--rows", 512)
        assert rc == 2 and "No space left on device" in err and str(tmp_path / "small") in err, err
        assert files_under(tmp_path / "small") == []
        src = write_jsonl(tmp_path / "r.jsonl", records(prompts=256, samples=8))
        with pytest.raises(PublishError, match="No space left on device"):
            import_rollouts([src], CharTokenizer(), tmp_path / "small" / "out", fields=GENERIC, heldout_fraction=0.25)
        assert files_under(tmp_path / "small") == []
    with small_tmpfs(tmp_path / "ro", options=",ro"):
        rc, err = run(capsys, "make-demo-data", tmp_path / "ro", "--rows", 8)
        assert rc == 2 and str(tmp_path / "ro") in err and "Read-only file system" in err, err
        with pytest.raises(PublishError, match="Read-only file system"):
            import_rollouts([tmp_path / "r.jsonl"], CharTokenizer(), tmp_path / "ro" / "out", fields=GENERIC)
        # --inbox: the data is written, the manifest in the watched folder is refused: the data goes too
        with pytest.raises(PublishError, match=f"{tmp_path / 'ro' / 'r.json'}: could not publish"):
            import_rollouts(
                [tmp_path / "r.jsonl"],
                CharTokenizer(),
                tmp_path / "out",
                fields=GENERIC,
                inbox=tmp_path / "ro",
                name="r",
            )
        assert not (tmp_path / "out").exists()


_KILLED = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; by default it kills the process
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))  # at the first write past it
if sys.argv[1] == "make-demo-data":
    from value_assets.cli import main
    main(["make-demo-data", sys.argv[2], "--rows", "512"])
else:
    from tests.core.test_rollouts import CharTokenizer
    from value_assets.core.rollouts import PRESETS, import_rollouts
    folder = Path(sys.argv[2])
    import_rollouts([folder / "r.jsonl"], CharTokenizer(), folder / "out", fields=PRESETS["generic"])
"""


@pytest.mark.parametrize("command", ["make-demo-data", "import-rollouts"])
def test_a_process_killed_mid_write_leaves_no_partial_file(tmp_path, command):
    if command == "import-rollouts":
        write_jsonl(tmp_path / "r.jsonl", records(prompts=128, samples=8))
    before = set(files_under(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _KILLED, command, str(tmp_path), str(32 << 10)],
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
    )
    assert done.returncode == -signal.SIGXFSZ, done.stderr[-2000:]
    # At most a hidden staging entry: nothing under a name a reader takes for output.
    left = [p for p in set(files_under(tmp_path)) - before if not any(part.startswith(".") for part in Path(p).parts)]
    assert left == [], left


def _every_command_raises(monkeypatch, exc: BaseException) -> None:
    import value_assets.cli as cli

    parser = cli.build_parser

    def build():
        p = parser()
        for action in p._subparsers._group_actions[0].choices.values():

            def cmd(_args):
                raise exc

            action.set_defaults(func=cmd)
        return p

    monkeypatch.setattr(cli, "build_parser", build)


def test_an_oserror_naming_a_path_exits_2_and_a_bug_exits_1(tmp_path, capsys, monkeypatch):
    """PublishError (a full disk while publishing) exited 1; an environment OSError naming its path
    is the system's refusal of that path (exit 2, named); one without a path is a bug (exit 1)."""
    _every_command_raises(monkeypatch, PublishError(tmp_path / "r.json", OSError(errno.ENOSPC, "No space left")))
    assert main(["plan", "m.json"]) == 2 and f"{tmp_path / 'r.json'}: could not publish" in capsys.readouterr().err
    _every_command_raises(monkeypatch, OSError(errno.EACCES, "Permission denied", str(tmp_path / "x")))
    assert main(["plan", "m.json"]) == 2 and f"{tmp_path / 'x'}: Permission denied (EACCES)" in capsys.readouterr().err
    _every_command_raises(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))  # no path: a bug
    assert main(["plan", "m.json"]) == 1 and "unexpected failure" in capsys.readouterr().err
    _every_command_raises(monkeypatch, KeyError("bug"))
    assert main(["plan", "m.json"]) == 1

    class NotAnException(BaseException):  # torch_dist's CheckpointException is one
        pass

    _every_command_raises(monkeypatch, NotAnException("a writer failed"))
    assert main(["plan", "m.json"]) == 1 and "unexpected failure" in capsys.readouterr().err


def test_evaluate_maps_a_full_disk_like_train(tmp_path, capsys, monkeypatch):
    """`evaluate` publishes with publish_once, whose failure (PublishError) exited 1 where train's
    ENOSPC (InputError) exited 2."""
    pytest.importorskip("torch")
    import value_assets.gpu.drivers.evaluate as ev

    def full(_cfg, log=None):
        raise PublishError(tmp_path / "ev.json", OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(ev, "evaluate", full)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "m.json").write_text("{}")
    rc, err = run(
        capsys,
        "evaluate",
        "--checkpoint",
        tmp_path / "ckpt",
        "--manifest",
        tmp_path / "m.json",
        "--contract-sha256",
        "a" * 64,
        "--report",
        tmp_path / "ev.json",
    )
    assert rc == 2 and f"{tmp_path / 'ev.json'}: could not publish (No space left on device)" in err, err
