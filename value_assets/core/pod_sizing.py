"""What a GPU job's Kubernetes pod asks for, from per-GPU settings the operator chooses.

A pod of the `kubernetes` deployment runs one GPU job with `gpus` workers. Its CPU, memory and
shared memory grow with the GPUs it holds: each is set per GPU (`cpu_per_gpu`, `memory_per_gpu`,
`shm_per_gpu`) and multiplied. The shared memory is a memory-backed `emptyDir` at `/dev/shm`,
which Kubernetes counts against the container's memory limit, so the pod's memory is
`gpus * (memory_per_gpu + shm_per_gpu)`: the processes keep their `memory_per_gpu` however full
`/dev/shm` gets.

Quantities are Kubernetes quantities (`8`, `500m`, `64Gi`, `1.5G`), read exactly (fractions, no
float rounding) and written back in the largest unit that keeps them whole. A malformed one is a
`ValueError` that names the setting and the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

_SUFFIXES: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
_QUANTITY = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)(?P<suffix>m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?")
_BINARY_OUT = (("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def parse_quantity(text: str, *, setting: str) -> Fraction:
    """A Kubernetes quantity as an exact number (cores, or bytes); `setting` names it in errors."""
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{setting}={text!r}: not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    number, suffix = Fraction(match["number"]), match["suffix"] or ""
    value = number / 1000 if suffix == "m" else number * _SUFFIXES[suffix]
    if value <= 0:
        raise ValueError(f"{setting}={text!r}: must be more than zero")
    return value


def format_cpu(cores: Fraction) -> str:
    """Whole cores as `16`, anything else in millicores (`1500m`), rounded up to a millicore."""
    if cores.denominator == 1:
        return str(cores.numerator)
    milli = -(-cores.numerator * 1000 // cores.denominator)
    return f"{milli}m"


def format_bytes(count: Fraction) -> str:
    """Bytes in the largest binary unit that keeps them whole (`72Gi`), else whole bytes, rounded up."""
    whole = -(-count.numerator // count.denominator)
    for suffix, size in _BINARY_OUT:
        if whole % size == 0:
            return f"{whole // size}{suffix}"
    return str(whole)


@dataclass(frozen=True)
class PodSize:
    """The requests and limits (equal: the pod is Guaranteed) and the `/dev/shm` size of one GPU pod."""

    cpu: str
    memory: str
    shm: str
    gpus: int


def pod_size(gpus: int, *, cpu_per_gpu: str, memory_per_gpu: str, shm_per_gpu: str) -> PodSize:
    """The pod of a job with `gpus` workers: every setting times the GPUs; memory includes `/dev/shm`."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: a GPU pod holds at least one GPU")
    cpu = parse_quantity(cpu_per_gpu, setting="cpu_per_gpu")
    memory = parse_quantity(memory_per_gpu, setting="memory_per_gpu")
    shm = parse_quantity(shm_per_gpu, setting="shm_per_gpu")
    return PodSize(
        cpu=format_cpu(cpu * gpus),
        memory=format_bytes((memory + shm) * gpus),
        shm=format_bytes(shm * gpus),
        gpus=gpus,
    )
