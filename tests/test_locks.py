"""The locks under locks/ (make lock): every dependency pyproject.toml names, in every extra an
environment installs, is pinned there to one version its specifier admits; the test environment
and both images install through them (Makefile, deploy/Dockerfile). `make lock-check` (CI) checks
that they are what `make lock` writes; this checks what a hand edit could break, offline."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
# Which extras each lock installs (Makefile's lock target).
LOCKS = {"dev.txt": ("gpu", "dev"), "code-location.txt": ("k8s",), "gpu.txt": ("gpu",)}


def pins(path: Path) -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            found[canonicalize_name(m.group(1))] = Version(m.group(2))
    return found


def requirements(extras) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in extras:
        names += project["optional-dependencies"][extra]
    return [Requirement(r) for r in names]


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_dependency_is_pinned_to_a_version_it_admits(lock):
    pinned = pins(ROOT / "locks" / lock)
    for req in requirements(LOCKS[lock]):
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not in locks/{lock}: run make lock"
        assert pinned[name] in req.specifier, f"locks/{lock}: {req.name}=={pinned[name]} is outside {req.specifier}"


def test_the_image_locks_hold_the_tested_versions():
    dev = pins(ROOT / "locks" / "dev.txt")
    for lock in ("code-location.txt", "gpu.txt"):
        for name, version in pins(ROOT / "locks" / lock).items():
            if name in dev:
                assert version == dev[name], f"locks/{lock}: {name}=={version}, tested with {dev[name]}"


def test_make_and_the_images_install_through_the_locks():
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -c locks/dev.txt -e '.[gpu,dev]'" in makefile
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    installs = re.findall(r"^RUN pip install (.+)$", dockerfile, flags=re.M)
    assert installs == ['-c locks/code-location.txt ".[k8s]"', '-c locks/gpu.txt ".[gpu]"']
    assert "make lock-check" in (ROOT / ".ci/run").read_text()
