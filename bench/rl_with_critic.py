"""Does a promoted critic make RL better? PPO with TRL's own trainer on SmolLM2-135M-Instruct (issue 28).

    python bench/rl_with_critic.py critics --rollouts ROLLOUTS.jsonl[.xz] --actor HF_DIR --work W
    python bench/rl_with_critic.py run --actor HF_DIR --tasks bench/data/real_rollouts_tasks.jsonl --out RUNS \\
        --arm a=fresh --critics W/critics.json --split-manifest W/inbox/rl-full.json --seeds 0 [--deadline-s 540]
    python bench/rl_with_critic.py report RUNS --out bench/results/rl          # rl.json, rl.md, rl.png
    python bench/rl_with_critic.py tiny OUT --tokenizer HF_DIR [--rollouts TASKS]  # CPU smoke: tiny actor, rows

The repository root must be importable (`PYTHONPATH=.` or the package installed). On the H200:
`bench/h200.sh rl-critics` and `bench/h200.sh rl SEED` (bench/README.md).

**Library.** TRL 1.12.0's PPO trainer (`trl.experimental.ppo`: the last release that ships it), on
one GPU with Hugging Face generation. The critic is loaded from the promoted hand-off folder
(`handoff/hf/`, the scalar export) unchanged, with transformers' own loader,
`AutoModelForTokenClassification.from_pretrained(DIR, num_labels=1)`: TRL only needs
`value_model.base_model_prefix` and `value_model.score` (`AutoModelForSequenceClassification`, TRL's
example recipe, would drop `score.bias`). Before step 0 the values TRL computes (its own
`get_reward`, on left-padded rollouts of the initial policy, with the very object handed to
`PPOTrainer`) are compared with the product's values (the engine critic built from the contracted
checkpoint); the max difference goes into every run's `done.json`.

**Arms** (`--arm NAME=SPEC`; same seeds, prompts and hyper-parameters, only the critic differs):
a `fresh` (transformers' fresh `score` head on the actor, TRL's default), b the promoted critic
(full fine-tune), c the promoted head-only critic (`freeze: backbone`), d a reward-shuffled control.
SPEC is `fresh`, `record:REGISTRY.json@SHA` (a promotion record pinned by the sha the Dagster
instance holds, verified by the product's rules, bundle bytes included) or `hf:DIR[@CKPT]` (an
exported folder: a critic the gate refused, exported by hand). `critics` trains b-d the way the
README's "Bring your own rollouts" does: `import-rollouts --loss-type mse --inbox --training` (TRL's
head is a scalar trained with a squared error) writes one manifest per arm into the watched folder
with its `training` spec (the actor folder pinned by its sha256, the settings below), then the
manifest sensor is ticked and each requested Dagster `full` run executed with the sensor's run config
(validate, plan, train, evaluate, gate, promote), as `value-assets run-manifests` does.

**Prompts and reward.** The study's reasoning-gym families with 10-30% initial success
(add/sub/mul-1digit), its calibration items left out, split by the product's own rule
(`core.rollouts.split_groups`, the study's fraction 0.2 and seed 0) and checked against the critic
manifest's held-out rows: RL trains on the critics' *train* prompts only; held-out success is
measured on a fixed, family-balanced set of the critics' *held-out* prompts, sampled at the RL
temperature and greedily, under a forked RNG. The reward is the study's verifier
(`real_rollouts.score`), wrapped as the reward *model* TRL's trainer calls.

**Fixed before any arm b-d result** (`PPO` and `CRITIC_SPEC` below; the report refuses runs whose
settings differ): TRL's defaults except where the task fixes them: lr 3e-6 (one optimizer for policy
and critic), 4 PPO epochs of 1 mini-batch, KL coefficient 0.05 (k1), value coefficient 0.1, clip 0.2
(policy and value), gamma 1, lambda 0.95, rewards not whitened; temperature 0.4 (the study's
calibrated value), responses of at most 16 tokens stopped at `<|im_end|>`, 256 prompts x 1 sample
per step, 50 steps (`--steps` once, from arm a's step time in the first session), bf16 autocast with
fp32 weights. Critics: G=64, 2 epochs, warmup 10, lr 3e-5 (full) and 1e-3 (head-only), the gate in
`interval` mode on 8 x 64 held-out rows. Scale flags (`--steps`, `--batch`, `--response-length`,
`--epochs`, ...) exist for the CPU smoke only.

**Per step** (`RUNS/<arm>-s<seed>/steps.jsonl`, flushed as it goes): TRL's metrics (`objective/kl`:
KL to the initial policy, `loss/value_avg`, ...) and, from the values and raw GAE advantages TRL
computed in that step, the mean advantage before whitening (the advantage bias), the value EV against
TRL's returns and against the outcome, and every `--eval-every` steps the held-out success.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_FAMILIES = ("add-1digit", "sub-1digit", "mul-1digit")
CALIBRATION_ITEMS = 48  # real_rollouts generate --calibrate: never in the study's rows
HELDOUT_FRACTION, SPLIT_SEED = 0.2, 0  # the study's import-rollouts split

# PPO settings, fixed before any arm b-d result (the module docstring says why each).
PPO: dict[str, Any] = {
    "learning_rate": 3e-6, "num_ppo_epochs": 4, "num_mini_batches": 1, "kl_coef": 0.05, "kl_estimator": "k1",
    "vf_coef": 0.1, "cliprange": 0.2, "cliprange_value": 0.2, "gamma": 1.0, "lam": 0.95, "whiten_rewards": False,
    "temperature": 0.4,
}  # fmt: skip
# The critics' training spec (docs/rules.md#training-spec) less the backbone and per-arm settings.
CRITIC_SPEC: dict[str, Any] = {
    "schema": "value-assets.training.v1",
    "plan": {"global_batch_size": 64, "epochs": 2, "seed": 0},
    "train": {"gpus": 1, "warmup_steps": 10, "micro_batch_tokens": 16384},
    "evaluate": {"global_batch_size": 64, "num_batches": 8},
    # The bar the real-rollout study settled on (docs/results.md#real-rollouts), fixed here before any RL critic
    # was trained: a critic whose EV interval does not clear 0.005 is not promoted (it is still run as an arm).
    "gate": {"mode": "interval", "min_ev": 0.005},
}
# arm: (manifest stem, rows, freeze, lr)
CRITICS = {
    "b": ("rl-full", "real", "none", 3e-5),
    "c": ("rl-head", "real", "backbone", 1e-3),
    "d": ("rl-shuffled", "shuffled", "none", 3e-5),
}


def read_jsonl(path: Path) -> list[dict]:
    text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- prompts and split


def load_items(tasks: Path, families) -> list[dict]:
    by: dict[str, list[dict]] = {}
    for it in read_jsonl(tasks):
        by.setdefault(it["task"], []).append(it)
    missing = [f for f in families if f not in by]
    if missing:
        raise SystemExit(f"families {missing} are not in {tasks}")
    return [it for f in families for it in by[f][CALIBRATION_ITEMS:]]


def split_items(items: list[dict], manifest: str | None) -> tuple[list[dict], list[dict]]:
    """(train items, held-out items) by the product's split rule, checked against a critic manifest."""
    from value_assets.core.rollouts import split_groups

    held = split_groups((it["item"] for it in items), HELDOUT_FRACTION, SPLIT_SEED)
    if manifest:
        from value_assets.core.dataset import validate_dataset
        from value_assets.core.manifest import load_manifest

        m = load_manifest(manifest)
        ds = validate_dataset(m.heldout, m.objective)
        ids = {ds.row(i).sample_id.split("#")[0] for i in range(len(ds))}
        if ids != held:
            raise SystemExit(f"{manifest}: its held-out items are not the study's split ({len(ids ^ held)} differ)")
    return [it for it in items if it["item"] not in held], [it for it in items if it["item"] in held]


def eval_subset(held_items: list[dict], families, n: int) -> list[dict]:
    """A fixed, family-balanced set of held-out prompts (the same for every arm and seed)."""
    rng, per, out = np.random.default_rng(0), max(1, n // len(families)), []
    for f in families:
        fam = [it for it in held_items if it["task"] == f]
        out += [fam[i] for i in sorted(rng.choice(len(fam), size=min(per, len(fam)), replace=False))]
    return out


# ----------------------------------------------------------------------------- arms


def parse_arm(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    kind, _, rest = spec.partition(":")
    if name and spec == "fresh":
        return name, {"kind": "fresh"}
    if name and kind == "hf" and rest:
        hf, _, ckpt = rest.partition("@")
        return name, {"kind": "hf", "hf": hf, "checkpoint": ckpt or None}
    if name and kind == "record" and "@" in rest:
        path, _, sha = rest.rpartition("@")
        return name, {"kind": "record", "record": path, "sha": sha}
    raise SystemExit(f"--arm {text!r}: give NAME=fresh, NAME=hf:DIR[@CKPT] or NAME=record:PATH@SHA")


def resolve_arm(spec: dict, report: tuple[str, str] | None = None) -> dict:
    """A record arm: the pinned registry record verified by the product's rules (bundle bytes
    included), its hand-off folder, checkpoint and the gate's EV; an hf arm: its gate, given its
    report (path, the sha the lineage recorded)."""
    out = dict(spec)
    if spec["kind"] == "record":
        from value_assets.core.handoff import read_registry_record, verify_handoff

        record, _ = read_registry_record(spec["record"], spec["sha"])
        verify_handoff(record, spec["record"])
        hf = (record.get("handoff") or {}).get("hf")
        if not hf:
            raise SystemExit(f"{spec['record']}: no scalar Hugging Face bundle (not an mse critic)")
        out.update(hf=hf["dir"], checkpoint=record["checkpoint"], contract_sha256=record["contract_sha256"])
        report = (record["report_path"], record["report_sha256"])
    if report:
        from value_assets.core.hashing import read_pinned
        from value_assets.core.report import decide_gate

        d = decide_gate(json.loads(read_pinned(Path(report[0]), report[1], "EV report")[0]))
        out.update(
            gate_report=report[0],
            gate_passed=d.passed,
            gate_ev={w: g.ev for w, g in d.weightings.items()},
            gate_ev_interval={w: [iv.low, iv.high] for w, iv in d.intervals.items()},
        )
    return out


# ----------------------------------------------------------------------------- run


def settings(args) -> dict:
    """Everything a run's result depends on besides the arm and seed (the report compares them)."""
    keys = ("steps", "batch", "response_length", "eval_every", "eval_prompts", "families")
    return {
        **PPO,
        **{k: getattr(args, k) for k in keys},
        "heldout_fraction": HELDOUT_FRACTION,
        "split_seed": SPLIT_SEED,
    }


def run_one(args, arm: str, spec: dict, seed: int, items: tuple[list, list], deadline, check, product) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from bench import _rl_trl as T

    train_items, eval_items = items
    out = Path(args.out) / f"{arm}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    set_seed(seed)
    tok = T.load_tokenizer(args.actor)
    policy = AutoModelForCausalLM.from_pretrained(args.actor, dtype=torch.float32).to(device)
    policy.generation_config.pad_token_id, policy.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    torch.manual_seed(seed)  # the fresh head's init is seeded like everything else
    value_model, loading = T.load_value_model(args.actor if spec["kind"] == "fresh" else spec["hf"])
    value_model.to(device)
    meta: dict[str, Any] = {
        "arm": arm,
        "seed": seed,
        "spec": spec,
        "value_class": type(value_model).__name__,
        "loading_info": loading,
        "settings": settings(args),
        # How the work was executed (not a setting: the report pairs arms only within a seed, and
        # refuses a seed whose arms ran on other cards or micro-batches).
        "execution": {"micro_batches": args.micro_batches},
        "train_prompts": len(train_items),
        "eval_prompts": len(eval_items),
        "versions": T.versions(),
        "value_check": T.check_values(value_model, check, product),
    }
    print(f"[{arm}-s{seed}] value check: {meta['value_check']}", flush=True)
    config = PPOConfig(
        output_dir=str(out / "trl"),
        seed=seed,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        per_device_train_batch_size=args.batch // args.micro_batches,
        gradient_accumulation_steps=args.micro_batches,
        total_episodes=args.steps * args.batch,
        local_rollout_forward_batch_size=args.batch,
        lr_scheduler_type="constant",
        response_length=args.response_length,
        stop_token="eos",
        num_sample_generations=0,
        bf16=cuda,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=not cuda,
        per_device_eval_batch_size=8,
        dataloader_num_workers=0,
        **PPO,
    )
    prompts = [T.encode_prompt(tok, it) for it in train_items]
    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=None,
        reward_model=T.verifier_reward_model(tok, train_items),
        value_model=value_model,
        train_dataset=Dataset.from_dict({"input_ids": prompts}),
        eval_dataset=Dataset.from_dict({"input_ids": [T.encode_prompt(tok, it) for it in eval_items[: args.batch]]}),
    )
    probe = T.StepProbe(value_model)
    rec = T.RunRecorder(out, policy, tok, eval_items, probe, args, PPO["temperature"], seed, deadline)
    trainer.add_callback(T.make_callback(rec))
    trainer.remove_callback(PrinterCallback)  # the recorder prints one line per step
    meta["setup_s"] = round(time.time() - t0, 1)
    rec.write({"step": 0, "heldout": rec.evaluate(0)})
    status, t1 = "done", time.time()
    try:
        trainer.train()
    except T.OutOfTime:
        status = "out_of_time"
    finally:
        probe.close()
    meta.update(status=status, train_s=round(time.time() - t1, 1), total_s=round(time.time() - t0, 1))
    (out / ("done.json" if status == "done" else "partial.json")).write_text(json.dumps(meta, indent=1) + "\n")
    del trainer, policy, value_model
    if cuda:
        torch.cuda.empty_cache()
    return meta


def cmd_run(args) -> None:
    from bench import _rl_trl as T

    if args.micro_batches < 1 or args.batch % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches}: must divide --batch {args.batch}")
    deadline = time.time() + args.deadline_s if args.deadline_s else None
    train_items, held_items = split_items(load_items(Path(args.tasks), args.families), args.split_manifest)
    eval_items = eval_subset(held_items, args.families, args.eval_prompts)
    arms = [parse_arm(a) for a in args.arm or []]
    reports: dict[str, tuple[str, str]] = {}
    if args.critics:
        for name, entry in json.loads(Path(args.critics).read_text()).items():
            arms.append(parse_arm(f"{name}={entry['arm']}"))
            if entry["arm"].startswith("hf:") and entry.get("report_path"):
                reports[name] = (entry["report_path"], entry["report_sha256"])
    resolved = {name: resolve_arm(spec, reports.get(name)) for name, spec in arms}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {
        "settings": settings(args),
        "arms": resolved,
        "seeds": args.seeds,
        "train_prompts": len(train_items),
        "heldout_prompts": len(held_items),
        "eval_items": [it["item"] for it in eval_items],
    }
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    t0 = time.time()
    check = T.make_check_rollouts(
        args.actor, train_items[: args.check_rows], args.response_length, PPO["temperature"], out
    )
    product = product_values({n: sp["checkpoint"] for n, sp in resolved.items() if sp.get("checkpoint")}, check, out)
    print(f"check rollouts and product values ready in {time.time() - t0:.0f}s", flush=True)
    durations: list[float] = []
    for seed in args.seeds:
        for name in resolved:
            if (out / f"{name}-s{seed}" / "done.json").is_file():
                continue  # a later command goes on where an earlier one stopped
            if deadline and durations and time.time() + max(durations) * 1.1 > deadline:
                print(
                    f"stopping before {name}-s{seed}: {deadline - time.time():.0f}s left, a run takes "
                    f"~{max(durations):.0f}s",
                    flush=True,
                )
                return
            t = time.time()
            meta = run_one(
                args, name, resolved[name], seed, (train_items, eval_items), deadline, check, product.get(name)
            )
            durations.append(time.time() - t)
            print(f"{name}-s{seed}: {meta['status']} in {durations[-1]:.0f}s", flush=True)
            if meta["status"] != "done":
                return


def product_values(checkpoints: dict[str, str], check: dict, out: Path) -> dict:
    """{arm: {checkpoint, contract_sha256, values}} from the product's engine, every checkpoint in one
    subprocess (one megatron import, its distributed state kept out of the RL process); cached."""
    path = out / "check_product_values.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    todo = {a: c for a, c in checkpoints.items() if cached.get(a, {}).get("checkpoint") != c}
    if todo:
        (out / "check_rows.json").write_text(json.dumps(check["rows"]))
        cmd = [sys.executable, __file__, "product-values", "--rows", str(out / "check_rows.json"), "--out", str(path)]
        for arm, ckpt in todo.items():
            cmd += ["--checkpoint", f"{arm}={ckpt}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            sys.stderr.write(res.stderr[-3000:])
            raise SystemExit("product-values failed")
        cached.update(json.loads(path.read_text()))
        path.write_text(json.dumps(cached))
    return cached


def cmd_product_values(args) -> None:
    """The product's values per response token: the engine critic built from each contracted checkpoint."""
    import torch

    from value_assets.core.objective import Objective
    from value_assets.gpu.convert.export import contracted_step
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic, critic_forward
    from value_assets.gpu.model.losses import predicted_values
    from value_assets.gpu.runtime.checkpoint import load_model_weights
    from value_assets.gpu.runtime.parallel import destroy, init_distributed

    rows = json.loads(Path(args.rows).read_text())
    cuda = torch.cuda.is_available()
    init_distributed(0, 1, "127.0.0.1", 0, backend=None if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    result = {}
    try:
        for spec in args.checkpoint:
            arm, _, ckpt = spec.partition("=")
            step_dir, contract, sha = contracted_step(Path(ckpt))
            objective = Objective.from_json(contract["objective"])
            model = build_critic(BackboneConfig.from_json(contract["backbone_config"]), objective, bf16=False)
            load_model_weights(step_dir, model, contract=contract)
            model.eval()
            values = []
            with torch.no_grad():
                for r in rows:
                    toks = torch.tensor(r["tokens"], dtype=torch.long, device=device)
                    n = toks.numel()
                    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
                    v = predicted_values(critic_forward(model, toks, torch.arange(n, device=device), cu, n), objective)
                    values.append(v.double().cpu()[r["prompt_len"] - 1 : n - 1].tolist())
            result[arm] = {"checkpoint": ckpt, "contract_sha256": sha, "values": values}
            del model
    finally:
        destroy()
    Path(args.out).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- critics (the product's graph)


def _va(*argv: str) -> dict:
    """One `value-assets` command; its last JSON line."""
    res = subprocess.run([sys.executable, "-m", "value_assets.cli", *argv], capture_output=True, text=True)
    if res.returncode:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"value-assets {argv[0]} failed ({res.returncode})")
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def check_stop_token(actor: str) -> None:
    """import-rollouts appends the tokenizer's EOS to every response; TRL stops the actor on it too.
    It must be the token the actor ends its turn with (its generation config's EOS)."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(actor)
    eos = GenerationConfig.from_pretrained(actor).eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    if tok.eos_token_id not in stops:
        raise SystemExit(
            f"{actor}: the tokenizer's EOS {tok.eos_token!r} is not the actor's stop token {stops} "
            "(prepare the folder again with bench/prepare_smollm2.py)"
        )


def write_manifests(args, work: Path) -> dict[str, Path]:
    """One manifest per arm in the watched folder, each written by `import-rollouts --inbox
    --training` (the product's own path, README "Bring your own rollouts"): the rollouts as they are
    (b, c) or with rewards shuffled across rows (d), and the critic's training spec, which names the
    actor folder pinned by its sha256. A manifest already there is kept (a resumed command)."""
    from value_assets.gpu.convert.bootstrap import resolve_backbone

    inbox, data = work / "inbox", work / "data"
    for folder in (inbox, data):
        folder.mkdir(parents=True, exist_ok=True)
    rows = [r for r in read_jsonl(Path(args.rollouts)) if r["task"] in set(args.families)]
    rewards = random.Random(0).sample([r["reward"] for r in rows], len(rows))
    sources = {"real": rows, "shuffled": [{**r, "reward": w} for r, w in zip(rows, rewards, strict=True)]}
    actor = Path(args.actor).resolve()
    backbone = {"path": str(actor), "sha256": resolve_backbone(str(actor))[2]["sha256"]}
    paths = {}
    for arm, (stem, tag, freeze, lr) in CRITICS.items():
        paths[arm] = inbox / f"{stem}.json"
        if paths[arm].is_file():
            continue
        src = data / f"rollouts-{tag}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in sources[tag]))
        spec = json.loads(json.dumps(CRITIC_SPEC))
        spec["plan"]["epochs"] = args.epochs
        spec["train"].update(lr=lr * args.lr_scale, freeze=freeze)
        spec["evaluate"]["num_batches"] = args.eval_batches
        spec_file = data / f"{stem}.training.json"
        spec_file.write_text(json.dumps({**spec, "backbone": backbone}, indent=1) + "\n")
        info = _va(
            "import-rollouts", str(src), "--tokenizer", str(actor), "--loss-type", "mse", "--id-field", "id",
            "--group-field", "item", "--heldout-fraction", str(HELDOUT_FRACTION), "--seed", str(SPLIT_SEED),
            "--out", str(data / stem), "--inbox", str(inbox), "--name", stem, "--training", str(spec_file),
        )  # fmt: skip
        print(f"import {stem}: {info}", flush=True)
    return paths


def cmd_critics(args) -> None:
    """Train, gate and promote the critics of arms b-d with the product's Dagster `full` job, run in
    this process against a local instance in WORK as `run-manifests` and `make demo` do (the sensor's
    run request, its run config from the spec). A promoted critic's arm is its registry record pinned
    by the sha the instance holds; one its gate refused is exported by hand and marked so; any other
    failure stops the step. Writes WORK/critics.json; arms already there are skipped."""
    check_stop_token(args.actor)
    work = Path(args.work).resolve()
    paths = write_manifests(args, work)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.update(
        DAGSTER_HOME=str(work / "dagster_home"),
        VALUE_ASSETS_ARTIFACTS=str(work / "artifacts"),
        VALUE_ASSETS_MANIFESTS=str(work / "inbox"),
    )
    os.environ.pop("VALUE_ASSETS_DEFAULT_TRAINING", None)  # every manifest names its own spec
    from dagster import DagsterInstance

    from value_assets.core import vocabulary as v
    from value_assets.core.hashing import sha256_file
    from value_assets.core.training_spec import spec_of_manifest
    from value_assets.definitions import make_definitions, resources_for
    from value_assets.partitions import partition_key_for
    from value_assets.run_inbox import lineage_state, run_inbox, use_home

    home = use_home(ROOT)
    resources = resources_for("local")
    artifacts = Path(resources["artifacts"].root).resolve()
    critics_file = work / "critics.json"
    critics = json.loads(critics_file.read_text()) if critics_file.is_file() else {}
    todo = [arm for arm in args.arms if arm not in critics]
    wanted = {paths[arm].resolve() for arm in todo}
    instance = DagsterInstance.get()
    ran = {s.manifest.resolve(): s for s in run_inbox(instance, resources, only=lambda p: p.resolve() in wanted)}
    for arm in todo:
        path = paths[arm]
        key = partition_key_for(path, sha256_file(path))
        state = ran.get(path.resolve()) or lineage_state(instance, artifacts, key, path)
        t = time.monotonic()
        if path.resolve() not in ran and not (state.promoted or state.gate is False):
            # An earlier command's run of it stopped early, and the sensor starts no second run: run it again.
            spec = spec_of_manifest(json.loads(path.read_text()), path)
            assert spec is not None
            make_definitions(resources).resolve_job_def("full").execute_in_process(
                instance=instance,
                partition_key=key,
                raise_on_error=False,
                tags={"value_assets/manifest": str(path)},
                run_config={**spec.run_config(), "loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
            )
            resources["launcher"].stop_warm_cluster(instance)
            state = lineage_state(instance, artifacts, key, path, seconds=time.monotonic() - t)
        report, ckpt = state.metadata[v.EV_REPORT], state.metadata[v.CRITIC_CHECKPOINT].get("checkpoint")
        entry: dict[str, Any] = {
            "partition": key, "seconds": round(state.seconds, 1), "gate_passed": state.gate,
            "token_ev": report.get("token_ev"), "trajectory_ev": report.get("trajectory_ev"),
            "report_path": str(report[v.REPORT_PATH]) if report.get(v.REPORT_PATH) else None,
            "report_sha256": report.get(v.REPORT_SHA256), "checkpoint": str(ckpt) if ckpt else None,
            "training": json.loads(path.read_text())["training"],
        }  # fmt: skip
        if state.promoted and state.record_sha256:
            entry["arm"] = f"record:{state.registry_record}@{state.record_sha256}"
        elif ckpt and state.gate is False:
            hf = work / "refused-hf" / key
            if not hf.exists():
                _va("export-hf", "--checkpoint", str(ckpt), "--out", str(hf), "--format", "scalar")
            entry["arm"] = f"hf:{hf}@{ckpt}"
            entry["note"] = "not promoted (the gate refused it): exported by hand from its checkpoint"
        else:
            raise SystemExit(
                f"{key}: the full job stopped before its gate decided or after it passed (failed steps "
                f"{list(state.failed_steps)}; Dagster instance {home})"
            )
        critics[arm] = entry
        critics_file.write_text(json.dumps(critics, indent=1) + "\n")
        print(f"{arm} {path.stem}: " + json.dumps({k: entry[k] for k in entry if k != "training"}), flush=True)
    print(f"critics: {critics_file}")


def cmd_report(args) -> None:
    from bench._rl_report import report

    report(Path(args.runs), Path(args.out), args.reference, args.early_steps, [Path(p) for p in args.also])


# ----------------------------------------------------------------------------- CPU smoke


def cmd_tiny(args) -> None:
    """A tiny random Llama actor with the tokenizer of `--tokenizer` and, with `--rollouts TASKS`,
    synthetic rollouts of the study's items for it (the answer with probability 0.2, else a wrong
    number; 4 samples per item), so the whole chain runs on CPU in minutes."""
    import shutil

    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out / "actor")
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id).save_pretrained(out / "actor")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(args.tokenizer) / f).is_file():
            shutil.copy(Path(args.tokenizer) / f, out / "actor" / f)
    print(f"wrote {out / 'actor'}")
    if args.rollouts:
        rng, rows = random.Random(0), []
        for it in load_items(Path(args.rollouts), DEFAULT_FAMILIES):
            for k in range(4):
                answer = it["answer"] if rng.random() < 0.2 else str(int(it["answer"]) + rng.choice([-2, -1, 1, 3]))
                rows.append(
                    {
                        "id": f"{it['item']}#{k}",
                        "item": it["item"],
                        "task": it["task"],
                        "prompt": it["prompt"],
                        "response": answer,
                        "reward": float(answer == it["answer"]),
                    }
                )
        (out / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / 'rollouts.jsonl'} ({len(rows)} rows)")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("critics", help="train, gate and promote the critics of arms b-d (Dagster full job)")
    c.add_argument("--rollouts", required=True, help="the study's rollouts (real_rollouts.py generate), .jsonl[.xz]")
    c.add_argument("--actor", required=True, help="the actor's Hugging Face folder (bench/prepare_smollm2.py)")
    c.add_argument("--work", required=True)
    c.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    c.add_argument("--arms", nargs="+", default=list(CRITICS), choices=list(CRITICS))
    c.add_argument("--epochs", type=int, default=CRITIC_SPEC["plan"]["epochs"], help="CPU smoke only")
    c.add_argument("--lr-scale", type=float, default=1.0, help="CPU smoke only: multiplies both lrs")
    c.add_argument("--eval-batches", type=int, default=CRITIC_SPEC["evaluate"]["num_batches"], help="CPU smoke only")
    c.set_defaults(func=cmd_critics)
    r = sub.add_parser("run", help="PPO for every arm and seed (skips runs already done)")
    r.add_argument("--actor", required=True)
    r.add_argument("--tasks", required=True, help="bench/data/real_rollouts_tasks.jsonl")
    r.add_argument("--out", required=True)
    r.add_argument("--arm", action="append", help="NAME=fresh | NAME=hf:DIR[@CKPT] | NAME=record:PATH@SHA")
    r.add_argument("--critics", help="WORK/critics.json of the critics step: its arms are added")
    r.add_argument("--split-manifest", help="a critic manifest whose held-out items must be the split's")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    r.add_argument("--steps", type=int, default=50, help="PPO steps (fixed once, from arm a's step time)")
    r.add_argument("--batch", type=int, default=256, help="prompts (one sample each) per step; CPU smoke only")
    r.add_argument(
        "--micro-batches", type=int, default=1,
        help="split each PPO mini-batch into N micro-batches whose gradients are accumulated (memory only: "
        "one optimizer step per mini-batch as before); every arm of a seed must run with the same N",
    )  # fmt: skip
    r.add_argument("--response-length", type=int, default=16, help="CPU smoke only")
    r.add_argument("--eval-every", type=int, default=5)
    r.add_argument("--eval-prompts", type=int, default=270)
    r.add_argument("--eval-batch", type=int, default=512)
    r.add_argument("--check-rows", type=int, default=32, help="rollouts of the value check before step 0")
    r.add_argument("--deadline-s", type=float, help="start no run that cannot finish; stop a run past this")
    r.set_defaults(func=cmd_run)
    v = sub.add_parser("product-values", help="(internal) the engine's values of check rows")
    v.add_argument("--checkpoint", action="append", required=True, help="ARM=CHECKPOINT")
    v.add_argument("--rows", required=True)
    v.add_argument("--out", required=True)
    v.set_defaults(func=cmd_product_values)
    rep = sub.add_parser("report", help="table, JSON and figure of a runs folder (CPU)")
    rep.add_argument("runs")
    rep.add_argument("--out", required=True)
    rep.add_argument("--reference", default="a", help="the arm whose final held-out success is the target")
    rep.add_argument("--early-steps", type=int, default=5)
    rep.add_argument(
        "--also",
        action="append",
        default=[],
        help="a folder of seeds run another way than RUNS' same seeds (another card or micro-batches): "
        "each of its seeds is a paired block of its own",
    )
    rep.set_defaults(func=cmd_report)
    t = sub.add_parser("tiny", help="a tiny random actor (and synthetic rollouts) for the CPU smoke")
    t.add_argument("out")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("--rollouts", help="TASKS file: also write OUT/rollouts.jsonl")
    t.set_defaults(func=cmd_tiny)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
