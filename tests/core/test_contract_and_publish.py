"""docs/rules.md#training-run, docs/rules.md#contract contracts and resume rules; docs/rules.md#evaluation,
docs/rules.md#bad-input-and-safety write-once publication (incl. concurrency)."""

import json
import multiprocessing as mp
import os
import re

import pytest

from value_assets.core.contract import (
    CONTRACT_NAME,
    build_contract,
    build_receipt,
    check_resume,
    iter_dirname,
    load_contract,
    read_latest,
    refuse_uncontracted,
    write_contract,
)
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.objective import Objective
from value_assets.core.plan import build_plan
from value_assets.core.publish import atomic_write, publish_once, read_sidecar, sha_sidecar, verify_published

pytestmark = pytest.mark.unit

M, T = "1" * 64, "2" * 64
OBJ = Objective().canonical()


def contract(steps=2, plan=None, **over):
    plan = plan or build_plan(10, 2, 1, 3)
    c = build_contract(
        manifest_sha256=M,
        train_sha256=T,
        objective=OBJ,
        plan=plan,
        completed_steps=steps,
        model={"name": "tiny", "path": "/ckpt/actor"},
        backbone_config={"layers": 2, "hidden": 8},
        checkpoint=iter_dirname(steps),
        checkpoint_files=[{"path": "common.pt", "size": 1, "sha256": "3" * 64}],
    )
    c.update(over)
    return c


def test_contract_fields():
    plan = build_plan(10, 2, 1, 3)
    c = contract(plan=plan)
    assert c["batch_plan"] == {
        "seed": 3,
        "global_batch_size": 2,
        "drop_incomplete_batch": True,
        "algorithm": c["batch_plan"]["algorithm"],
    }
    assert c["batch_plan_sha256"] == plan.sha256 and c["objective"] == OBJ
    assert c["source_manifest_sha256"] == M and c["train_dataset_sha256"] == T and c["completed_steps"] == 2


def test_write_contract_canonical_bytes_and_latest(tmp_path):
    (tmp_path / iter_dirname(2)).mkdir()
    c = contract()
    sha = write_contract(tmp_path, c)
    f = tmp_path / iter_dirname(2) / CONTRACT_NAME
    data = f.read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert data == (json.dumps(c, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    assert sha == sha256_bytes(data)
    assert load_contract(f) == (c, sha)
    assert load_contract(tmp_path / iter_dirname(2)) == (c, sha)  # a step folder works too
    assert load_contract(f, pinned_sha256=sha)[1] == sha
    assert read_latest(tmp_path) == (tmp_path / iter_dirname(2), sha)
    # a later save moves `latest`; the earlier contract stays
    (tmp_path / iter_dirname(4)).mkdir()
    sha4 = write_contract(tmp_path, contract(steps=4))
    assert read_latest(tmp_path) == (tmp_path / iter_dirname(4), sha4)
    assert load_contract(f)[1] == sha
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_write_contract_needs_checkpoint_folder(tmp_path):
    with pytest.raises(InputError) as ei:
        write_contract(tmp_path, contract())
    assert iter_dirname(2) in str(ei.value) and "checkpoint" in str(ei.value)
    assert not (tmp_path / "latest").exists()


def test_read_latest_absent_and_malformed(tmp_path):
    assert read_latest(tmp_path) is None
    (tmp_path / "latest").write_text('{"iteration":"iter_0000002","contract_sha256":"XYZ"}\n')
    with pytest.raises(InputError, match="XYZ"):
        read_latest(tmp_path)
    (tmp_path / "latest").write_text('{"iteration":2}\n')
    with pytest.raises(InputError, match="malformed"):
        read_latest(tmp_path)


def test_load_contract_pin_checked_before_parse(tmp_path):
    f = tmp_path / CONTRACT_NAME
    f.write_bytes(b"not json at all")
    with pytest.raises(InputError) as ei:
        load_contract(f, pinned_sha256="3" * 64)
    assert "3" * 64 in str(ei.value) and sha256_bytes(b"not json at all") in str(ei.value)
    with pytest.raises(InputError, match="invalid JSON"):
        load_contract(f, pinned_sha256=sha256_bytes(b"not json at all"))
    for bad in ["3" * 63, "A" * 64, 5]:
        with pytest.raises(InputError, match="pinned"):
            load_contract(f, pinned_sha256=bad)


def test_load_contract_refuses_non_canonical_and_incomplete(tmp_path):
    c = contract()
    f = tmp_path / CONTRACT_NAME
    for text in [
        json.dumps(c, sort_keys=True),
        json.dumps(c, sort_keys=True, separators=(",", ":")),
        json.dumps(c, separators=(",", ":")) + "\n",
        json.dumps(c, sort_keys=True, indent=1) + "\n",
    ]:
        if text.encode() == (json.dumps(c, sort_keys=True, separators=(",", ":")) + "\n").encode():
            continue
        f.write_text(text)
        with pytest.raises(InputError, match="canonical"):
            load_contract(f)
    partial = {k: v for k, v in c.items() if k != "batch_plan_sha256"}
    f.write_bytes((json.dumps(partial, sort_keys=True, separators=(",", ":")) + "\n").encode())
    with pytest.raises(InputError, match="batch_plan_sha256"):
        load_contract(f)
    f.write_bytes(b'{"schema":"x"}\n')
    with pytest.raises(InputError, match="not a"):
        load_contract(f)
    with pytest.raises(InputError, match="does not exist"):
        load_contract(tmp_path / "nope.json")
    f.write_bytes(b'{"schema":"a","schema":"a"}\n')
    with pytest.raises(InputError, match="duplicate"):
        load_contract(f)


def _resume(c, **over):
    args = dict(
        where="ckpt",
        manifest_sha256=M,
        train_sha256=T,
        objective=OBJ,
        plan=build_plan(10, 2, 1, 3),
        model={"name": "tiny", "path": "/ckpt/actor"},
        loaded_iterations=[2, 2],
    )
    args.update(over)
    return check_resume(c, **args)


def test_check_resume_accepts_and_allows_more_epochs():
    assert _resume(contract()) == 2
    assert _resume(contract(steps=5), loaded_iterations=[5]) == 5  # the whole plan done
    assert _resume(contract(steps=5), plan=build_plan(10, 2, 3, 3), loaded_iterations=[5]) == 5
    assert _resume(contract(steps=0), loaded_iterations=[0]) == 0


def test_check_resume_identifies_the_backbone_by_its_weights_not_its_tokenizer():
    """The HF backbone's identity records the actor's tokenizer sha for the exports (export-hf carries
    the files): a contract written before that record, or one whose actor folder's tokenizer changed
    since, still resumes; the weights' digest still decides."""
    hf = {"kind": "huggingface", "path": "/a", "sha256": "1" * 64}
    assert _resume(contract(model=hf), model={**hf, "tokenizer_sha256": "2" * 64}) == 2
    assert _resume(contract(model={**hf, "tokenizer_sha256": "3" * 64}), model={**hf, "tokenizer_sha256": None}) == 2
    with pytest.raises(InputError, match="bootstrap model"):
        _resume(contract(model=hf), model={**hf, "sha256": "4" * 64, "tokenizer_sha256": "2" * 64})


def _template(msg):
    """The message with its values masked: what stays is the rule's own wording."""
    msg = re.sub(r"[0-9a-f]{64}", "SHA", msg)
    msg = re.sub(r"\{.*?\}", "OBJ", msg)
    return re.sub(r"\d+", "N", msg)


def test_check_resume_refusals_each_distinct():
    other_obj = dict(OBJ, num_bins=21)
    cases = [
        (dict(manifest_sha256="9" * 64), "manifest"),
        (dict(train_sha256="9" * 64), "train dataset"),
        (dict(objective=other_obj), "objective"),
        (dict(plan=build_plan(10, 2, 1, 4)), "batch plan"),
        (dict(plan=build_plan(10, 5, 1, 3)), "batch plan"),
        (dict(model={"name": "other", "path": "/ckpt/actor2"}), "bootstrap model"),
        (dict(loaded_iterations=[2, 3]), "ranks"),
        (dict(loaded_iterations=[3, 3]), "iteration 3"),
    ]
    messages = []
    for over, needle in cases:
        with pytest.raises(InputError) as ei:
            _resume(contract(), **over)
        assert needle in ei.value.message and ei.value.where == "ckpt"
        messages.append(_template(ei.value.message))
    with pytest.raises(InputError) as ei:
        _resume(contract(steps=6), loaded_iterations=[6])
    assert "beyond the plan" in ei.value.message and "6" in ei.value.message and "5" in ei.value.message
    messages.append(_template(ei.value.message))
    with pytest.raises(InputError) as ei:
        refuse_uncontracted(3, "ckpt")
    assert "no contract" in ei.value.message and "3" in ei.value.message
    messages.append(_template(ei.value.message))
    # every rule has its own message (the two plan cases share one)
    assert len(set(messages)) == len(messages) - 1, messages
    refuse_uncontracted(0, "ckpt")


def test_check_resume_messages_name_both_values():
    with pytest.raises(InputError) as ei:
        _resume(contract(), manifest_sha256="9" * 64)
    assert M in ei.value.message and "9" * 64 in ei.value.message
    with pytest.raises(InputError) as ei:
        _resume(contract(), loaded_iterations=[2, 7])
    assert "7" in ei.value.message


def test_receipt():
    plan = build_plan(10, 2, 1, 3)
    r = build_receipt(manifest_sha256=M, train_sha256=T, plan=plan, first_batch_sample_ids=["a", "b"])
    assert r["promotable"] is False and r["executed_steps"] == 1 and r["batch_plan_sha256"] == plan.sha256
    assert r["first_batch_sample_ids_sha256"] == sha256_bytes(b'["a","b"]\n')
    assert r["source_manifest_sha256"] == M and r["train_dataset_sha256"] == T


# --- publication ---------------------------------------------------------------------------------


def test_publish_once_and_sidecar(tmp_path):
    p = tmp_path / "sub" / "report.json"
    sha = publish_once(p, b"hello\n")
    assert p.read_bytes() == b"hello\n" and sha == sha256_bytes(b"hello\n")
    assert sha_sidecar(p) == tmp_path / "sub" / "report.json.sha256"
    assert sha_sidecar(p).read_text() == f"{sha}  report.json\n"
    assert read_sidecar(sha_sidecar(p)) == sha
    assert publish_once(p, b"hello\n") == sha  # identical: no-op
    with pytest.raises(InputError) as ei:
        publish_once(p, b"other\n")
    assert str(p) in str(ei.value) and sha in str(ei.value)
    assert p.read_bytes() == b"hello\n" and read_sidecar(sha_sidecar(p)) == sha
    assert verify_published(p) == sha and verify_published(p, sha) == sha
    with pytest.raises(InputError):
        verify_published(p, "0" * 64)
    assert sorted(x.name for x in p.parent.iterdir()) == ["report.json", "report.json.sha256"]


def test_publish_once_completes_missing_sidecar(tmp_path):
    p = tmp_path / "r.json"
    p.write_bytes(b"x")
    publish_once(p, b"x")
    assert read_sidecar(sha_sidecar(p)) == sha256_bytes(b"x")


def test_publish_once_refuses_other_sidecar(tmp_path):
    p = tmp_path / "r.json"
    sha_sidecar(p).write_text("0" * 64 + "  r.json\n")
    with pytest.raises(InputError, match="sidecar"):
        publish_once(p, b"x")


def test_verify_published_detects_tampering(tmp_path):
    p = tmp_path / "r.json"
    publish_once(p, b"x")
    os.chmod(p, 0o644)
    p.write_bytes(b"y")
    with pytest.raises(InputError, match="sidecar"):
        verify_published(p)
    with pytest.raises(InputError, match="missing"):
        verify_published(tmp_path / "none.json")


@pytest.mark.parametrize("dangling", [False, True])
def test_publish_once_never_follows_symlink(tmp_path, dangling):
    target = tmp_path / "target.txt"
    if not dangling:
        target.write_bytes(b"original")
    dest = tmp_path / "report.json"
    os.symlink(target, dest)
    with pytest.raises(InputError, match="symlink"):
        publish_once(dest, b"attack")
    assert dest.is_symlink()
    if dangling:
        assert not target.exists()
    else:
        assert target.read_bytes() == b"original"
    assert not sha_sidecar(dest).exists()
    with pytest.raises(InputError):
        verify_published(dest)
    assert not [x for x in tmp_path.iterdir() if x.name.endswith(".tmp")]


def test_publish_once_symlink_with_identical_content_still_refused(tmp_path):
    target = tmp_path / "target.txt"
    target.write_bytes(b"same")
    os.symlink(target, tmp_path / "r.json")
    with pytest.raises(InputError):
        publish_once(tmp_path / "r.json", b"same")


def test_atomic_write_replaces(tmp_path):
    p = tmp_path / "a" / "c.json"
    assert atomic_write(p, b"one") == sha256_bytes(b"one")
    assert atomic_write(p, b"two") == sha256_bytes(b"two")
    assert p.read_bytes() == b"two"
    assert [x.name for x in p.parent.iterdir()] == ["c.json"]


def _publisher(args):
    path, i, barrier = args
    barrier.wait(timeout=30)
    try:
        publish_once(path, f"payload from publisher {i}\n".encode() * (i + 1))
        return i
    except InputError:
        return None


def _worker(path, i, barrier, q):
    q.put((i, _publisher((path, i, barrier))))


def test_concurrent_publishers_one_winner(tmp_path):
    ctx = mp.get_context("fork")
    path = tmp_path / "report.json"
    barrier = ctx.Barrier(16)
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(path, i, barrier, q)) for i in range(16)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    winners = [w for _, w in results if w is not None]
    assert len(winners) == 1, results
    w = winners[0]
    expected = f"payload from publisher {w}\n".encode() * (w + 1)
    assert path.read_bytes() == expected
    assert read_sidecar(sha_sidecar(path)) == sha256_bytes(expected)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["report.json", "report.json.sha256"]
    assert all(p.exitcode == 0 for p in procs)


def test_saved_contracts_reads_only_the_driver_lines_about_this_folder(tmp_path):
    from value_assets.core.contract import saved_contracts, saved_line

    critic = tmp_path / "critic"
    a, b = "a" * 64, "b" * 64
    lines = [
        saved_line(critic / iter_dirname(4), a),
        saved_line(tmp_path / "other" / iter_dirname(8), b),  # another folder
        f"invalid input: x.jsonl:3: value {saved_line(critic / iter_dirname(8), b)!r}",  # quoted inside other text
        saved_line(critic / iter_dirname(8), b) + " ",  # not the whole line
        None,  # Dagster log records without a user message
        "saved " + str(critic / iter_dirname(9)) + " with contract " + "C" * 64,  # not a sha
    ]
    assert saved_contracts(lines, critic) == {a}
    assert saved_contracts([], critic) == set()


def test_a_resume_point_the_lineage_did_not_record_is_refused():
    from value_assets.core.contract import check_resume_recorded

    check_resume_recorded("a" * 64, None, where="iter_0000004")  # by hand: any verified save
    check_resume_recorded("a" * 64, ("b" * 64, "a" * 64), where="iter_0000004")
    for recorded in ((), ("b" * 64,)):
        with pytest.raises(InputError, match=r"iter_0000004.*refusing to resume: its contract a{64} is not one of the"):
            check_resume_recorded("a" * 64, recorded, where="iter_0000004")
