"""Value targets, predictions, loss and per-step metrics in torch (docs/rules.md#critic).

Targets match `value_assets.core.targets` (numpy float64) to 1e-6: they are computed in float64
and cast. Loss reduction: mean over each row's active tokens, then sum over rows divided by the
GLOBAL number of rows of the batch (so with data parallel each rank divides by the global count
and gradients are summed, not averaged, across ranks). Per-row sums use a float64 cumulative sum
read at the packed row boundaries: deterministic on CPU and CUDA (no atomics).

Metrics are sufficient statistics (float64 sums) that merge by summing across micro-batches and
ranks; `finalize_metrics` divides once at the end. EV is None where undefined, never 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from value_assets.core.objective import Objective
from value_assets.core.stats import SuffStats

# Order of the float64 statistics vector returned by `loss_and_stats`.
STAT_KEYS = ("loss", "rows", "active", "correct", "entropy", "sum_r", "sum_r2", "sum_e", "sum_e2")


def support(objective: Objective, device=None, dtype=torch.float32) -> torch.Tensor:
    low, high = objective.reward_range
    return torch.linspace(low, high, objective.num_bins, dtype=torch.float64, device=device).to(dtype)


def hl_gauss(returns: torch.Tensor, objective: Objective) -> torch.Tensor:
    """returns float [n] -> HL-Gauss probabilities float32 [n, K] (rows sum to 1)."""
    low, high = objective.reward_range
    k = objective.num_bins
    w = (high - low) / (k - 1)
    c = support(objective, returns.device, torch.float64)
    sigma = objective.hl_gauss_sigma_ratio * w
    mu = returns.to(torch.float64).clamp(low, high).unsqueeze(-1)
    scale = sigma * math.sqrt(2.0)
    p = 0.5 * (torch.special.erf((c + w / 2 - mu) / scale) - torch.special.erf((c - w / 2 - mu) / scale))
    return (p / p.sum(-1, keepdim=True)).to(torch.float32)


def two_hot(returns: torch.Tensor, objective: Objective) -> torch.Tensor:
    """returns float [n] -> two-hot probabilities float32 [n, K]."""
    low, high = objective.reward_range
    k = objective.num_bins
    w = (high - low) / (k - 1)
    x = (returns.to(torch.float64).clamp(low, high) - low) / w
    i = torch.clamp(torch.floor(x).long(), max=k - 2)
    frac = x - i
    p = torch.zeros(returns.shape[0], k, dtype=torch.float64, device=returns.device)
    p.scatter_(1, i.unsqueeze(1), (1.0 - frac).unsqueeze(1))
    p.scatter_add_(1, (i + 1).unsqueeze(1), frac.unsqueeze(1))
    return p.to(torch.float32)


def target_distribution(returns: torch.Tensor, objective: Objective) -> torch.Tensor:
    if objective.loss_type != "classification":
        raise ValueError("target distributions exist only for the classification objective")
    return (hl_gauss if objective.target_type == "hl_gauss" else two_hot)(returns, objective)


def predicted_values(head_out: torch.Tensor, objective: Objective) -> torch.Tensor:
    """head_out float [t, K] -> V float32 [t]: softmax . support, or the scalar for mse."""
    if objective.loss_type == "mse":
        return head_out[..., 0].float()
    return torch.softmax(head_out.float(), dim=-1) @ support(objective, head_out.device)


def token_losses(head_out: torch.Tensor, returns: torch.Tensor, objective: Objective) -> torch.Tensor:
    """Per-token loss float32 [t]: cross-entropy vs the target distribution, or (V - R)^2."""
    if objective.loss_type == "mse":
        return (head_out[..., 0].float() - returns.float()) ** 2
    target = target_distribution(returns, objective)
    return -(target * F.log_softmax(head_out.float(), dim=-1)).sum(-1)


def _row_sums(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum x [t] over each packed row given cu_seqlens [n+1] -> float64 [n]."""
    cs = torch.cat([x.new_zeros(1, dtype=torch.float64), torch.cumsum(x.to(torch.float64), 0)])
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    return cs[cu[1:]] - cs[cu[:-1]]


def loss_and_stats(
    head_out: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    objective: Objective,
    global_num_rows: int,
    per_token: bool = False,
    global_num_active: int | None = None,
    host_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of one packed micro-batch, scaled so that summing over micro-batches and ranks gives
    the global-batch loss, plus its float64 statistics vector (order `STAT_KEYS`).

    head_out float32 [t, K]; returns float [t]; mask float [t] (1 = active target);
    cu_seqlens int [n+1]. Default reduction: sum over rows of (row's mean active-token loss) /
    global_num_rows. per_token=True: sum of active-token losses / global_num_active.
    Every row must have at least one active target: checked on `host_mask` (mask, cu_seqlens) when
    given, the host copies of a micro-batch on the GPU (reading the device's back would make the
    host wait for the GPU at every micro-batch), else on `mask` itself.
    """
    mask = mask.to(head_out.device, torch.float32)
    returns = returns.to(head_out.device)
    tl = token_losses(head_out, returns, objective) * mask
    row_active = _row_sums(mask, cu_seqlens)
    if per_token:
        if not global_num_active:
            raise ValueError("per_token reduction needs global_num_active > 0")
        loss = tl.sum() / global_num_active
    else:
        active = row_active if host_mask is None else _row_sums(host_mask[0].to(torch.float32), host_mask[1])
        if bool((active <= 0).any()):
            raise ValueError("every row needs at least one active target")
        row_loss = _row_sums(tl, cu_seqlens) / row_active
        loss = (row_loss.sum() / global_num_rows).to(torch.float32)

    with torch.no_grad():
        v = predicted_values(head_out, objective).to(torch.float64)
        r = returns.to(torch.float64)
        m = mask.to(torch.float64)
        e = r - v
        if objective.loss_type == "classification":
            logp = F.log_softmax(head_out.float(), dim=-1)
            ent = -(logp.exp() * logp).sum(-1).to(torch.float64)
            correct = head_out.argmax(-1) == target_distribution(returns, objective).argmax(-1)
            correct = correct.to(torch.float64)
        else:
            ent = torch.zeros_like(m)
            correct = torch.zeros_like(m)
        stats = torch.stack(
            [
                loss.detach().to(torch.float64),
                m.new_full((), float(cu_seqlens.numel() - 1)),  # a fill, not a host->device copy
                m.sum(),
                (correct * m).sum(),
                (ent * m).sum(),
                (r * m).sum(),
                (r * r * m).sum(),
                (e * m).sum(),
                (e * e * m).sum(),
            ]
        )
    return loss, stats


def finalize_metrics(stats: torch.Tensor, objective: Objective) -> dict[str, float | None]:
    """Summed statistics -> metrics. accuracy/entropy are None for mse; the in-batch EV
    (token-weighted) is core's definition (`SuffStats.ev_or_none`): None where it is undefined."""
    s = dict(zip(STAT_KEYS, stats.detach().cpu().to(torch.float64).tolist(), strict=True))
    n = s["active"]
    out: dict[str, float | None] = {"loss": s["loss"], "rows": s["rows"], "active_targets": n}
    cls = objective.loss_type == "classification"
    out["value_accuracy"] = s["correct"] / n if (cls and n > 0) else None
    out["entropy"] = s["entropy"] / n if (cls and n > 0) else None
    batch = SuffStats(n=n, sum_r=s["sum_r"], sum_r2=s["sum_r2"], sum_e=s["sum_e"], sum_e2=s["sum_e2"])
    out["explained_variance"] = batch.ev_or_none()
    return out
