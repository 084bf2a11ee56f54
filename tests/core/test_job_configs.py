"""The job configs (`value_assets.core.job_configs`): one default and one rule per setting, JSON both ways,
and the command line built on them (its flags' defaults are the configs')."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from value_assets.cli import build_parser, main
from value_assets.core.errors import InputError
from value_assets.core.job_configs import (
    DATA_ROOTS_ENV,
    PRETRAINED_LR,
    TINY_LR,
    EvaluateJob,
    TrainJob,
    data_roots_from_env,
    field_default,
    field_doc,
)

pytestmark = pytest.mark.unit
SHA = "ab" * 32
REQUIRED = {
    TrainJob: {"manifest": "m.json", "output": "critic"},
    EvaluateJob: {"checkpoint": "critic", "manifest": "m.json", "contract_sha256": SHA, "report": "ev.json"},
}


def make(cls, **kw):
    return cls(**{**REQUIRED[cls], **kw})


@pytest.mark.parametrize("cls", [TrainJob, EvaluateJob])
def test_every_field_is_documented_and_frozen(cls):
    for f in dataclasses.fields(cls):
        assert f.kw_only and len(field_doc(cls, f.name)) > 10, f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        make(cls).seed = 3


@pytest.mark.parametrize(
    "cls, settings",
    [
        (
            TrainJob,
            dict(
                backbone="/ckpt/actor",
                global_batch_size=64,
                epochs=3,
                seed=-7,
                save_interval=10,
                gpus=8,
                tensor_parallel=2,
                pipeline_parallel=2,
                micro_batch_tokens=8192,
                lr=3e-4,
                warmup_steps=5,
                weight_decay=0.01,
                clip_grad=0.5,
                canary=True,
                stop_after=4,
                manifest_sha256=SHA,
                data_roots=(Path("/data"), "/more"),
                ray_address="ray://head:10001",
                timeout_s=60,
                freeze="attention",
                recompute="full",
                recompute_layers=3,
                resume_from=[SHA, "cd" * 32],
            ),
        ),
        (TrainJob, dict(resume_from=())),  # a lineage that recorded no save: nothing may be resumed
        (TrainJob, {}),
        (
            EvaluateJob,
            dict(
                split="train",
                num_batches=4,
                global_batch_size=2,
                seed=9,
                gpus=4,
                tensor_parallel=2,
                pipeline_parallel=2,
                micro_batch_tokens=100,
                data_roots=["/data"],
                ray_address="auto",
                timeout_s=1.5,
                gate_mode="interval",
            ),
        ),
        (EvaluateJob, {}),
    ],
)
def test_json_round_trip(cls, settings):
    cfg = make(cls, **settings)
    doc = cfg.to_json()
    assert set(doc) == {f.name for f in dataclasses.fields(cls)}
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc  # plain JSON types only
    assert all(isinstance(doc[k], str) for k in REQUIRED[cls] if k != "contract_sha256")  # paths as strings
    assert cls.from_json(json.loads(json.dumps(doc))) == cfg
    assert isinstance(cfg.manifest, Path)
    if cfg.data_roots is not None:
        assert doc["data_roots"] == [str(r) for r in cfg.data_roots] and isinstance(cfg.data_roots, tuple)


@pytest.mark.parametrize(
    "cls, name, value, needle",
    [
        (TrainJob, "warmup_steps", -5, "must be an integer >= 0, got -5"),
        (TrainJob, "save_interval", -1, "must be an integer >= 0, got -1"),
        (TrainJob, "global_batch_size", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "epochs", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "epochs", True, "must be an integer, got True"),
        (TrainJob, "epochs", 1.0, "must be an integer, got 1.0"),
        (TrainJob, "gpus", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "tensor_parallel", -2, "must be an integer >= 1, got -2"),
        (TrainJob, "pipeline_parallel", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "micro_batch_tokens", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "lr", 0.0, "must be a finite number > 0, got 0.0"),
        (TrainJob, "lr", -1e-4, "must be a finite number > 0, got -0.0001"),
        (TrainJob, "lr", math.inf, "must be a finite number, got inf"),
        (TrainJob, "lr", math.nan, "must be a finite number, got nan"),
        (TrainJob, "lr", "1e-4", "must be a finite number, got '1e-4'"),
        (TrainJob, "weight_decay", -0.1, "must be a finite number >= 0, got -0.1"),
        (TrainJob, "clip_grad", 0, "must be a finite number > 0, got 0.0"),
        (TrainJob, "timeout_s", 0, "must be a finite number > 0, got 0.0"),
        (TrainJob, "stop_after", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "canary", 1, "must be true or false, got 1"),
        (TrainJob, "backbone", "", "got ''"),
        (TrainJob, "manifest_sha256", SHA.upper(), f"got '{SHA.upper()}'"),
        (TrainJob, "manifest_sha256", "abc", "got 'abc'"),
        (TrainJob, "data_roots", [], "got []"),
        (TrainJob, "data_roots", "/data", "got '/data'"),
        (TrainJob, "resume_from", ["abc"], "got 'abc'"),
        (TrainJob, "resume_from", SHA, "must be a list of contract sha256s"),
        (TrainJob, "manifest", "", "got ''"),
        (TrainJob, "output", None, "is required, got None"),
        (TrainJob, "recompute_layers", 0, "must be an integer >= 1, got 0"),
        (TrainJob, "recompute_layers", 2, "needs recompute 'full', got recompute 'none'"),
        (TrainJob, "freeze", "embeddings", "must be one of ('none', 'attention', 'backbone'), got 'embeddings'"),
        (TrainJob, "head_bias", "none", "must be one of ('trained', 'zero'), got 'none'"),
        (EvaluateJob, "contract_sha256", "xyz", "got 'xyz'"),
        (EvaluateJob, "split", "test", "must be 'heldout' or 'train', got 'test'"),
        (EvaluateJob, "num_batches", 0, "must be an integer >= 1, got 0"),
        (EvaluateJob, "global_batch_size", 1, "must be an integer >= 2, got 1"),
        (EvaluateJob, "gpus", 0, "must be an integer >= 1, got 0"),
        (EvaluateJob, "micro_batch_tokens", -1, "must be an integer >= 1, got -1"),
        (EvaluateJob, "seed", "0", "must be an integer, got '0'"),
        (EvaluateJob, "gate_mode", "strict", "must be one of 'miles', 'interval', got 'strict'"),
        (EvaluateJob, "gate_min_ev", 1.0, "must be a number in [0, 1)"),
        (EvaluateJob, "gate_min_ev", -0.01, "got -0.01"),
        (EvaluateJob, "gate_min_ev", float("nan"), "got nan"),
    ],
)
def test_each_rule_names_the_field_and_the_value(cls, name, value, needle):
    with pytest.raises(InputError) as err:
        make(cls, **{name: value})
    assert err.value.where == name and needle in err.value.message
    with pytest.raises(InputError) as err:  # the same rule when the config arrives as JSON
        cls.from_json({**make(cls).to_json(), name: value})
    assert err.value.where == name


@pytest.mark.parametrize("cls", [TrainJob, EvaluateJob])
def test_from_json_is_strict(cls):
    doc = make(cls).to_json()
    with pytest.raises(InputError, match="argv: is not a") as err:
        cls.from_json({**doc, "argv": ["--gpus", "2"]})
    assert err.value.where == "argv"
    missing = {k: v for k, v in doc.items() if k != "manifest"}
    with pytest.raises(InputError, match="is required") as err:
        cls.from_json(missing)
    assert err.value.where == "manifest"
    with pytest.raises(InputError, match="must be a JSON object"):
        cls.from_json([doc])
    with pytest.raises(InputError) as err:
        cls.from_json({**doc, "gpus": "2"})
    assert err.value.where == "gpus" and "'2'" in err.value.message


def test_learning_rate_has_one_rule():
    assert field_default(TrainJob, "lr") is None
    assert make(TrainJob).learning_rate == TINY_LR == 2e-3
    assert make(TrainJob, backbone="/ckpt/actor").learning_rate == PRETRAINED_LR == 1e-5
    assert make(TrainJob, backbone="/ckpt/actor", lr=3e-4).learning_rate == 3e-4


def test_data_roots_from_flags_and_environment(monkeypatch):
    import os

    assert data_roots_from_env(None, {}) is None
    assert data_roots_from_env([], {DATA_ROOTS_ENV: ""}) is None
    assert data_roots_from_env(["/a"], {DATA_ROOTS_ENV: os.pathsep.join(["/b", "", "/c"])}) == ("/a", "/b", "/c")
    monkeypatch.setenv(DATA_ROOTS_ENV, "/env")
    assert data_roots_from_env([Path("/a")]) == ("/a", "/env")


def _subparser(command: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command]


@pytest.mark.parametrize("command, cls", [("train", TrainJob), ("evaluate", EvaluateJob)])
def test_cli_defaults_are_the_configs(command, cls, monkeypatch):
    from value_assets.gpu.commands import config_from_args

    monkeypatch.delenv(DATA_ROOTS_ENV, raising=False)
    sp = _subparser(command)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flags = [a for a in sp._actions if a.dest in fields]
    assert len(flags) >= 10
    for action in flags:
        f = fields[action.dest]
        if f.default is dataclasses.MISSING:
            assert action.required or not action.option_strings, action.dest
        else:
            assert action.default == f.default, action.dest
            assert field_doc(cls, action.dest) in action.help
    argv = (
        ["train", "m.json", "--output", "critic"]
        if command == "train"
        else [
            "evaluate",
            "--checkpoint",
            "critic",
            "--manifest",
            "m.json",
            "--contract-sha256",
            SHA,
            "--report",
            "ev.json",
        ]
    )
    args = build_parser().parse_args(argv)
    assert config_from_args(cls, args) == make(cls)


def test_cli_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 32)" in out and "(default: tiny)" in out and "(default: 4096)" in out
    assert f"{TINY_LR:g} for the tiny backbone" in out


def test_cli_refuses_negative_warmup_before_anything_runs(tmp_path, capsys):
    """`--warmup-steps -5` used to be accepted silently; now the config refuses it (exit 2), before
    the manifest is even read."""
    rc = main(["train", str(tmp_path / "missing.json"), "--output", str(tmp_path / "critic"), "--warmup-steps", "-5"])
    err = capsys.readouterr().err
    assert rc == 2 and "warmup_steps" in err and "-5" in err and "missing.json" not in err
    assert not (tmp_path / "critic").exists()


def test_cli_data_roots_reach_the_config(monkeypatch):
    from value_assets.gpu.commands import config_from_args

    monkeypatch.setenv(DATA_ROOTS_ENV, "/env")
    args = build_parser().parse_args(
        ["train", "m.json", "--output", "o", "--data-root", "/a", "--lr", "0.01", "--canary"]
    )
    cfg = config_from_args(TrainJob, args)
    assert cfg.data_roots == ("/a", "/env") and cfg.lr == 0.01 and cfg.canary is True
    assert cfg.resume_from is None  # by hand: any save that verifies
    args = build_parser().parse_args(
        ["train", "m.json", "--output", "o", "--resume-from", SHA, "--resume-from", "cd" * 32]
    )
    assert config_from_args(TrainJob, args).resume_from == (SHA, "cd" * 32)
    args = build_parser().parse_args(
        ["train", "m.json", "--output", "o", "--plan", "p/plan.json", "--plan-sha256", SHA]
    )
    cfg = config_from_args(TrainJob, args)
    assert (cfg.plan, cfg.plan_sha256) == (Path("p/plan.json"), SHA)
    with pytest.raises(InputError, match="go together"):  # a plan is read only against the sha its lineage recorded
        config_from_args(
            TrainJob, build_parser().parse_args(["train", "m.json", "--output", "o", "--plan", "p/plan.json"])
        )


def test_freeze_backbone_needs_one_pipeline_stage():
    make(TrainJob, freeze="backbone", gpus=2, tensor_parallel=2)
    with pytest.raises(InputError) as err:
        make(TrainJob, freeze="backbone", gpus=2, pipeline_parallel=2)
    assert err.value.where == "freeze" and "pipeline_parallel 1, got 2" in err.value.message


def test_cli_freeze_flag_reaches_the_config():
    from value_assets.gpu.commands import config_from_args

    args = build_parser().parse_args(["train", "m.json", "--output", "critic", "--freeze", "backbone"])
    assert config_from_args(TrainJob, args) == make(TrainJob, freeze="backbone")


def test_cli_recompute_layers_reach_the_memory_config():
    from value_assets.gpu.commands import config_from_args

    args = build_parser().parse_args(
        ["train", "m.json", "--output", "critic", "--recompute", "full", "--recompute-layers", "4"]
    )
    cfg = config_from_args(TrainJob, args)
    assert cfg == make(TrainJob, recompute="full", recompute_layers=4)
    assert (cfg.memory.recompute, cfg.memory.recompute_layers) == ("full", 4)
    with pytest.raises(InputError) as err:
        make(TrainJob, recompute="selective", recompute_layers=4)
    assert err.value.where == "recompute_layers" and "got recompute 'selective'" in err.value.message


def test_handoff_job_round_trip_and_rules():
    from value_assets.core.job_configs import HandoffJob

    job = HandoffJob(
        checkpoint="c/iter_0000004",
        contract_sha256=SHA,
        out_dir="h",
        model_identity="value-assets:tiny@x",
        scalar_hf=True,
    )
    assert HandoffJob.from_json(json.loads(json.dumps(job.to_json()))) == job and job.layer_spec == "te"
    with pytest.raises(InputError) as err:
        HandoffJob.from_json({**job.to_json(), "layer_spec": "fused"})
    assert err.value.where == "layer_spec"
    with pytest.raises(InputError) as err:
        HandoffJob.from_json({**job.to_json(), "model_identity": ""})
    assert err.value.where == "model_identity"


# The functions below the job drivers that receive job settings: (module file, function or Class.method).
_SETTING_RECEIVERS = (
    ("value_assets/core/worker_spec.py", "WorkerSpec"),
    ("value_assets/core/worker_spec.py", "OptimizerSettings"),
    ("value_assets/gpu/workers/cluster.py", "start_workers"),
    ("value_assets/gpu/workers/worker.py", "CriticWorker.configure"),
    ("value_assets/gpu/workers/worker.py", "CriticWorker.address"),
    ("value_assets/gpu/workers/worker.py", "CriticWorker.setup"),
    ("value_assets/gpu/runtime/step.py", "wrap_for_training"),
    ("value_assets/gpu/runtime/parallel.py", "open_rendezvous"),
)
# Receivers' parameters whose default is the neutral one the jobs have too (no freezing, the plain
# optimizer, no offload, a local Ray).
_NEUTRAL = {
    "freeze": "none",
    "head_bias": "trained",
    "distributed_optimizer": False,
    "optimizer_offload": 0.0,
    "ray_address": None,
}


def _parameters_with_defaults(path: Path, qualname: str) -> dict[str, object]:
    """{parameter: default expression} of `qualname` in the module at `path`, read from its source
    (the GPU modules import torch; this reads them without)."""
    import ast

    tree = ast.parse(path.read_text())
    *owner, name = qualname.split(".")
    body = tree.body
    for cls_name in owner:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name).body
    node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    if isinstance(node, ast.ClassDef):  # a dataclass: its fields' defaults
        return {n.target.id: n.value for n in node.body if isinstance(n, ast.AnnAssign) and n.value is not None}
    a = node.args
    positional = a.posonlyargs + a.args
    pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True))
    pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
    return {arg.arg: d for arg, d in pairs}


def test_job_settings_have_one_default_the_layers_below_take_them_from_the_job():
    """A training setting (lr, weight_decay, clip_grad), the deadline or the placement has its default
    in the job config only: the Ray cluster, the worker and the optimizer take it from the job, so no
    second default can disagree (as 1e-4 in the cluster and 1e-5 in the optimizer once did with the
    jobs' 2e-3 / 1e-5)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    settings = {f.name for cls in (TrainJob, EvaluateJob) for f in dataclasses.fields(cls)} | {"timeout_s"}
    seen = set()
    for path, qualname in _SETTING_RECEIVERS:
        defaults = _parameters_with_defaults(root / path, qualname)
        for name, node in defaults.items():
            if name not in settings:
                continue
            default = ast.unparse(node)
            if default == "None" and name not in _NEUTRAL:
                continue  # not given: taken from the job where it is needed (below)
            assert name in _NEUTRAL and ast.literal_eval(node) == _NEUTRAL[name], f"{path} {qualname}({name}={default})"
            seen.add(name)
    for name, neutral in _NEUTRAL.items():
        assert field_default(TrainJob, name) == neutral
    assert seen == set(_NEUTRAL)  # the rule reads the real signatures


def test_the_worker_spec_carries_the_job_and_cannot_state_the_impossible(tmp_path):
    """The workers get one spec from the job config (`core/worker_spec.py`): a training job's has
    its optimizer settings with the job's defaults, a forward-only job's has none, and freezing
    parameters of a job that trains nothing cannot be stated."""
    from value_assets.core.backbone import BackboneConfig
    from value_assets.core.memory import Layout
    from value_assets.core.objective import Objective
    from value_assets.core.worker_spec import OptimizerSettings, WorkerSpec

    bb, obj = BackboneConfig.tiny(), Objective()
    train = TrainJob(
        manifest=tmp_path / "m.json",
        output=tmp_path / "o",
        gpus=4,
        tensor_parallel=2,
        freeze="attention",
        recompute="full",
    ).worker_spec(bb, obj)
    assert train.optimizer == OptimizerSettings(lr=2e-3, weight_decay=0.0, clip_grad=1.0)  # the tiny backbone's lr
    assert (train.layout, train.world_size, train.freeze, train.memory.recompute) == (
        Layout(tp=2, pp=1, dp=2),
        4,
        "attention",
        "full",
    )
    evaluate = EvaluateJob(
        checkpoint=tmp_path,
        manifest=tmp_path / "m.json",
        contract_sha256="0" * 64,
        report=tmp_path / "r.json",
        gpus=2,
        seed=7,
    ).worker_spec(bb, obj)
    assert (evaluate.optimizer, evaluate.train, evaluate.seed, evaluate.layout.dp) == (None, False, 7, 2)
    with pytest.raises(InputError, match="freeze"):
        WorkerSpec(backbone=bb, objective=obj, layout=Layout(), seed=0, freeze="backbone")
    assert make(TrainJob, head_bias="zero").worker_spec(bb, obj).head_bias == "zero" and train.head_bias == "trained"
    with pytest.raises(InputError, match="'zero' needs a training job") as err:
        WorkerSpec(backbone=bb, objective=obj, layout=Layout(), seed=0, head_bias="zero")
    assert err.value.where == "head_bias"
    with pytest.raises(InputError, match="clip_grad"):
        OptimizerSettings(lr=1e-3, weight_decay=0.0, clip_grad=0.0)


def test_a_job_config_without_its_rules_cannot_be_built():
    """`_validate` is abstract: a job type that forgot its rules fails at construction (a TypeError
    naming the method), not with a config that was never checked."""

    from value_assets.core.job_configs import _JobConfig

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Unchecked(_JobConfig):
        size: int = 1

    with pytest.raises(TypeError, match="_validate"):
        Unchecked()
