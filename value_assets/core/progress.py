"""Training progress as one fixed, parseable log line, sent every K steps (plus the first and last).

The GPU job passes `TrainProgress` to the driver as its `on_step` callback with Pipes' log as the
sink, so a run's Dagster event log shows the training live (a Pipes log line is an event as soon
as it arrives). K = ceil(planned steps / `UPDATES`): 20 to 40 lines for any run longer than
`UPDATES` steps, every step of a shorter one. `parse_progress` reads a line back (tests, tools).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

UPDATES = 40
PREFIX = "train progress:"
_LINE = re.compile(re.escape(PREFIX) + r" step=(\d+)/(\d+) loss=(\S+) ev=(\S+) tokens_per_s=(\S+)$")


def report_every(planned_steps: int, updates: int = UPDATES) -> int:
    """K: the step interval that gives at most `updates` lines for `planned_steps` steps."""
    return max(1, math.ceil(planned_steps / updates))


def _num(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"  # an undefined in-batch EV stays undefined, never 0
    return format(float(value), spec)


def progress_line(step: int, planned_steps: int, metrics: dict[str, Any]) -> str:
    """``train progress: step=12/64 loss=0.693147 ev=0.1234 tokens_per_s=1234.5``."""
    return (
        f"{PREFIX} step={step}/{planned_steps} loss={_num(metrics.get('loss'), '.6f')} "
        f"ev={_num(metrics.get('explained_variance'), '.4f')} "
        f"tokens_per_s={_num(metrics.get('tokens_per_s'), '.1f')}"
    )


def parse_progress(line: str) -> dict[str, Any] | None:
    """The fields of a progress line (None for 'n/a'), or None if `line` is not one."""
    m = _LINE.match(line.strip())
    if m is None:
        return None

    def num(text: str) -> float | None:
        return None if text == "n/a" else float(text)

    return {
        "step": int(m.group(1)),
        "planned_steps": int(m.group(2)),
        "loss": num(m.group(3)),
        "ev": num(m.group(4)),
        "tokens_per_s": num(m.group(5)),
    }


class TrainProgress:
    """The driver's `on_step(step, metrics)`: a progress line for the first step of the run, every
    K-th step and the plan's last; `finish()` adds the run's last step when it stopped earlier
    (canary, `stop_after`) and was not reported yet."""

    def __init__(self, log: Callable[[str], None], planned_steps: int, updates: int = UPDATES):
        self.log = log
        self.planned_steps = planned_steps
        self.every = report_every(planned_steps, updates)
        self.reported: list[int] = []
        self._pending: tuple[int, dict[str, Any]] | None = None

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.reported or step % self.every == 0 or step == self.planned_steps:
            self._send(step, metrics)
        else:
            self._pending = (step, metrics)

    def finish(self) -> None:
        if self._pending is not None and (not self.reported or self._pending[0] > self.reported[-1]):
            self._send(*self._pending)

    def _send(self, step: int, metrics: dict[str, Any]) -> None:
        self.log(progress_line(step, self.planned_steps, metrics))
        self.reported.append(step)
        self._pending = None
