"""core/pod_sizing.py: Kubernetes quantities read exactly, a GPU pod's CPU, memory and /dev/shm
grown with its GPUs, the memory-backed /dev/shm counted inside the memory limit. Checked against
values computed by hand."""

from __future__ import annotations

from fractions import Fraction

import pytest

from value_assets.core.pod_sizing import format_bytes, format_cpu, parse_quantity, pod_size

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8", 8),
        ("500m", Fraction(1, 2)),
        ("1.5", Fraction(3, 2)),
        ("64Gi", 64 * 2**30),
        ("512Mi", 2**29),
        ("1.5G", 1_500_000_000),
        ("2k", 2000),
        (".5Ti", 2**39),
    ],
)
def test_quantities_are_read_exactly(text, value):
    assert parse_quantity(text, setting="x") == value


@pytest.mark.parametrize("text", ["", "8 cores", "64GB", "-1", "0", "0Gi", "1e3", "Gi", "8gi"])
def test_a_malformed_quantity_names_the_setting_and_the_value(text):
    with pytest.raises(ValueError, match=rf"^memory_per_gpu={text!r}: "):
        parse_quantity(text, setting="memory_per_gpu")


def test_quantities_are_written_whole_in_the_largest_unit():
    assert format_cpu(Fraction(16)) == "16"
    assert format_cpu(Fraction(3, 2)) == "1500m"
    assert format_cpu(Fraction(1, 3000)) == "1m"  # rounded up: never less than asked
    assert format_bytes(Fraction(72 * 2**30)) == "72Gi"
    assert format_bytes(Fraction(3 * 2**29)) == "1536Mi"
    assert format_bytes(Fraction(1_500_000_000)) == "1500000000"


@pytest.mark.parametrize(
    ("gpus", "cpu", "memory", "shm"),
    [(1, "8", "72Gi", "8Gi"), (2, "16", "144Gi", "16Gi"), (8, "64", "576Gi", "64Gi")],
)
def test_the_pod_grows_with_its_gpus_and_its_memory_holds_the_shared_memory(gpus, cpu, memory, shm):
    size = pod_size(gpus, cpu_per_gpu="8", memory_per_gpu="64Gi", shm_per_gpu="8Gi")
    assert (size.cpu, size.memory, size.shm, size.gpus) == (cpu, memory, shm, gpus)


def test_other_units_per_gpu():
    size = pod_size(3, cpu_per_gpu="2500m", memory_per_gpu="40G", shm_per_gpu="512Mi")
    assert size.cpu == "7500m"
    assert size.memory == f"{3 * (40 * 10**9 + 2**29) // 1024}Ki"  # whole KiB, not whole MiB
    assert size.shm == "1536Mi"


@pytest.mark.parametrize("gpus", [0, -1, True, 1.0])
def test_a_pod_holds_at_least_one_gpu(gpus):
    with pytest.raises(ValueError, match="gpus="):
        pod_size(gpus, cpu_per_gpu="8", memory_per_gpu="64Gi", shm_per_gpu="8Gi")
