"""Does a critic trained here predict real returns on real rollouts? A study on SmolLM2-135M-Instruct.

Three phases (the first on any CPU, the others on a GPU; `bench/h200.sh study` runs them there):

    python bench/real_rollouts.py tasks TASKS.jsonl                  # reasoning-gym items (CPU)
    python bench/real_rollouts.py generate TASKS.jsonl --model HF_DIR --out ROLLOUTS.jsonl
    python bench/real_rollouts.py study ROLLOUTS.jsonl --model HF_DIR --work DIR [--out RESULTS_DIR]

- tasks: procedurally generated arithmetic items of graded difficulty from `reasoning-gym`
  (deterministic by seed), each asked with three solved examples of the same family (few-shot),
  as a chat prompt "Answer with only the final number".
- generate: samples several answers per item from the actor (temperature chosen per family on a
  calibration subset so that the family's success rate lies between 15% and 85% where any tried
  temperature allows it), reward 1 for an exactly correct first integer, else 0. Writes text
  rollouts (prompt messages, response text, reward, task, item id): the format `import-rollouts`
  reads.
- study: `value-assets import-rollouts` (held-out split by item: a prompt's samples never straddle
  splits), then critics bootstrapped from the same actor are trained (`value-assets train`) and
  gated (`value-assets evaluate`); the same rollouts with rewards shuffled across rows are the
  negative controls (one per `--shuffle-seeds` seed and configuration; `--controls-only` runs just
  them), each gated under both rules on the same batches. Every report is kept under `reports/`. Each critic is exported
  (`export-hf`) and run over every held-out row to
  compare, on held-out prompts, with two baselines: the per-task mean predictor (the train split's
  success rate of the row's task: knows only which task) and the prompt-only value (the critic's
  own value at the first response token, held for the whole response). Every EV carries a 95%
  bootstrap interval over prompts (core/intervals.py). Prints a table, writes `real_rollouts.json`,
  `real_rollouts.md` and `real_rollouts.png`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

INSTRUCTION = "Answer with only the final number."
# name, reasoning-gym config (basic_arithmetic), in rough order of difficulty for a 135M model.
FAMILIES = [
    ("add-1digit", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))),
    ("sub-1digit", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("-",))),
    ("mul-1digit", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("*",))),
    ("add-3terms", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1, operators=("+",))),
    ("add-2digit", dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=("+",))),
    ("addsub-2digit", dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=("+", "-"))),
]
COMMON = dict(allow_parentheses=False, allow_negation=False)


def cmd_tasks(args) -> None:
    import reasoning_gym as rg

    out = []
    for f_index, (family, cfg) in enumerate(FAMILIES):
        shots = list(rg.create_dataset("basic_arithmetic", size=3, seed=10_000 + f_index, **COMMON, **cfg))
        items = rg.create_dataset("basic_arithmetic", size=args.per_family, seed=args.seed + f_index, **COMMON, **cfg)
        # Few-shot as earlier chat turns: a small chat model follows solved turns far better than
        # examples inlined in one message.
        shots_turns = [{"role": "system", "content": INSTRUCTION}]
        for s in shots:
            shots_turns += [
                {"role": "user", "content": s["question"]},
                {"role": "assistant", "content": str(s["answer"])},
            ]
        for i, item in enumerate(items):
            out.append(
                {
                    "item": f"{family}/{i}",
                    "task": family,
                    "question": item["question"],
                    "answer": str(item["answer"]).strip(),
                    "prompt": shots_turns + [{"role": "user", "content": item["question"]}],
                }
            )
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in out))
    print(f"wrote {len(out)} items ({args.per_family} per family, {len(FAMILIES)} families) to {args.out}")


_INT = re.compile(r"-?\d+")


def score(response: str, answer: str) -> float:
    """1 when the final integer of the response's first line is the answer ("8 + 4 = 12" -> 12)."""
    first = response.strip().split("\n", 1)[0] if response.strip() else ""
    found = _INT.findall(first)
    return 1.0 if found and found[-1] == answer else 0.0


def _sample(
    model, tok, prompts: list[str], temperature: float, max_new_tokens: int, batch: int, seed: int
) -> list[str]:
    import torch

    torch.manual_seed(seed)
    texts = []
    for start in range(0, len(prompts), batch):
        enc = tok(prompts[start : start + batch], return_tensors="pt", padding=True, add_special_tokens=False).to(
            model.device
        )
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=tok.pad_token_id or tok.eos_token_id,
            )
        texts += tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return [t.strip() for t in texts]


def cmd_generate(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    items = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (
        AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        .to(device)
        .eval()
    )
    rendered = {
        it["item"]: tok.apply_chat_template(it["prompt"], tokenize=False, add_generation_prompt=True) for it in items
    }
    by_family = defaultdict(list)
    for it in items:
        by_family[it["task"]].append(it)
    t0 = time.time()
    chosen: dict[str, dict] = {}
    for family, fam_items in by_family.items():
        calib = fam_items[: args.calibrate]
        tried = []
        for temp in args.temperatures:
            texts = _sample(
                model,
                tok,
                [rendered[it["item"]] for it in calib for _ in range(args.samples)],
                temp,
                args.max_new_tokens,
                args.batch,
                args.seed,
            )
            rate = float(
                np.mean(
                    [
                        score(t, it["answer"])
                        for t, it in zip(texts, [it for it in calib for _ in range(args.samples)], strict=True)
                    ]
                )
            )
            tried.append((temp, rate))
            if 0.15 <= rate <= 0.85:
                break
        temp, rate = next(((t, r) for t, r in tried if 0.15 <= r <= 0.85), min(tried, key=lambda tr: abs(tr[1] - 0.5)))
        chosen[family] = {"temperature": temp, "calibration_rate": rate, "tried": tried}
        print(f"{family:<14} calibration {tried} -> temperature {temp}", flush=True)
    rows = []
    for family, fam_items in by_family.items():
        temp = chosen[family]["temperature"]
        # Calibration items are not reused: every item in the study is sampled once, fresh.
        fam_items = fam_items[args.calibrate :]
        expanded = [it for it in fam_items for _ in range(args.samples)]
        texts = _sample(
            model, tok, [rendered[it["item"]] for it in expanded], temp, args.max_new_tokens, args.batch, args.seed + 1
        )
        for k, (it, text) in enumerate(zip(expanded, texts, strict=True)):
            rows.append(
                {
                    "id": f"{it['item']}#{k % args.samples}",
                    "item": it["item"],
                    "task": family,
                    "prompt": it["prompt"],
                    "response": text if text else " ",
                    "reward": score(text, it["answer"]),
                    "answer": it["answer"],
                    "temperature": temp,
                }
            )
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A small real sample (the first items of every family, all their samples) for tests/data.
    first = {
        f: {it["item"] for it in fam[args.calibrate : args.calibrate + args.sample_items]}
        for f, fam in by_family.items()
    }
    sample = [r for r in rows if r["item"] in first[r["task"]]]
    Path(args.out).with_suffix(".sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sample))
    meta = {
        "model": args.model,
        "samples_per_item": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "families": chosen,
        "rows": len(rows),
        "seconds": round(time.time() - t0, 1),
        "success": {f: float(np.mean([r["reward"] for r in rows if r["task"] == f])) for f in by_family},
    }
    Path(args.out).with_suffix(".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta["success"], indent=1))


# ---------------------------------------------------------------- study


def _va(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "value_assets.cli", *argv]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode not in (0, 3):
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"failed ({res.returncode}): {' '.join(argv[:3])}")
    return res


def _last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def _per_row_values(hf_dir: Path, rows, device: str):
    """Values per response token of every row from the exported critic (transformers)."""
    import torch
    from transformers import AutoModelForTokenClassification

    head = json.loads((hf_dir / "value_head.json").read_text())
    model = AutoModelForTokenClassification.from_pretrained(str(hf_dir), dtype=torch.float32).to(device).eval()
    support = None
    if head.get("support"):
        low, high, k = head["support"]
        support = torch.linspace(low, high, int(k), dtype=torch.float64, device=device)
    out = []
    for start in range(0, len(rows), 64):
        chunk = rows[start : start + 64]
        width = max(len(r.tokens) - 1 for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        att = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, : len(r.tokens) - 1] = torch.as_tensor(r.tokens[:-1])
            att[i, : len(r.tokens) - 1] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.double()
        values = (logits.softmax(-1) @ support) if support is not None else logits[..., 0]
        for i, r in enumerate(chunk):
            out.append(values[i, r.prompt_length - 1 : len(r.tokens) - 1].cpu().numpy())
    return out


def _metrics(name, rows, values, prompt_of, resamples, seed):
    from value_assets.core.intervals import bootstrap_ev_interval, decile_stats, ev_by_position
    from value_assets.core.stats import SuffStats, auroc, token_stats, trajectory_stats

    tok_by, traj_by = defaultdict(list), defaultdict(list)
    traj_values, labels, deciles = [], [], []
    for r, v in zip(rows, values, strict=True):
        tok_by[prompt_of(r)].append(token_stats(r.returns, v, r.loss_mask))
        traj_by[prompt_of(r)].append(trajectory_stats(r.returns, v, r.loss_mask))
        m = np.asarray(r.loss_mask).astype(bool)
        traj_values.append(float(np.asarray(v)[m].mean()))
        labels.append(float(np.asarray(r.returns)[m].mean()))
        deciles.append(decile_stats(r.returns, v, r.loss_mask))
    # Units of the bootstrap are prompts: a prompt's samples share its difficulty.
    tok_units = [SuffStats.merge(p) for p in tok_by.values()]
    traj_units = [SuffStats.merge(p) for p in traj_by.values()]
    tok_iv = bootstrap_ev_interval(tok_units, resamples=resamples, seed=seed)
    traj_iv = bootstrap_ev_interval(traj_units, resamples=resamples, seed=seed)
    tv, lb = np.array(traj_values), np.array(labels)
    bins = np.clip((tv * 10).astype(int), 0, 9)
    calib = [
        {
            "bin": b,
            "rows": int((bins == b).sum()),
            "mean_value": float(tv[bins == b].mean()),
            "success": float(lb[bins == b].mean()),
        }
        for b in range(10)
        if (bins == b).any()
    ]
    ece = float(sum(c["rows"] * abs(c["mean_value"] - c["success"]) for c in calib) / len(tv))
    return {
        "method": name,
        "token_ev": tok_iv.to_json(),
        "trajectory_ev": traj_iv.to_json(),
        "auroc": auroc(tv.tolist(), lb.tolist()),
        "ece": ece,
        "calibration": calib,
        "ev_by_decile": ev_by_position(deciles),
    }


def cmd_study(args) -> None:
    from gate_controls import decide_under

    from value_assets.core.dataset import validate_dataset
    from value_assets.core.manifest import load_manifest

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or work)
    out.mkdir(parents=True, exist_ok=True)
    rollouts = [json.loads(line) for line in Path(args.rollouts).read_text().splitlines() if line.strip()]
    success = defaultdict(list)
    for r in rollouts:
        success[r["task"]].append(r["reward"])
    rates = {t: float(np.mean(v)) for t, v in success.items()}
    kept = sorted(t for t, r in rates.items() if args.min_rate <= r <= args.max_rate)
    print("success by task:", {t: round(r, 3) for t, r in rates.items()}, "kept:", kept, flush=True)
    rows = [r for r in rollouts if r["task"] in kept]
    study_file = work / "study_rollouts.jsonl"
    study_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = {"real": study_file}
    for seed in args.shuffle_seeds:
        # A control per seed: the same rows, rewards permuted across rows (independent of the text).
        shuffled = [dict(r) for r in rows]
        perm = random.Random(seed).sample([r["reward"] for r in rows], len(rows))
        for r, w in zip(shuffled, perm, strict=True):
            r["reward"] = w
        sources[f"shuffled-s{seed}"] = work / f"shuffled_rollouts_s{seed}.jsonl"
        sources[f"shuffled-s{seed}"].write_text("".join(json.dumps(r) + "\n" for r in shuffled))

    results = {
        "rollouts": len(rollouts),
        "study_rows": len(rows),
        "task_success": rates,
        "kept_tasks": kept,
        "runs": [],
    }
    manifests = {}
    for tag, src in sources.items():
        res = _va(
            "import-rollouts",
            str(src),
            "--tokenizer",
            args.model,
            "--out",
            str(work / f"ds-{tag}"),
            "--id-field",
            "id",
            "--group-field",
            "item",
            "--heldout-fraction",
            str(args.heldout_fraction),
            "--seed",
            str(args.seed),
            "--name",
            tag,
        )
        if res.returncode:
            sys.stderr.write(res.stderr)
            raise SystemExit("import-rollouts failed")
        info = _last_json(res.stdout)
        manifests[tag] = Path(info["manifest"])
        results[f"import_{tag}"] = info
        print(f"import {tag}: {info}", flush=True)
    m = load_manifest(manifests["real"])
    train_ds = validate_dataset(m.train, m.objective)
    held_ds = validate_dataset(m.heldout, m.objective)
    train_ids = [train_ds.row(i).sample_id for i in range(len(train_ds))]
    held_rows = [held_ds.row(i) for i in range(len(held_ds))]
    by_id = {r["id"]: r for r in rows}
    task_of = lambda row: by_id[row.sample_id]["task"]  # noqa: E731
    prompt_of = lambda row: by_id[row.sample_id]["item"]  # noqa: E731
    task_mean = defaultdict(list)
    for sid in train_ids:
        task_mean[by_id[sid]["task"]].append(by_id[sid]["reward"])
    task_mean = {t: float(np.mean(v)) for t, v in task_mean.items()}
    results["train_task_means"] = task_mean
    g, nb = args.eval_batch_size, args.eval_batches
    device = "cuda"
    import torch

    if not torch.cuda.is_available():
        device = "cpu"
    methods = [
        _metrics(
            "per-task mean",
            held_rows,
            [np.full(r.response_length, task_mean[task_of(r)]) for r in held_rows],
            prompt_of,
            args.resamples,
            args.seed,
        )
    ]
    # Each control mirrors a real configuration (the first full fine-tune lr, the first head-only lr).
    configs = [(args.lrs[0], "none")] + ([(args.freeze_lrs[0], "backbone")] if args.freeze_lrs else [])
    plan = [(f"shuffled-s{seed}", lr, args.epochs, freeze) for lr, freeze in configs for seed in args.shuffle_seeds]
    if not args.controls_only:
        plan += [("real", lr, args.epochs, "none") for lr in args.lrs]
        plan += [("real", lr, args.epochs, "backbone") for lr in args.freeze_lrs]
    reports = out / "reports"
    reports.mkdir(exist_ok=True)
    for tag, lr, epochs, freeze in plan:
        name = f"{tag}{'-freeze-' + freeze if freeze != 'none' else ''}-lr{lr:g}-e{epochs}"
        cdir = work / f"critic-{name}"
        t0 = time.time()
        tr = _va(
            "train",
            str(manifests[tag]),
            "--output",
            str(cdir),
            "--backbone",
            args.model,
            "--gpus",
            "1",
            "--global-batch-size",
            str(args.batch_size),
            "--epochs",
            str(epochs),
            "--lr",
            str(lr),
            "--warmup-steps",
            str(args.warmup),
            "--micro-batch-tokens",
            "16384",
            "--freeze",
            freeze,
        )
        if tr.returncode:
            sys.stderr.write(tr.stderr[-3000:])
            raise SystemExit(f"train {name} failed")
        contract = _last_json(tr.stdout)["contract_sha256"]
        train_s = time.time() - t0
        ev = _va(
            "evaluate",
            "--checkpoint",
            str(cdir),
            "--manifest",
            str(manifests[tag]),
            "--contract-sha256",
            contract,
            "--report",
            str(work / f"ev-{name}.json"),
            "--global-batch-size",
            str(g),
            "--num-batches",
            str(nb),
            "--gpus",
            "1",
        )
        gate = _last_json(ev.stdout)
        report = json.loads((work / f"ev-{name}.json").read_text())
        (reports / f"ev-{name}.json").write_text(json.dumps(report) + "\n")
        # The stricter rules decided on the same batches (bench/gate_controls.py).
        decision = decide_under(report, "interval", 0.0)
        barred = decide_under(report, "interval", args.min_ev).passed
        lows = {w: (iv.low if iv is not None else None) for w, iv in decision.intervals.items()}
        run = {
            "name": name,
            "manifest": tag,
            "lr": lr,
            "epochs": epochs,
            "freeze": freeze,
            "train_s": round(train_s, 1),
            "gate_passed": gate["passed"],
            "report_token_ev": gate["token_ev"],
            "report_trajectory_ev": gate["trajectory_ev"],
            "report_auroc": gate["auroc"],
            "interval_gate_passed": decision.passed,
            "interval_low": lows,
            "min_ev": args.min_ev,
            "interval_min_ev_gate_passed": barred,
        }
        print(
            f"{name}: gate {'PASSED' if gate['passed'] else 'FAILED'}, interval gate "
            f"{'PASSED' if decision.passed else 'FAILED'} (lower bounds {lows}), interval gate with min EV "
            f"{args.min_ev:g} {'PASSED' if barred else 'FAILED'}; token EV {gate['token_ev']:.4f} "
            f"trajectory EV {gate['trajectory_ev']:.4f} ({train_s:.0f}s)",
            flush=True,
        )
        if tag == "real":
            hf = work / f"hf-{name}"
            _va("export-hf", "--checkpoint", str(cdir), "--out", str(hf))
            values = _per_row_values(hf, held_rows, device)
            methods.append(_metrics(f"critic {name}", held_rows, values, prompt_of, args.resamples, args.seed))
            methods.append(
                _metrics(
                    f"prompt-only {name}",
                    held_rows,
                    [np.full(v.shape, v[0]) for v in values],
                    prompt_of,
                    args.resamples,
                    args.seed,
                )
            )
        results["runs"].append(run)
        # Saved after every run, so a run cut short by a time limit keeps what it measured.
        (out / "partial_runs.json").write_text(json.dumps(results["runs"], indent=1) + "\n")
    results["methods"] = methods
    labels = [float(r.returns[0]) for r in held_rows]
    results["heldout"] = {
        "rows": len(held_rows),
        "prompts": len({prompt_of(r) for r in held_rows}),
        "label_balance": {"1.0": int(sum(labels)), "0.0": len(labels) - int(sum(labels))},
    }
    results["train"] = {"rows": len(train_ids)}
    stem = "real_rollouts_controls" if args.controls_only else "real_rollouts"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    table = _table(results)
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
    if not args.controls_only:
        _plot(results, out / "real_rollouts.png")


def _fmt_iv(iv) -> str:
    if iv["estimate"] is None:
        return "n/a"
    if iv["low"] is None:
        return f"{iv['estimate']:.3f}"
    return f"{iv['estimate']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def _table(results) -> str:
    lines = [
        f"held-out: {results['heldout']['rows']} rows, {results['heldout']['prompts']} prompts, labels "
        f"{results['heldout']['label_balance']}; "
        f"train: {results['train']['rows']} rows; tasks {results['kept_tasks']}",
        "",
        "| method | token EV [95% CI over prompts] | trajectory EV [95% CI] | AUROC | ECE |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in results["methods"]:
        au = "n/a" if m["auroc"] is None else f"{m['auroc']:.3f}"
        lines.append(
            f"| {m['method']} | {_fmt_iv(m['token_ev'])} | {_fmt_iv(m['trajectory_ev'])} | {au} | {m['ece']:.3f} |"
        )
    bar = next((r["min_ev"] for r in results["runs"] if "min_ev" in r), None)
    lines += [
        "",
        f"| run | gate (miles) | gate (interval) | gate (interval, min EV {bar}) | report token EV | report "
        "trajectory EV | interval lower bounds (token, trajectory) | train s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdict = {True: "PASSED", False: "FAILED", None: "-"}
    for r in results["runs"]:
        low = r.get("interval_low") or {}
        lows = (
            ", ".join("n/a" if low.get(w) is None else f"{low[w]:.4f}" for w in ("token", "trajectory")) if low else "-"
        )
        lines.append(
            f"| {r['name']} | {verdict[r['gate_passed']]} | {verdict[r.get('interval_gate_passed')]} | "
            f"{verdict[r.get('interval_min_ev_gate_passed')]} | {r['report_token_ev']:.4f} | "
            f"{r['report_trajectory_ev']:.4f} | {lows} | {r['train_s']} |"
        )
    return "\n".join(lines)


def _plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    ms = results["methods"]
    names = [m["method"] for m in ms]
    for k, (key, color) in enumerate((("token_ev", "tab:blue"), ("trajectory_ev", "tab:orange"))):
        est = [m[key]["estimate"] or 0.0 for m in ms]
        lo = [e - (m[key]["low"] if m[key]["low"] is not None else e) for e, m in zip(est, ms, strict=True)]
        hi = [(m[key]["high"] if m[key]["high"] is not None else e) - e for e, m in zip(est, ms, strict=True)]
        a.barh(np.arange(len(ms)) + 0.4 * k, est, height=0.4, xerr=[lo, hi], color=color, label=key.replace("_", " "))
    a.set_yticks(np.arange(len(ms)) + 0.2, names, fontsize=7)
    a.axvline(0, color="k", lw=0.8)
    a.set_xlabel("explained variance on held-out prompts (95% CI)")
    a.legend(fontsize=8)
    for m in ms:
        if m["calibration"]:
            b.plot(
                [x["mean_value"] for x in m["calibration"]],
                [x["success"] for x in m["calibration"]],
                "o-",
                ms=3,
                label=m["method"],
            )
    b.plot([0, 1], [0, 1], "k--", lw=0.8)
    b.set_xlabel("predicted success (trajectory value)")
    b.set_ylabel("observed success")
    b.legend(fontsize=6)
    for m in ms:
        if m["method"].startswith("critic"):
            c.plot(range(1, 11), [np.nan if x is None else x for x in m["ev_by_decile"]], "o-", label=m["method"])
    c.set_xlabel("response decile")
    c.set_ylabel("token EV")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tasks")
    t.add_argument("out")
    t.add_argument("--per-family", type=int, default=500)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_tasks)
    gen = sub.add_parser("generate")
    gen.add_argument("tasks")
    gen.add_argument("--model", required=True)
    gen.add_argument("--out", required=True)
    gen.add_argument("--samples", type=int, default=4)
    gen.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.4, 0.2])
    gen.add_argument("--calibrate", type=int, default=48, help="items per family used only to choose the temperature")
    gen.add_argument("--max-new-tokens", type=int, default=12)
    gen.add_argument("--batch", type=int, default=1024)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--sample-items", type=int, default=12, help="items per family copied to OUT.sample.jsonl")
    gen.set_defaults(func=cmd_generate)
    s = sub.add_parser("study")
    s.add_argument("rollouts")
    s.add_argument("--model", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--out")
    s.add_argument("--lrs", type=float, nargs="+", default=[2e-5, 1e-4])
    s.add_argument(
        "--freeze-lrs",
        type=float,
        nargs="*",
        default=[1e-3],
        help="learning rates of the `--freeze backbone` critics (only the value head trains)",
    )
    s.add_argument("--epochs", type=int, default=2)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--warmup", type=int, default=10)
    s.add_argument("--heldout-fraction", type=float, default=0.2)
    s.add_argument("--eval-batch-size", type=int, default=64)
    s.add_argument("--eval-batches", type=int, default=8)
    s.add_argument("--min-rate", type=float, default=0.1)
    s.add_argument("--max-rate", type=float, default=0.9)
    s.add_argument("--resamples", type=int, default=2000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--shuffle-seeds",
        type=int,
        nargs="+",
        default=[0],
        help="one shuffled-reward control per seed and configuration (the reward permutation's seed)",
    )
    s.add_argument(
        "--min-ev",
        type=float,
        default=0.005,
        help="the minimum useful EV of the third verdict (interval rule, lower bounds > it)",
    )
    s.add_argument(
        "--controls-only",
        action="store_true",
        help="train and gate only the shuffled controls; results go to real_rollouts_controls.{json,md}",
    )
    s.set_defaults(func=cmd_study)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
