"""The command line (validate, plan, make-demo-data) and the import layering of value_assets.core."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.core.coretest_helpers import dumps, row
from value_assets.cli import main
from value_assets.core.hashing import sha256_bytes, sha256_file
from value_assets.core.plan import build_plan
from value_assets.core.strict_json import canonical_bytes

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.fixture
def demo(tmp_path, capsys):
    rc, out, _ = run(capsys, "make-demo-data", tmp_path / "d", "--rows", 40, "--heldout-rows", 16, "--seed", 3)
    assert rc == 0
    return Path(out.strip())


def test_validate_json_fields(demo, capsys):
    before = snapshot(demo.parent)
    rc, out, err = run(capsys, "validate", demo, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["manifest"] == str(demo) and doc["sha256"] == sha256_file(demo)
    assert doc["objective"] == {
        "loss_type": "classification",
        "num_bins": 51,
        "reward_range": [0.0, 1.0],
        "target_type": "hl_gauss",
        "hl_gauss_sigma_ratio": 0.75,
    }
    for split, n in (("train", 40), ("heldout", 16)):
        d = doc[split]
        assert d["path"] == str(demo.parent / "demo" / f"{split}.jsonl")
        assert d["sha256"] == sha256_file(d["path"]) and d["rows"] == n
        rows = [json.loads(line) for line in Path(d["path"]).read_text().splitlines()]
        assert d["tokens"] == sum(len(r["tokens"]) for r in rows)
        assert d["active_targets"] == sum(sum(r.get("loss_mask", [1] * r["response_length"])) for r in rows)
        assert sum(d["label_counts"].values()) == n and set(d["label_counts"]) <= {"0.0", "1.0"}
        assert d["max_tokens"] == max(len(r["tokens"]) for r in rows)
    assert snapshot(demo.parent) == before  # validate never writes


def test_validate_human_output(demo, capsys):
    rc, out, _ = run(capsys, "validate", demo)
    assert rc == 0 and "train" in out and "heldout" in out and sha256_file(demo) in out


def _manifest(tmp_path, lines, n, **extra):
    data = tmp_path / "t.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    m = {
        "schema": "miles.value-pretrain.v1",
        "train": {"path": "t.jsonl", "sha256": sha256_file(data), "num_samples": n},
        "objective": {},
        **extra,
    }
    p = tmp_path / "m.json"
    p.write_text(json.dumps(m))
    return p, data


def test_validate_bad_row_exit_2_one_paragraph(tmp_path, capsys):
    p, data = _manifest(tmp_path, [dumps(row("a")), b"", dumps(row("b", returns=[1.0, 1.75]))], 2)
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, "validate", p, "--json")
    assert rc == 2 and out == ""
    assert f"{data}:3" in err and "1.75" in err and "returns[1]" in err
    assert err.count("\n") == 1 and err.startswith("value-assets: error:")
    assert snapshot(tmp_path) == before


def test_validate_vocab_and_pin_and_roots(tmp_path, capsys, monkeypatch):
    p, data = _manifest(tmp_path, [dumps(row("a", tokens=[1, 2, 300]))], 1)
    rc, _, err = run(capsys, "validate", p, "--vocab-size", 300)
    assert rc == 2 and "300" in err and f"{data}:1" in err
    rc, _, err = run(capsys, "validate", p, "--max-seq-len", 2)
    assert rc == 2 and "len(tokens) = 3" in err
    rc, _, err = run(capsys, "validate", p, "--manifest-sha256", "F" * 64)
    assert rc == 2 and "F" * 64 in err
    rc, _, err = run(capsys, "validate", p, "--manifest-sha256", "f" * 64)
    assert rc == 2 and "f" * 64 in err and sha256_file(p) in err
    rc, _, _ = run(capsys, "validate", p, "--manifest-sha256", sha256_file(p))
    assert rc == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rc, _, err = run(capsys, "validate", p, "--data-root", elsewhere)
    assert rc == 2 and "data roots" in err and str(data) in err
    monkeypatch.setenv("VALUE_ASSETS_DATA_ROOTS", str(elsewhere))
    rc, _, err = run(capsys, "validate", p)
    assert rc == 2 and "data roots" in err
    monkeypatch.setenv("VALUE_ASSETS_DATA_ROOTS", str(tmp_path))
    rc, _, err = run(capsys, "validate", p)
    assert rc == 0, err


def test_validate_bad_arguments_exit_2(tmp_path, capsys):
    rc, _, err = run(capsys, "validate", tmp_path / "missing.json")
    assert rc == 2 and "missing.json" in err and "does not exist" in err
    rc, _, err = run(capsys, "validate", tmp_path / "m.json", "--vocab-size", "-4")
    assert rc == 2 and "-4" in err
    rc, _, err = run(capsys, "frobnicate")
    assert rc == 2 and "frobnicate" in err


def test_plan_json(tmp_path, capsys):
    p, _ = _manifest(tmp_path, [dumps(row(f"r{i}")) for i in range(7)], 7)
    rc, out, err = run(capsys, "plan", p, "--global-batch-size", 3, "--seed", 0, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    plan = build_plan(7, 3, 1, 0)
    assert doc["sha256"] == plan.sha256 and doc["steps"] == [[4, 2, 1], [0, 5, 3]] and doc["num_steps"] == 2
    assert doc["dropped"] == 1 and doc["repeated"] == 0
    body = {k: v for k, v in doc.items() if k not in ("sha256", "dropped", "repeated")}
    assert sha256_bytes(canonical_bytes(body)) == doc["sha256"]  # the plan artifact hashes to its sha
    rc, out, _ = run(capsys, "plan", p, "--global-batch-size", 2, "--epochs", 2, "--seed", 17, "--json")
    assert json.loads(out)["num_steps"] == 6


def test_plan_exact_coverage_and_errors(tmp_path, capsys):
    p, _ = _manifest(tmp_path, [dumps(row(f"r{i}")) for i in range(12)], 12)
    rc, out, _ = run(capsys, "plan", p, "--gpus", 8, "--max-global-batch-size", 8, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert (doc["dp"], doc["global_batch_size"], doc["dropped"], doc["repeated"]) == (6, 6, 0, 0)
    rc, _, err = run(capsys, "plan", p, "--global-batch-size", 13)
    assert rc == 2 and "13" in err and "12" in err
    rc, _, err = run(capsys, "plan", p)
    assert rc == 2 and "--global-batch-size" in err
    rc, _, err = run(capsys, "plan", p, "--gpus", 2)
    assert rc == 2 and "--max-global-batch-size" in err
    rc, _, err = run(capsys, "plan", p, "--gpus", 2, "--max-global-batch-size", 4, "--global-batch-size", 2)
    assert rc == 2
    rc, _, err = run(capsys, "plan", p, "--global-batch-size", 0)
    assert rc == 2 and "0" in err


@pytest.mark.parametrize(
    "args, needle",
    [(["--rows", "0"], "0"), (["--heldout-rows", "-1"], "-1"), (["--format", "csv"], "csv"), (["--rows", "x"], "x")],
)
def test_make_demo_data_bad_args_write_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    rc, _, err = run(capsys, "make-demo-data", out, *args)
    assert rc == 2 and needle in err
    assert not out.exists()


def _split_rows(manifest: Path, split: str):
    m = json.loads(manifest.read_text())
    return [json.loads(line) for line in (manifest.parent / m[split]["path"]).read_text().splitlines()]


def _oracle_ev(rows) -> float:
    """Trajectory EV of predicting the generator's task probability p (known from the task token)."""
    from value_assets.core.demo_data import TASK_P, TASK_TOKENS

    p = np.array([TASK_P[list(TASK_TOKENS).index(r["tokens"][0])] for r in rows])
    y = np.array([r["returns"][0] for r in rows])
    return float(1 - np.var(y - p) / np.var(y))


def _best_task_predictor_ev(rows) -> float:
    """EV of the best predictor that sees the task token: the per-task mean label (in-sample)."""
    y = np.array([r["returns"][0] for r in rows])
    task = np.array([r["tokens"][0] for r in rows])
    pred = np.zeros_like(y)
    for t in np.unique(task):
        pred[task == t] = y[task == t].mean()
    return float(1 - np.var(y - pred) / np.var(y))


def _make_pair(tmp_path, capsys):
    rc, out, _ = run(capsys, "make-demo-data", tmp_path, "--rows", 400, "--heldout-rows", 400, "--seed", 1)
    rc2, out2, _ = run(
        capsys, "make-demo-data", tmp_path, "--rows", 400, "--heldout-rows", 400, "--seed", 1, "--shuffle-labels"
    )
    assert rc == rc2 == 0
    return Path(out.strip()), Path(out2.strip())


def test_make_demo_data_learnable_and_shuffled(tmp_path, capsys):
    good, shuffled = _make_pair(tmp_path, capsys)
    assert good.name == "demo.json" and shuffled.name == "demo-shuffled.json"
    prov = json.loads(good.read_text())["provenance"]
    assert prov["shuffle_labels"] is False and json.loads(shuffled.read_text())["provenance"]["shuffle_labels"] is True
    g_ev = prov["bayes_optimal_trajectory_ev_heldout"]
    assert g_ev > 0.15 and abs(g_ev - _oracle_ev(_split_rows(good, "heldout"))) < 1e-9
    # the signal is learnable in the real data, and gone from the shuffled control (8 groups, 400 rows)
    for split in ("train", "heldout"):
        assert _best_task_predictor_ev(_split_rows(good, split)) > 0.15
        assert _best_task_predictor_ev(_split_rows(shuffled, split)) < 0.05
    for m in (good, shuffled):
        assert run(capsys, "validate", m)[0] == 0


def test_shuffled_control_provenance_ev_is_about_zero(tmp_path, capsys):
    _, shuffled = _make_pair(tmp_path, capsys)
    assert abs(json.loads(shuffled.read_text())["provenance"]["bayes_optimal_trajectory_ev_heldout"]) < 0.05


def test_make_demo_data_parquet_validates(tmp_path, capsys):
    rc, out, _ = run(capsys, "make-demo-data", tmp_path, "--rows", 30, "--heldout-rows", 10, "--format", "parquet")
    assert rc == 0
    rc, out, err = run(capsys, "validate", out.strip(), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["train"]["format"] == "parquet" and doc["train"]["rows"] == 30


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_make_demo_data_output_always_validates(tmp_path, capsys):
    rc, out, _ = run(capsys, "make-demo-data", tmp_path, "--rows", 4, "--heldout-rows", 1)
    assert rc == 0
    rc, _, err = run(capsys, "validate", out.strip())
    assert rc == 0, err


def test_make_demo_data_unusable_out_dir_exit_2(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    rc, _, err = run(capsys, "make-demo-data", f / "sub", "--rows", 4)
    assert rc == 2 and str(f) in err


def test_real_subprocess_exit_codes(tmp_path):
    exe = Path(sys.executable).parent / "value-assets"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "value_assets.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p, data = _manifest(tmp_path, [dumps(row("a")), dumps(row("a"))], 2)
    res = subprocess.run(cmd + ["validate", str(p)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    assert "duplicate sample_id" in res.stderr and f"{data}:2" in res.stderr and "'a'" in res.stderr
    assert "Traceback" not in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "value_assets.cli", "plan", str(p), "--global-batch-size", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0 and json.loads(res.stdout)["num_steps"] == 2


def test_core_imports_no_heavy_frameworks():
    code = (
        "import importlib, pkgutil, sys, value_assets.core as c\nmods = [m.name for m in "
        "pkgutil.iter_modules(c.__path__)]\nassert len(mods) >= 14, mods\nfor m in mods: "
        "importlib.import_module('value_assets.core.' + m)\nimport value_assets.cli\nbad = sorted(n for n in "
        "sys.modules if n.split('.')[0] in ('dagster', 'torch', 'ray', 'megatron'))\nprint(len(mods), bad)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("[]"), res.stdout


def _options(parser):
    """(command, action) of every option of every subcommand (recursively), --help and --version aside."""
    import argparse

    for action in parser._actions:  # argparse has no public walk over its actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for command, option in _options(sub):
                    yield f"{name} {command}".strip(), option
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield "", action


def test_every_option_has_help_and_shows_its_default():
    from value_assets.cli import build_parser

    options = list(_options(build_parser()))
    assert {command.split()[0] for command, _ in options} >= {"validate", "plan", "make-demo-data", "train", "evaluate"}
    no_help = [f"{c} {a.option_strings[0]}" for c, a in options if not (a.help or "").strip()]
    assert no_help == []
    hidden_default = [
        f"{c} {a.option_strings[0]}"
        for c, a in options
        if a.default is not None and a.default is not False and "%(default)s" not in a.help
    ]
    assert hidden_default == []
    import argparse

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for sub in subparsers.choices.values():  # every help renders: a stray % in a help text would raise
        assert sub.format_help().startswith("usage: ")


def test_the_parser_builds_from_a_source_checkout_without_package_metadata(monkeypatch, capsys):
    """Run from source (PYTHONPATH, as on the accelerator machine) there is no installed
    distribution: `--version` says so instead of every command failing to start."""
    import importlib.metadata

    from value_assets import cli

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0 and "not installed: run from source" in capsys.readouterr().out
