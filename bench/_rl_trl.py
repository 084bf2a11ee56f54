"""TRL's side of bench/rl_with_critic.py: the actor's tokenizer as TRL needs it, the critic as the RL side
loads it, the verifier as TRL's reward model, held-out evaluation, the value check before step 0, and
what each PPO step computed (read from TRL's own tensors, nothing of its algorithm replaced)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.real_rollouts import score as verify  # the study's verifier: one definition


def load_tokenizer(actor: str):
    """The actor's tokenizer, left-padded. TRL masks every position equal to the pad id (attention and
    loss), so the pad must never occur in a prompt: SmolLM2's `<|endoftext|>` (its chat template
    puts `<|im_start|>`/`<|im_end|>` in every prompt). TRL stops a response at the tokenizer's EOS,
    which `rl_with_critic.check_stop_token` requires to be the actor's stop token `<|im_end|>`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(actor)
    tok.padding_side = "left"
    if "<|endoftext|>" not in tok.get_vocab():
        raise SystemExit(f"{actor}: no <|endoftext|> token to pad with (a pad distinct from the prompt's tokens)")
    tok.pad_token = "<|endoftext|>"
    return tok


def load_value_model(folder: str):
    """The critic as the RL side loads it: transformers' Auto class on the folder, nothing rewritten
    (the actor's folder for the fresh arm: a new `score` head)."""
    import torch
    from transformers import AutoModelForTokenClassification

    model, info = AutoModelForTokenClassification.from_pretrained(
        folder, num_labels=1, dtype=torch.float32, output_loading_info=True
    )
    return model, {k: sorted(v) if isinstance(v, (set, list)) else str(v) for k, v in info.items() if v}


def encode_prompt(tok, item: dict) -> list[int]:
    text = tok.apply_chat_template(item["prompt"], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def verifier_reward_model(tok, items: list[dict]):
    """The task verifier as the reward *model* TRL's trainer calls (`get_reward(model, ...)` reads
    `model.score(hidden_states[-1])` at the last response token): its "hidden state" is the verifier's
    reward on every position and `score` is the identity."""
    import torch
    from torch import nn

    pad = tok.pad_token_id
    answers = {tuple(encode_prompt(tok, it)): it["answer"] for it in items}
    lengths = sorted({len(k) for k in answers}, reverse=True)

    class Verifier(nn.Module):
        def forward(self, input_ids, attention_mask=None, **_):
            out = torch.zeros(input_ids.shape[0], dtype=torch.float32)
            for b, row in enumerate(input_ids.tolist()):
                ids = row[attention_mask[b].tolist().index(True) :] if attention_mask[b].any() else []
                n = next((n for n in lengths if tuple(ids[:n]) in answers), None)
                if n is None:
                    raise RuntimeError("a query the verifier does not know: its reward would be undefined")
                resp = ids[n:]
                resp = resp[: resp.index(pad)] if pad in resp else resp  # TRL pads after the stop token
                out[b] = verify(tok.decode(resp, skip_special_tokens=True), answers[tuple(ids[:n])])
            hidden = out.to(input_ids.device)[:, None, None].expand(*input_ids.shape, 1)
            return SimpleNamespace(hidden_states=(hidden,))

    class VerifierReward(nn.Module):
        base_model_prefix = "verifier"

        def __init__(self):
            super().__init__()
            self.verifier = Verifier()
            self.score = nn.Identity()

    return VerifierReward()


def versions() -> dict:
    import torch
    import transformers
    import trl

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


# ----------------------------------------------------------------------------- held-out evaluation


def evaluate_policy(policy, tok, items: list[dict], temperature: float, max_new_tokens: int, batch: int, seed: int):
    """Held-out success, one sample per prompt at the RL temperature and greedy, overall and per family,
    under a forked RNG (evaluation does not change the training randomness)."""
    import torch

    device = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()
    out: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        for mode in ("sampled", "greedy"):
            sampled = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            kw = sampled if mode == "sampled" else {"do_sample": False}
            rewards: list[float] = []
            for s in range(0, len(items), batch):
                chunk = items[s : s + batch]
                enc = tok.pad([{"input_ids": encode_prompt(tok, it)} for it in chunk], return_tensors="pt").to(device)
                with torch.no_grad():
                    gen = policy.generate(
                        **enc,
                        max_new_tokens=max_new_tokens,
                        pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id,
                        **kw,
                    )
                texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                rewards += [verify(t, it["answer"]) for t, it in zip(texts, chunk, strict=True)]
            out[mode] = float(np.mean(rewards))
            out[f"{mode}_by_family"] = {
                f: float(np.mean([r for r, it in zip(rewards, items, strict=True) if it["task"] == f]))
                for f in sorted({it["task"] for it in items})
            }
    policy.train(was_training)
    return out


# ----------------------------------------------------------------------------- the value check before step 0


def trl_values(value_model, query_responses, pad_id: int, context_length: int):
    """Values exactly as TRL's PPO trainer computes them during rollout (value of response token j
    read at position prompt_len + j - 1, the product's read position)."""
    import torch
    from trl.experimental.utils import get_reward

    with torch.no_grad():
        full, _, _ = get_reward(value_model, query_responses, pad_id, context_length)
    return full[:, context_length - 1 : -1].squeeze(-1).float()


def make_check_rollouts(actor: str, items: list[dict], response_length: int, temperature: float, out: Path) -> dict:
    """Rollouts of the initial policy, padded exactly as TRL pads them (left-padded queries, responses
    cut after the stop token and right-padded): the same rows for every arm and seed; cached."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.experimental.ppo.ppo_trainer import truncate_response

    path = out / "check_rollouts.json"
    if path.is_file():
        return json.loads(path.read_text())
    tok = load_tokenizer(actor)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32).to(device).eval()
    enc = tok.pad([{"input_ids": encode_prompt(tok, it)} for it in items], return_tensors="pt").to(device)
    with torch.no_grad():
        torch.manual_seed(12345)
        gen = policy.generate(
            **enc,
            max_new_tokens=response_length,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ctx, pad = enc["input_ids"].shape[1], tok.pad_token_id
    qr = torch.cat([enc["input_ids"], truncate_response(tok.eos_token_id, pad, gen[:, ctx:].clone())], 1).cpu()
    rows = []
    for b in range(len(items)):
        q = [t for t in qr[b, :ctx].tolist() if t != pad]
        r = qr[b, ctx:].tolist()
        n = r.index(pad) if pad in r else len(r)
        rows.append({"tokens": q + r[:n], "prompt_len": len(q), "response_len": n})
    data = {"context_length": ctx, "query_responses": qr.tolist(), "pad_token_id": pad, "rows": rows}
    path.write_text(json.dumps(data))
    return data


def check_values(value_model, check: dict, product: dict | None) -> dict:
    """Max |TRL's values - the product's| over the response tokens of the check rollouts. TRL's: its
    own `get_reward` with the object handed to PPOTrainer. The product's: the engine critic built from
    the contracted checkpoint; for an arm without one (the fresh head), the same folder read unpadded
    by transformers, which checks TRL's padding and positions only."""
    import torch

    device = next(value_model.parameters()).device
    value_model.eval()
    rows = check["rows"]
    qr = torch.tensor(check["query_responses"], device=device)
    values = trl_values(value_model, qr, check["pad_token_id"], check["context_length"]).cpu()
    trl = [values[b, : r["response_len"]].tolist() for b, r in enumerate(rows)]
    if product is not None:
        ref = product["values"]
        against = f"the product's engine ({product['checkpoint']}, contract {product['contract_sha256'][:12]})"
    else:
        ref, against = [], "transformers, unpadded forward of the same folder (no contracted checkpoint)"
        backbone = getattr(value_model, value_model.base_model_prefix)
        with torch.no_grad():
            for r in rows:
                hidden = backbone(input_ids=torch.tensor([r["tokens"]], device=device)).last_hidden_state
                v = value_model.score(hidden)[0, :, 0].float().cpu()
                ref.append(v[r["prompt_len"] - 1 : len(r["tokens"]) - 1].tolist())
    if [len(x) for x in trl] != [len(x) for x in ref]:
        raise SystemExit("value check: response lengths differ between TRL's and the product's reading")
    diffs = [abs(a - b) for x, y in zip(trl, ref, strict=True) for a, b in zip(x, y, strict=True)]
    flat = [t for x in trl for t in x]
    return {
        "rows": len(rows),
        "tokens": len(flat),
        "against": against,
        "max_abs_diff": max(diffs, default=None),
        "mean_abs_diff": float(np.mean(diffs)) if diffs else None,
        "mean_value": float(np.mean(flat)) if flat else None,
    }


# ----------------------------------------------------------------------------- what each step computed


def _ev(target, pred) -> float | None:
    var = target.var(unbiased=False).item()
    if not math.isfinite(var) or var < 1e-12:
        return None
    return 1.0 - (target - pred).var(unbiased=False).item() / var


class StepProbe:
    """Reads what TRL computed in a step by wrapping two functions in its PPO module's namespace:
    `get_reward` (called per rollout chunk for the value model: values; and the reward model: scores)
    and `masked_whiten(advantages, mask)` (called once per step with the raw GAE advantages, before
    TRL whitens them). Both wrappers return what the originals return."""

    def __init__(self, value_model):
        import trl.experimental.ppo.ppo_trainer as ppo

        self.ppo, self.value_model = ppo, value_model
        self._get_reward, self._whiten = ppo.get_reward, ppo.masked_whiten
        self.values: list = []
        self.scores: list = []
        self.step: dict[str, Any] = {}
        ppo.get_reward, ppo.masked_whiten = self.get_reward, self.masked_whiten

    def close(self) -> None:
        self.ppo.get_reward, self.ppo.masked_whiten = self._get_reward, self._whiten

    def get_reward(self, model, query_responses, pad_token_id, context_length):
        out = self._get_reward(model, query_responses, pad_token_id, context_length)
        if model is self.value_model or getattr(model, "module", None) is self.value_model:
            self.values.append(out[0][:, context_length - 1 : -1].squeeze(-1).detach().float())
        else:
            self.scores.append(out[1].detach().float())
        return out

    def masked_whiten(self, values, mask, shift_mean=True):
        if shift_mean and self.values:  # the advantages (TRL whitens rewards with shift_mean=False)
            import torch

            with torch.no_grad():
                adv, m = values.detach().float(), mask.bool()
                v, s = torch.cat(self.values)[:, : adv.shape[1]], torch.cat(self.scores)
                outcome = s[:, None].expand_as(v)
                self.step = {
                    "adv_mean": adv[m].mean().item(),
                    "adv_first_token_mean": adv[:, 0][m[:, 0]].mean().item() if m[:, 0].any() else None,
                    "value_ev_returns": _ev((adv + v)[m], v[m]),
                    "value_ev_outcome": _ev(outcome[m], v[m]),
                    "value_first_token_mean": v[:, 0].mean().item(),
                    "value_bias_first_token": (v[:, 0] - s).mean().item(),
                    "response_tokens_mean": m.sum(1).float().mean().item(),
                    "reward_mean": s.mean().item(),
                }
            self.values, self.scores = [], []
        return self._whiten(values, mask, shift_mean=shift_mean)


class OutOfTime(Exception):
    pass


class RunRecorder:
    """One JSON line per step (TRL's logged metrics and the probe's), held-out success every
    `eval_every` steps and at the end; raises OutOfTime past the deadline (TRL's loop ignores
    `should_training_stop`)."""

    def __init__(
        self,
        out: Path,
        policy,
        tok,
        eval_items,
        probe: StepProbe,
        args,
        temperature: float,
        seed: int,
        deadline: float | None,
    ):
        self.out, self.policy, self.tok, self.eval_items, self.probe = out, policy, tok, eval_items, probe
        self.args, self.temperature, self.seed, self.deadline = args, temperature, seed, deadline
        self.logs: dict[str, Any] = {}
        self.t_last = time.time()
        self.steps_file = out / "steps.jsonl"
        self.steps_file.write_text("")

    def evaluate(self, step: int) -> dict:
        t0 = time.time()
        seed = 1_000_003 * (self.seed + 1) + step
        res = evaluate_policy(
            self.policy,
            self.tok,
            self.eval_items,
            self.temperature,
            self.args.response_length,
            self.args.eval_batch,
            seed,
        )
        return {**res, "eval_s": round(time.time() - t0, 2)}

    def write(self, rec: dict) -> None:
        with open(self.steps_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def on_step_end(self, step: int) -> None:
        rec = {"step": step, "step_s": round(time.time() - self.t_last, 3), **self.logs, **self.probe.step}
        if step % self.args.eval_every == 0 or step == self.args.steps:
            rec["heldout"] = self.evaluate(step)
        self.write(rec)
        shown = {
            k: rec.get(k) for k in ("reward_mean", "objective/kl", "loss/value_avg", "value_ev_outcome", "adv_mean")
        }
        shown["heldout"] = {k: rec["heldout"][k] for k in ("sampled", "greedy")} if "heldout" in rec else None
        print(f"[{self.out.name}] step {step} ({rec['step_s']}s): {json.dumps(shown)}", flush=True)
        self.t_last = time.time()
        if self.deadline is not None and time.time() > self.deadline:
            raise OutOfTime()


def make_callback(recorder: RunRecorder):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            recorder.t_last = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            recorder.logs = dict(logs or {})

        def on_step_end(self, args, state, control, **kw):
            recorder.on_step_end(state.global_step)

    return Recorder()
