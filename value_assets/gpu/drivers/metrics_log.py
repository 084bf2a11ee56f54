"""Per-step training metrics: a JSON-lines file and TensorBoard event files beside the checkpoints.

The event files are written with tensorboard's own event writer and protos (what
`torch.utils.tensorboard` wraps): the driver process that logs them never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCALARS = ("loss", "value_accuracy", "entropy", "explained_variance", "grad_norm", "lr", "tokens_per_s")
METRICS_NAME = "metrics.jsonl"
TENSORBOARD_NAME = "tensorboard"


class MetricsLog:
    def __init__(self, critic_dir: Path, after_step: int = 0):
        """`after_step`: the step the run resumes after. Lines of later steps (written after the
        save it resumes from, by a run that was then killed) are dropped, so each step appears once."""
        self.path = critic_dir / METRICS_NAME
        _truncate_after(self.path, after_step)
        self._file = open(self.path, "a", encoding="utf-8")
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._tb = EventFileWriter(str(critic_dir / TENSORBOARD_NAME))
        except ImportError:  # tensorboard is optional at run time; the JSON log always exists
            self._tb = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        try:
            self._file.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: named (exit 2); a torn last line is dropped on resume
            from value_assets.core.publish import PublishError

            raise PublishError(self.path, exc) from exc
        if self._tb is not None:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            # an undefined in-batch EV is left out, never logged as 0
            values = [
                Summary.Value(tag=f"train/{key}", simple_value=float(v))
                for key in SCALARS
                if (v := metrics.get(key)) is not None
            ]
            if values:
                self._tb.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
                self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


@dataclass(frozen=True)
class RunLogBefore:
    """A critic folder's run log (metrics.jsonl, tensorboard/) as a run found it, so that a run that
    fails before it publishes a save takes back what it added (`take_back`): a failed run writes
    nothing (docs/rules.md#saves), and what an earlier run left stays."""

    folder: Path
    had_metrics: bool
    events: frozenset[str] | None  # the files in tensorboard/; None: no such folder

    @classmethod
    def of(cls, folder: Path) -> RunLogBefore:
        tb = folder / TENSORBOARD_NAME
        return cls(
            folder=folder,
            had_metrics=(folder / METRICS_NAME).exists(),
            events=frozenset(os.listdir(tb)) if tb.is_dir() else None,
        )

    def take_back(self, after_step: int) -> list[str]:
        """Remove what the run added to the log: its lines of metrics.jsonl (those past `after_step`,
        the step it resumed after; the file, if it made it) and its TensorBoard event files (the
        folder, if it made it). Returns the paths removed or cut back."""
        undone: list[str] = []
        metrics = self.folder / METRICS_NAME
        if metrics.exists():
            if not self.had_metrics:
                metrics.unlink()
                undone.append(str(metrics))
            elif _truncate_after(metrics, after_step):
                undone.append(f"{metrics} (cut back to step {after_step})")
        tb = self.folder / TENSORBOARD_NAME
        if tb.is_dir():
            if self.events is None:
                shutil.rmtree(tb)
                undone.append(str(tb))
            else:
                for name in sorted(set(os.listdir(tb)) - self.events):
                    with contextlib.suppress(FileNotFoundError):
                        (tb / name).unlink()
                    undone.append(str(tb / name))
        return undone


def _truncate_after(path: Path, step: int) -> bool:
    """Drop the lines of steps after `step`; whether the file changed."""
    if not path.exists():
        return False
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
        return True
    return False
