"""docs/rules.md#contract: the contract binds every file of its save; loaders verify before deserializing; resume
finds the newest verified contracted save; `value-assets verify` (torch-free)."""

import json
import os
import random
import subprocess
import sys

import pytest

from value_assets.cli import main
from value_assets.core.checkpoint_files import checkpoint_differences, describe_folder, verify_checkpoint
from value_assets.core.chunks import THREADS_ENV
from value_assets.core.contract import (
    CONTRACT_NAME,
    LATEST_NAME,
    build_contract,
    check_resume_recorded,
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
from value_assets.core.strict_json import canonical_bytes

pytestmark = pytest.mark.unit


CB = 64  # bytes per chunk in these tests: __0_0.distcp (700 bytes) is 10 full chunks and a short one


def fake_save(critic, step, payload=b"weights", chunk_bytes=CB, whole_file=False):
    """A step folder shaped like a torch_dist save, contracted like the trainer does it (with
    `whole_file`, as a contract written before chunk digests: {path, size, sha256})."""
    d = critic / iter_dirname(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload * 100)
    (d / ".metadata").write_bytes(b"index" + payload)
    (d / "common.pt").write_bytes(b"common")
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(b"nested")
    files = describe_folder(d, chunk_bytes=chunk_bytes)
    if whole_file:
        files = [
            {"path": f["path"], "size": f["size"], "sha256": sha256_bytes((d / f["path"]).read_bytes())} for f in files
        ]
    c = build_contract(
        manifest_sha256="1" * 64,
        train_sha256="2" * 64,
        objective=Objective().canonical(),
        plan=build_plan(10, 2, 1, 3),
        completed_steps=step,
        model={"kind": "tiny-random", "seed": 0},
        backbone_config={},
        checkpoint=d.name,
        checkpoint_files=files,
    )
    return d, c, write_contract(critic, c)


def naive_chunks(data, chunk_bytes):
    """The reference: a plain loop over slices, one sha each."""
    return [sha256_bytes(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


def test_describe_folder_sorted_with_sizes_and_chunk_shas(tmp_path):
    d, c, _ = fake_save(tmp_path, 2)
    files = c["checkpoint_files"]
    assert [f["path"] for f in files] == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        "sub/x.bin",
    ]  # the contract itself excluded
    assert files[2] == {"path": "common.pt", "size": 6, "chunk_bytes": CB, "chunk_sha256": [sha256_bytes(b"common")]}
    assert len(files[1]["chunk_sha256"]) == 11  # 700 bytes: 10 chunks of 64 and a short one of 60
    assert checkpoint_differences(d, c) == []
    assert load_verified(d)[0] == c


@pytest.mark.parametrize("threads", ["1", "3"])
def test_parallel_chunk_digests_equal_a_sequential_reference(tmp_path, monkeypatch, threads):
    monkeypatch.setenv(THREADS_ENV, threads)
    rng = random.Random(0)
    d = tmp_path / iter_dirname(1)
    d.mkdir()
    sizes = {"a.distcp": 0, "b.distcp": 1, "c.distcp": 63, "d.distcp": 64, "e.distcp": 65, "f.distcp": 64 * 37 + 5}
    blobs = {name: bytes(rng.randrange(256) for _ in range(n)) for name, n in sizes.items()}
    for name, data in blobs.items():
        (d / name).write_bytes(data)
    files = describe_folder(d, chunk_bytes=64)
    assert files == [
        {"path": name, "size": len(data), "chunk_bytes": 64, "chunk_sha256": naive_chunks(data, 64)}
        for name, data in sorted(blobs.items())
    ]
    contract = {"checkpoint": d.name, "checkpoint_files": files}
    assert checkpoint_differences(d, contract) == []
    (d / "f.distcp").write_bytes(b"".join(bytes([b ^ (k % 7 == 3)]) for k, b in enumerate(blobs["f.distcp"])))
    flipped = sorted({k // 64 for k in range(len(blobs["f.distcp"])) if k % 7 == 3})
    named = ", ".join(map(str, flipped[:8]))
    assert checkpoint_differences(d, contract) == [
        f"f.distcp: chunks {named}, ... of 38 (64 bytes each) differ from the contract's digests"
    ]


@pytest.mark.parametrize(
    "where, chunk",
    [(0, 0), (5 * CB + 3, 5), (10 * CB - 1, 9), (10 * CB, 10), (699, 10)],
    ids=["first chunk", "middle chunk", "last full chunk", "short last chunk, first byte", "last byte"],
)
def test_a_flipped_byte_in_any_chunk_is_refused_naming_file_and_chunk(tmp_path, where, chunk):
    d, c, _ = fake_save(tmp_path, 2)
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[where] ^= 0x20
    (d / "__0_0.distcp").write_bytes(bytes(data))
    start = chunk * CB
    end = min(start + CB, 700) - 1
    needle = f"__0_0.distcp: chunk {chunk} of 11 (64 bytes each), bytes {start}..{end}: sha256 "
    assert [x for x in checkpoint_differences(d, c) if needle in x], checkpoint_differences(d, c)
    with pytest.raises(InputError, match="do not match their contract") as ei:
        load_verified(d)
    assert needle in ei.value.message and "the contract binds " + c["checkpoint_files"][1]["chunk_sha256"][chunk] in (
        ei.value.message
    )


@pytest.mark.parametrize(
    "tamper, needle",
    [
        (lambda d: (d / ".metadata").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR."), ".metadata: size"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-1]),
            "__0_0.distcp: size 699, the contract binds 700 (truncated from chunk 10 of 11 on)",
        ),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[: 3 * CB]),
            "__0_0.distcp: size 192, the contract binds 700 (truncated from chunk 3 of 11 on)",
        ),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes() + b"\0"),
            "__0_0.distcp: size 701, the contract binds 700 (grown from chunk 10 of 11 on)",
        ),
        (lambda d: (d / "common.pt").unlink(), "missing file common.pt"),
        (lambda d: (d / "extra.distcp").write_bytes(b""), "extra file extra.distcp"),
        (lambda d: (d / "sub" / "x.bin").write_bytes(b"NESTED"), "sub/x.bin: chunk 0 of 1 (64 bytes each), bytes 0..5"),
    ],
    ids=["index", "truncated by one", "truncated to 3 chunks", "appended byte", "missing", "extra", "nested"],
)
def test_every_difference_is_refused_and_named(tmp_path, tamper, needle):
    d, c, _ = fake_save(tmp_path, 2)
    tamper(d)
    assert any(needle in x for x in checkpoint_differences(d, c)), checkpoint_differences(d, c)
    with pytest.raises(InputError, match="do not match their contract") as ei:
        load_verified(d)
    assert needle in ei.value.message


def test_a_chunk_list_rewritten_without_the_contract_is_refused(tmp_path):
    """The chunk digests live inside the contract, so its sha covers them: a chunk changed and its
    digest rewritten to match makes another contract, which no pin names."""
    d, c, sha = fake_save(tmp_path, 2)
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[5 * CB] ^= 1
    (d / "__0_0.distcp").write_bytes(bytes(data))
    forged = json.loads((d / CONTRACT_NAME).read_bytes())
    forged["checkpoint_files"][1]["chunk_sha256"][5] = sha256_bytes(bytes(data[5 * CB : 6 * CB]))
    (d / CONTRACT_NAME).write_bytes(canonical_bytes(forged))
    assert checkpoint_differences(d, forged) == []  # self-consistent, as a forger makes it
    with pytest.raises(InputError, match=f"contract sha256 is [0-9a-f]{{64}}, but {sha} was pinned"):
        load_verified(d, pinned_sha256=sha)
    with pytest.raises(InputError, match="was pinned"):
        find_resume_point(tmp_path)  # `latest` pins the contract it wrote
    assert main(["verify", str(tmp_path)]) == 2
    with pytest.raises(InputError, match="not one of the 1 saves this lineage's runs recorded"):
        check_resume_recorded(sha256_bytes(canonical_bytes(forged)), [sha], where=str(d))


@pytest.mark.parametrize(
    "edit",
    [
        lambda f: f["chunk_sha256"].pop(),  # a chunk of the file left unbound
        lambda f: f["chunk_sha256"].append("0" * 64),
        lambda f: f.update(chunk_bytes=CB * 2),  # the same digests re-read over other byte ranges
        lambda f: f.update(chunk_bytes=0),
        lambda f: f.update(sha256="0" * 64),  # both forms at once
        lambda f: f["chunk_sha256"].__setitem__(0, "A" * 64),
    ],
    ids=["chunk missing", "chunk extra", "other chunk size", "zero chunk size", "both forms", "not a sha"],
)
def test_a_chunk_list_that_does_not_fit_the_size_is_refused_by_entry(tmp_path, edit):
    d, c, _ = fake_save(tmp_path, 2)
    edit(c["checkpoint_files"][1])
    with pytest.raises(InputError, match=r"checkpoint_files\[1\]: not a file entry .*__0_0\.distcp"):
        verify_checkpoint(d, c)


def test_an_old_whole_file_contract_still_verifies_and_its_tampering_is_refused(tmp_path):
    d, c, _ = fake_save(tmp_path, 2, whole_file=True)
    assert c["checkpoint_files"][2] == {"path": "common.pt", "size": 6, "sha256": sha256_bytes(b"common")}
    assert checkpoint_differences(d, c) == []
    assert load_verified(d)[0] == c
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[650] ^= 1
    (d / "__0_0.distcp").write_bytes(bytes(data))
    (d / "common.pt").write_bytes(b"commo")
    with pytest.raises(InputError, match="do not match their contract") as ei:
        load_verified(d)
    assert (
        "__0_0.distcp: sha256 " in ei.value.message
        and "the contract binds " + c["checkpoint_files"][1]["sha256"] in ei.value.message
    )
    assert "common.pt: size 5, the contract binds 6;" in ei.value.message + ";"


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
    assert "common.pt: chunk 0 of 1" in err and "extra file stray" in err and "2 difference(s)" in err


def test_verify_command_does_not_import_torch(tmp_path):
    d, _, _ = fake_save(tmp_path, 2)
    code = (
        "import sys; from value_assets.cli import main; rc = main(['verify', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
