"""The report of bench/rl_with_critic.py (`report RUNS --out DIR`): rl.json, rl.md (the table) and rl.png.

Per arm: final held-out success with a 95% t-interval over seeds, its difference to the reference
arm paired by seed (final and the mean over the held-out curve), steps to reach the reference arm's
final success, the early mean advantage (advantage bias) and value EV, the value EV over all steps,
the gate's token EV and the largest TRL-vs-product value difference; then whether the gate's EV
ranks the arms as their RL benefit does (Spearman). Runs whose settings differ are refused, and so
is a seed whose arms ran on different cards or micro-batches (differences are paired by seed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# Student t 0.975 quantiles by degrees of freedom (no scipy needed).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def ci(xs) -> tuple[float | None, float | None, float | None]:
    """Mean and 95% t-interval over seeds (no interval from one seed)."""
    a = np.asarray([x for x in xs if x is not None and np.isfinite(x)], dtype=float)
    if len(a) == 0:
        return None, None, None
    m = float(a.mean())
    if len(a) < 2:
        return m, None, None
    h = _T975.get(len(a) - 1, 1.96) * a.std(ddof=1) / math.sqrt(len(a))
    return m, m - h, m + h


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def load_runs(root: Path) -> dict[str, dict[int, dict]]:
    """{arm: {seed: {meta, steps}}} of every `<arm>-s<seed>` folder (finished or not)."""
    runs: dict[str, dict[int, dict]] = {}
    for d in sorted(p for p in root.iterdir() if (p / "steps.jsonl").is_file()):
        meta_file = next((d / f for f in ("done.json", "partial.json") if (d / f).is_file()), None)
        meta = json.loads(meta_file.read_text()) if meta_file else {"status": "incomplete"}
        steps = [json.loads(line) for line in (d / "steps.jsonl").read_text().splitlines() if line.strip()]
        arm, _, seed = d.name.rpartition("-s")
        runs.setdefault(arm, {})[int(seed)] = {"meta": meta, "steps": steps}
    return runs


def execution(meta: dict) -> dict:
    """Where and how a run was executed: the card and the micro-batches of each PPO mini-batch
    (runs made before `execution` was recorded used one)."""
    return {
        "device": (meta.get("versions") or {}).get("cuda") or "cpu",
        "micro_batches": (meta.get("execution") or {}).get("micro_batches", 1),
    }


def seed_blocks(runs: dict) -> dict[int, dict]:
    """{seed: execution} once every arm of each seed ran the same way: differences are paired by seed,
    so a seed is one block (sessions may differ, a seed's arms may not)."""
    blocks: dict[int, dict[str, list[str]]] = {}
    for arm, seeds in runs.items():
        for seed, r in seeds.items():
            key = json.dumps(execution(r["meta"]), sort_keys=True)
            blocks.setdefault(seed, {}).setdefault(key, []).append(arm)
    for seed, ways in blocks.items():
        if len(ways) > 1:
            raise SystemExit(
                f"seed {seed}: its arms ran in different ways, not a paired block: "
                + "; ".join(f"{sorted(arms)} {key}" for key, arms in sorted(ways.items()))
            )
    return {seed: json.loads(next(iter(ways))) for seed, ways in sorted(blocks.items())}


def _curve(run: dict, key: str = "sampled") -> list[tuple[int, float]]:
    return [(s["step"], s["heldout"][key]) for s in run["steps"] if "heldout" in s]


def _probe(run: dict, key: str, first: int | None = None) -> float | None:
    """The mean of a probe value over the steps (the first `first` steps)."""
    return _mean([s.get(key) for s in run["steps"] if "adv_mean" in s][:first])


def _done(runs: dict) -> dict[str, dict[int, dict]]:
    return {arm: {s: r for s, r in seeds.items() if r["meta"].get("status") == "done"} for arm, seeds in runs.items()}


def merged(main: dict, others) -> dict[str, dict[int, dict]]:
    """`main`'s runs with each other folder's runs of a seed `main` lacks for that arm, first folder
    first: one run per arm and seed, for the absolute columns and the figure."""
    out = {arm: dict(seeds) for arm, seeds in main.items()}
    for rs in others:
        for arm, seeds in rs.items():
            for seed, r in seeds.items():
                out.setdefault(arm, {}).setdefault(seed, r)
    return out


def summarize(runs: dict, plan: dict, ref: str, early: int, extra: dict[str, dict] | None = None) -> dict[str, Any]:
    """`runs`: the main folder's runs. `extra` {folder name: its runs}: folders whose seeds ran another
    way than the main folder's same seed (another card, other micro-batches). Each of their seeds is
    a paired block of its own: its arms' differences from its own reference run enter the paired
    columns; an arm's absolute columns take its run of a seed from the main folder, else from the
    first extra folder that has one (a seed's run enters each arm's absolute columns once)."""
    extra = extra or {}
    every = [runs, *extra.values()]
    settings = {
        json.dumps(r["meta"].get("settings"), sort_keys=True)
        for rs in every
        for seeds in rs.values()
        for r in seeds.values()
    }
    if len(settings) > 1:
        raise SystemExit(f"the runs were made with different settings, not comparable: {sorted(settings)}")
    blocks = seed_blocks(runs)
    extra_blocks = {name: seed_blocks(rs) for name, rs in extra.items()}
    done = _done(runs)
    extra_done = {name: _done(rs) for name, rs in extra.items()}
    ref_final = {s: _curve(r)[-1][1] for s, r in done.get(ref, {}).items() if _curve(r)}
    target = _mean(ref_final.values())
    # The paired blocks: (arm's run, reference run) of one seed, one folder.
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    for d in [done, *extra_done.values()]:
        for arm, seeds in d.items():
            if arm == ref and d is not done:
                continue  # the reference's own difference is 0 by construction: counted once
            for seed, r in seeds.items():
                ref_run = d.get(ref, {}).get(seed)
                if ref_run is not None and _curve(r) and _curve(ref_run):
                    pairs.setdefault(arm, []).append((r, ref_run))
    done = merged(done, extra_done.values())  # seeds the main folder lacks, for the absolute columns
    out: dict[str, Any] = {
        "plan": plan,
        "target": {"reference_arm": ref, "final_heldout_sampled": target},
        "seeds": blocks,
        "extra_blocks": extra_blocks,
        "arms": {},
    }

    def reach(curve) -> int | None:
        return next((st for st, v in curve if target is not None and v is not None and v >= target), None)

    for arm, fin in sorted(done.items()):
        curves = {s: _curve(r) for s, r in fin.items() if _curve(r)}
        finals = {s: c[-1][1] for s, c in curves.items()}
        steps = sorted({st for c in curves.values() for st, _ in c})
        mean_curve = [(st, _mean(dict(c).get(st) for c in curves.values())) for st in steps]

        gated = [r["meta"]["spec"] for r in fin.values() if (r["meta"].get("spec") or {}).get("gate_ev")]
        if gated:  # each run's own critic (every session retrains them, bench/README.md): their mean
            passed = {sp.get("gate_passed") for sp in gated}
            spec = {
                "gate_ev": {k: _mean(sp["gate_ev"].get(k) for sp in gated) for k in ("token", "trajectory")},
                "gate_ev_interval": gated[0].get("gate_ev_interval") if len(gated) == 1 else None,
                "gate_passed": passed.pop() if len(passed) == 1 else "mixed",
            }
        else:  # runs made before each run recorded its critic: the plan's
            spec = plan.get("arms", {}).get(arm, {})
        checks = [
            r["meta"].get("value_check", {}).get("max_abs_diff") for rs in every for r in rs.get(arm, {}).values()
        ]
        out["arms"][arm] = {
            "seeds_done": sorted(fin),
            "seeds_started": sorted({s for rs in every for s in rs.get(arm, {})}),
            "final_heldout_sampled": ci(finals.values()),
            "final_heldout_greedy": ci(_curve(r, "greedy")[-1][1] for r in fin.values() if _curve(r, "greedy")),
            "final_minus_reference": ci(_curve(r)[-1][1] - _curve(q)[-1][1] for r, q in pairs.get(arm, [])),
            "auc_minus_reference": ci(
                _mean(v for _, v in _curve(r)) - _mean(v for _, v in _curve(q)) for r, q in pairs.get(arm, [])
            ),
            "paired_blocks": len(pairs.get(arm, [])),
            "mean_curve_steps_to_target": reach(mean_curve),
            "steps_to_target": {s: reach(c) for s, c in curves.items()},
            "early_adv_mean": ci(_probe(r, "adv_mean", early) for r in fin.values()),
            "early_value_ev_outcome": ci(_probe(r, "value_ev_outcome", early) for r in fin.values()),
            "value_ev_outcome": ci(_probe(r, "value_ev_outcome") for r in fin.values()),
            "value_check_max_abs_diff": max((c for c in checks if c is not None), default=None),
            "gate_ev": spec.get("gate_ev"),
            "gate_ev_interval": spec.get("gate_ev_interval"),
            "gate_passed": spec.get("gate_passed"),
            "mean_curve": mean_curve,
        }
    # The gate's question: does the critics' held-out EV rank the arms as their RL benefit does?
    ranked = [
        (a, v["gate_ev"]["token"], v["auc_minus_reference"][0])
        for a, v in out["arms"].items()
        if v.get("gate_ev") and v["auc_minus_reference"][0] is not None
    ]
    out["ranking"] = {
        "by_gate_token_ev": [a for a, _, _ in sorted(ranked, key=lambda x: -x[1])],
        "by_rl_benefit_auc": [a for a, _, _ in sorted(ranked, key=lambda x: -x[2])],
        "spearman": _spearman([e for _, e, _ in ranked], [b for _, _, b in ranked]) if len(ranked) >= 3 else None,
        "arms": len(ranked),
    }
    return out


def _ranks(xs) -> np.ndarray:
    """Ranks with ties averaged."""
    xs = np.asarray(xs, dtype=float)
    return np.array([np.mean(np.flatnonzero(np.sort(xs) == x)) for x in xs])


def _spearman(a, b) -> float | None:
    """Spearman's correlation; None where either side does not vary (no ranking to compare)."""
    ra, rb = _ranks(a), _ranks(b)
    return None if ra.std() == 0 or rb.std() == 0 else float(np.corrcoef(ra, rb)[0, 1])


def _fmt(interval, digits: int = 3) -> str:
    m, lo, hi = interval
    if m is None:
        return "n/a"
    return f"{m:.{digits}f}" + (f" [{lo:.{digits}f}, {hi:.{digits}f}]" if lo is not None else "")


def table(results: dict, early: int) -> str:
    ref, tgt = results["target"]["reference_arm"], results["target"]["final_heldout_sampled"]
    lines = [
        f"Target: arm {ref}'s final held-out success (sampled), mean over its seeds: "
        f"{'n/a' if tgt is None else f'{tgt:.3f}'}. Intervals: 95% t-intervals over seeds; differences paired by seed.",
        "",
        f"| arm | seeds | final held-out success [95% CI] | minus arm {ref} (paired) | held-out AUC minus {ref} | "
        f"greedy final | steps to target (seed-mean curve; per seed) | mean advantage, first {early} steps | "
        f"value EV (outcome), first {early} steps | value EV, all steps | gate token EV | "
        "TRL vs product, max abs diff |",
        "|" + " --- |" * 12,
    ]
    for arm, a in sorted(results["arms"].items()):
        gate, diff = (a["gate_ev"] or {}).get("token"), a["value_check_max_abs_diff"]
        per_seed = ", ".join(f"s{s}: {v}" for s, v in sorted(a["steps_to_target"].items()))
        cells = [
            arm,
            f"{len(a['seeds_done'])}/{len(a['seeds_started'])}",
            _fmt(a["final_heldout_sampled"]),
            _fmt(a["final_minus_reference"]) + f" ({a['paired_blocks']} pairs)",
            _fmt(a["auc_minus_reference"]),
            _fmt(a["final_heldout_greedy"]),
            f"{a['mean_curve_steps_to_target']} ({per_seed})",
            _fmt(a["early_adv_mean"], 4),
            _fmt(a["early_value_ev_outcome"]),
            _fmt(a["value_ev_outcome"]),
            "n/a" if gate is None else f"{gate:.4f}",
            "n/a" if diff is None else f"{diff:.2e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    rk = results["ranking"]

    def way(e: dict) -> str:
        return f"{e['device']}, {e['micro_batches']} micro-batch{'es' if e['micro_batches'] > 1 else ''}"

    seeds = "; ".join(
        [f"seed {s}: {way(e)}" for s, e in results["seeds"].items()]
        + [
            f"{name}, seed {s}: {way(e)} (a block of its own)"
            for name, blocks in results.get("extra_blocks", {}).items()
            for s, e in blocks.items()
        ]
    )
    lines += [
        "",
        f"Each seed's arms ran on one card the same way ({seeds}).",
        "",
        f"Ranking by the gate's held-out token EV: {rk['by_gate_token_ev']}; by RL benefit (AUC minus {ref}): "
        f"{rk['by_rl_benefit_auc']}; Spearman {rk['spearman']} over {rk['arms']} arms.",
    ]
    return "\n".join(lines)


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("held-out success (sampled)", lambda s: s.get("heldout", {}).get("sampled")),
        ("mean reward (train batch)", lambda s: s.get("reward_mean")),
        ("value loss", lambda s: s.get("loss/value_avg")),
        ("value EV vs outcome", lambda s: s.get("value_ev_outcome")),
        ("KL to initial policy", lambda s: s.get("objective/kl")),
        ("mean raw advantage", lambda s: s.get("adv_mean")),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, (title, get) in zip(axes.flat, panels, strict=True):
        for k, (arm, seeds) in enumerate(sorted(runs.items())):
            series: dict[int, list[float]] = {}
            for r in seeds.values():
                for s in r["steps"]:
                    if get(s) is not None:
                        series.setdefault(s["step"], []).append(get(s))
            xs = sorted(series)
            if not xs:
                continue
            stats = [ci(series[x]) for x in xs]
            ax.plot(xs, [m for m, _, _ in stats], "-o" if len(xs) < 30 else "-", ms=3, label=arm, color=f"C{k}")
            lo = [m if low is None else low for m, low, _ in stats]
            hi = [m if high is None else high for m, _, high in stats]
            ax.fill_between(xs, lo, hi, alpha=0.2, color=f"C{k}")
        ax.set_title(title)
        ax.set_xlabel("PPO step")
    axes.flat[0].legend()
    fig.suptitle("PPO (TRL) with each critic: mean and 95% interval over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(root: Path, out: Path, reference: str, early: int, also: list[Path] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(root)
    extra = {p.name: load_runs(p) for p in also or []}
    plan = json.loads((root / "plan.json").read_text()) if (root / "plan.json").is_file() else {}
    results = summarize(runs, plan, reference, early, extra)
    (out / "rl.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results, early)
    (out / "rl.md").write_text(text + "\n")
    print(text)
    plot(merged(runs, extra.values()), out / "rl.png")
    print(f"wrote {out / 'rl.json'}, {out / 'rl.md'}, {out / 'rl.png'}")
