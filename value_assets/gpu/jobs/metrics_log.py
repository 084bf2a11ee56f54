"""Per-step training metrics: a JSON-lines file and TensorBoard event files beside the checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SCALARS = ("loss", "value_accuracy", "entropy", "explained_variance", "grad_norm", "lr", "tokens_per_s")


class MetricsLog:
    def __init__(self, critic_dir: Path, after_step: int = 0):
        """`after_step`: the step the run resumes after. Lines of later steps (written after the
        save it resumes from, by a run that was then killed) are dropped, so each step appears once."""
        self.path = critic_dir / "metrics.jsonl"
        _truncate_after(self.path, after_step)
        self._file = open(self.path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(critic_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional at run time; the JSON log always exists
            self._tb = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in SCALARS:
                v = metrics.get(key)
                if v is not None:  # an undefined in-batch EV is left out, never logged as 0
                    self._tb.add_scalar(f"train/{key}", float(v), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = []
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line if line.endswith(b"\n") else line + b"\n")
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a killed run
    data = b"".join(keep)
    if data != path.read_bytes():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
