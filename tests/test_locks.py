"""The locks under locks/ (make lock): every dependency pyproject.toml names, in every extra an
environment installs, is pinned there to one version its specifier admits; the test environment
and both images install through them (Makefile, deploy/Dockerfile). `make lock-check` (CI) checks
that they are what `make lock` writes; this checks what a hand edit could break, offline."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
# Which extras each lock installs, for which Pythons (Makefile's lock target; dev.txt is universal).
LOCKS = {
    "dev.txt": (("gpu", "dev"), ("3.11", "3.12")),
    "code-location.txt": (("k8s",), ("3.11",)),
    "gpu.txt": (("gpu",), ("3.12",)),
}


def environment(python: str) -> dict[str, str]:
    return {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}  # fmt: skip


def pins(path: Path, python: str) -> dict[str, Version]:
    """The lock's pins that apply on Linux x86_64 under `python` (a line's marker decides)."""
    found: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$", line)
        if m and (m.group(3) is None or Marker(m.group(3)).evaluate(environment(python))):
            name = canonicalize_name(m.group(1))
            assert name not in found, f"{path.name}: {name} pinned twice for Python {python}"
            found[name] = Version(m.group(2))
    return found


def requirements(extras, python: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in extras:
        names += project["optional-dependencies"][extra]
    reqs = [Requirement(r) for r in names]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(environment(python))]


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_dependency_is_pinned_to_a_version_it_admits(lock):
    extras, pythons = LOCKS[lock]
    for python in pythons:
        pinned = pins(ROOT / "locks" / lock, python)
        for req in requirements(extras, python):
            name = canonicalize_name(req.name)
            assert name in pinned, f"{req.name} is not in locks/{lock} for Python {python}: run make lock"
            assert pinned[name] in req.specifier, f"locks/{lock}: {req.name}=={pinned[name]} is outside {req}"


def test_one_megatron_core_per_python():
    """0.16.1 on 3.11 (the CPU suite), 0.19.2 on 3.12 (the GPU image, `make test-mcore-next`)."""
    assert pins(ROOT / "locks/dev.txt", "3.11")["megatron-core"] == Version("0.16.1")
    assert pins(ROOT / "locks/dev.txt", "3.12")["megatron-core"] == Version("0.19.2")
    assert pins(ROOT / "locks/gpu.txt", "3.12")["megatron-core"] == Version("0.19.2")
    makefile = (ROOT / "Makefile").read_text()
    assert "MCORE_NEXT_VERSION := 0.19.2" in makefile
    assert re.search(r"^FROM rayproject/ray:[\d.]+-py312-", (ROOT / "deploy/Dockerfile").read_text(), flags=re.M)


def test_the_image_locks_hold_the_tested_versions():
    for lock, python in (("code-location.txt", "3.11"), ("gpu.txt", "3.12")):
        dev = pins(ROOT / "locks" / "dev.txt", python)
        for name, version in pins(ROOT / "locks" / lock, python).items():
            if name in dev:
                assert version == dev[name], f"locks/{lock}: {name}=={version}, tested with {dev[name]}"


def test_make_and_the_images_install_through_the_locks():
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -c locks/dev.txt -e '.[gpu,dev]'" in makefile
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    installs = re.findall(r"^RUN pip install (.+)$", dockerfile, flags=re.M)
    assert installs == ['-c locks/code-location.txt ".[k8s]"', '-c locks/gpu.txt ".[gpu]"']
    assert "make lock-check" in (ROOT / ".ci/run").read_text()
