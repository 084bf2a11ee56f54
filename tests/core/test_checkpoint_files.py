"""docs/rules.md#contract: the contract binds every file of its save; loaders verify before deserializing; resume
finds the newest verified contracted save; `value-assets verify` (torch-free)."""

import os
import subprocess
import sys

import pytest

from value_assets.cli import main
from value_assets.core.checkpoint_files import checkpoint_differences, describe_folder, verify_checkpoint
from value_assets.core.contract import (
    LATEST_NAME,
    build_contract,
    find_resume_point,
    iter_dirname,
    load_verified,
    resolve_step_dir,
    write_contract,
)
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.objective import Objective
from value_assets.core.plan import build_plan

pytestmark = pytest.mark.unit


def fake_save(critic, step, payload=b"weights"):
    """A step folder shaped like a torch_dist save, contracted like the trainer does it."""
    d = critic / iter_dirname(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload * 100)
    (d / ".metadata").write_bytes(b"index" + payload)
    (d / "common.pt").write_bytes(b"common")
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(b"nested")
    c = build_contract(
        manifest_sha256="1" * 64,
        train_sha256="2" * 64,
        objective=Objective().canonical(),
        plan=build_plan(10, 2, 1, 3),
        completed_steps=step,
        model={"kind": "tiny-random", "seed": 0},
        backbone_config={},
        checkpoint=d.name,
        checkpoint_files=describe_folder(d),
    )
    return d, c, write_contract(critic, c)


def test_describe_folder_sorted_with_sizes_and_shas(tmp_path):
    d, c, _ = fake_save(tmp_path, 2)
    files = c["checkpoint_files"]
    assert [f["path"] for f in files] == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        "sub/x.bin",
    ]  # the contract itself excluded
    assert files[2] == {"path": "common.pt", "size": 6, "sha256": sha256_bytes(b"common")}
    assert checkpoint_differences(d, c) == []
    assert load_verified(d)[0] == c


@pytest.mark.parametrize(
    "tamper, needle",
    [
        (lambda d: (d / ".metadata").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR."), ".metadata: size"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes(b"W" + (d / "__0_0.distcp").read_bytes()[1:]),
            "__0_0.distcp: sha256",
        ),
        (lambda d: (d / "common.pt").unlink(), "missing file common.pt"),
        (lambda d: (d / "extra.distcp").write_bytes(b""), "extra file extra.distcp"),
        (lambda d: (d / "sub" / "x.bin").write_bytes(b"NESTED"), "sub/x.bin: sha256"),
    ],
)
def test_every_difference_is_refused_and_named(tmp_path, tamper, needle):
    d, c, _ = fake_save(tmp_path, 2)
    tamper(d)
    assert any(needle in x for x in checkpoint_differences(d, c)), checkpoint_differences(d, c)
    with pytest.raises(InputError, match="do not match their contract") as ei:
        load_verified(d)
    assert needle in ei.value.message


def test_a_symlinked_file_is_never_followed(tmp_path):
    d, c, _ = fake_save(tmp_path, 2)
    (tmp_path / "elsewhere").write_bytes(b"common")
    (d / "common.pt").unlink()
    os.symlink(tmp_path / "elsewhere", d / "common.pt")
    assert checkpoint_differences(d, c) == ["common.pt is not a regular file"]
    with pytest.raises(InputError, match="only regular files"):
        describe_folder(d)


def test_a_save_moved_to_another_step_folder_is_refused(tmp_path):
    d, c, _ = fake_save(tmp_path, 2)
    moved = tmp_path / iter_dirname(4)
    d.rename(moved)
    with pytest.raises(InputError, match="binds checkpoint 'iter_0000002', but it sits in iter_0000004"):
        verify_checkpoint(moved, c)


def test_a_contract_without_a_binding_cannot_be_verified(tmp_path):
    d, c, _ = fake_save(tmp_path, 2)
    with pytest.raises(InputError, match="binds no checkpoint files"):
        verify_checkpoint(d, {k: v for k, v in c.items() if k != "checkpoint_files"})
    bad = dict(c, checkpoint_files=[{"path": "../../etc/passwd", "size": 1, "sha256": "3" * 64}])
    with pytest.raises(InputError, match="unique relative path"):
        verify_checkpoint(d, bad)


# ---- resume point ---------------------------------------------------------------------------------


def test_resume_point_is_the_newest_verified_contract_when_latest_lags_or_is_gone(tmp_path):
    _, _, sha4 = fake_save(tmp_path, 4)
    d8, _, sha8 = fake_save(tmp_path, 8)
    logs = []
    assert find_resume_point(tmp_path, logs.append)[0::2] == (d8, sha8)
    assert logs == []
    # the crash window: the contract of step 8 is written, `latest` still names step 4
    (tmp_path / LATEST_NAME).write_text(f'{{"contract_sha256":"{sha4}","iteration":"iter_0000004"}}\n')
    assert find_resume_point(tmp_path, logs.append)[0::2] == (d8, sha8)
    assert "newer contract" in logs[-1]
    (tmp_path / LATEST_NAME).unlink()
    assert find_resume_point(tmp_path, logs.append)[0::2] == (d8, sha8)
    assert "missing" in logs[-1]


def test_resume_point_refuses_a_newest_save_that_does_not_verify(tmp_path):
    fake_save(tmp_path, 4)
    d8, _, _ = fake_save(tmp_path, 8)
    (d8 / "__0_0.distcp").write_bytes((tmp_path / iter_dirname(4) / "__0_0.distcp").read_bytes() + b"x")
    with pytest.raises(InputError, match="__0_0.distcp: size"):
        find_resume_point(tmp_path)


def test_resume_point_uncontracted_folders(tmp_path):
    assert find_resume_point(tmp_path) is None
    (tmp_path / iter_dirname(5)).mkdir()
    with pytest.raises(InputError, match="iteration 5 has no contract"):
        find_resume_point(tmp_path)
    # an interrupted save above a contracted one is simply redone by the run
    d3, _, sha3 = fake_save(tmp_path, 3)
    assert find_resume_point(tmp_path)[0::2] == (d3, sha3)


def test_resolve_step_dir(tmp_path):
    d, _, sha = fake_save(tmp_path, 2)
    assert resolve_step_dir(d) == (d, None)
    assert resolve_step_dir(tmp_path) == (d, sha)
    (tmp_path / LATEST_NAME).unlink()
    with pytest.raises(InputError, match="iter_0000002: name one of them"):
        resolve_step_dir(tmp_path)


# ---- value-assets verify --------------------------------------------------------------------------


def test_verify_command(tmp_path, capsys):
    d, _, sha = fake_save(tmp_path, 2)
    assert main(["verify", str(tmp_path)]) == 0
    assert f"4 files match contract {sha}" in capsys.readouterr().out
    assert main(["verify", str(d), "--contract-sha256", sha]) == 0
    assert main(["verify", str(d), "--contract-sha256", "0" * 64]) == 2
    assert "was pinned" in capsys.readouterr().err
    (d / "common.pt").write_bytes(b"COMMON")
    (d / "stray").write_bytes(b"")
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "common.pt: sha256" in err and "extra file stray" in err and "2 difference(s)" in err


def test_verify_command_does_not_import_torch(tmp_path):
    d, _, _ = fake_save(tmp_path, 2)
    code = (
        "import sys; from value_assets.cli import main; rc = main(['verify', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
