"""Every test module declares exactly one tier, module-wide, in `pytestmark`:

- unit: fast and self-contained: no Ray, no spawned ranks, no Dagster run; `make test-fast`;
- integration: Dagster runs, local Ray, spawned ranks, the GPU job on CPU;
- gpu: needs CUDA; skipped elsewhere, run on the accelerator machine;
- rl: the RL trainers' own loaders (verl, OpenRLHF, Megatron-LM) on the product's exports; not in
  `make test`: `make test-rl` installs them outside the venv (.rl/) and runs tests/rl.
- system: the deployment end to end (`make ui` on Postgres with a headless browser, a two-node Ray
  cluster through Ray Jobs, run-manifests with the real GPU job on a full disk, the README's
  bring-your-own walkthrough through the commands, a Qwen3.5 critic through the commands, the
  lifecycles of Ray clusters a test starts for itself: a driver's own Ray, the warm cluster); not in
  `make test`: `make test-system`, which .ci/run runs after it.
- miles: Miles' own Qwen3.5 plugin on the product's bundle; Miles comes from a local clone
  (`make test-miles MILES_SRC=...`): it is on no registry CI reaches, so not in .ci/run.

A tier given to a single test inside a module would hide it from the module's tier, so none is.
The test folders are packages: helpers are imported relatively, never through `sys.path`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "gpu", "rl", "system", "miles")


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _tier_marks(node: ast.AST) -> list[str]:
    """`pytest.mark.<tier>` attributes anywhere inside `node` (bare or called)."""
    found = []
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Attribute)
            and sub.attr in TIERS
            and isinstance(sub.value, ast.Attribute)
            and sub.value.attr == "mark"
            and isinstance(sub.value.value, ast.Name)
            and sub.value.value.id == "pytest"
        ):
            found.append(sub.attr)
    return found


def tiers_of(path: Path) -> tuple[list[str], list[str]]:
    """(tiers named by the module's `pytestmark`, tiers named anywhere else in the module)."""
    tree = ast.parse(path.read_text(), str(path))
    module_level, elsewhere = [], []
    for stmt in tree.body:
        targets = [t.id for t in getattr(stmt, "targets", []) if isinstance(t, ast.Name)]
        if isinstance(stmt, ast.Assign) and targets == ["pytestmark"]:
            module_level += _tier_marks(stmt.value)
        else:
            elsewhere += _tier_marks(stmt)
    return module_level, elsewhere


def test_the_suite_has_test_modules_in_every_folder():
    folders = {p.parent.name for p in _test_modules()}
    assert {"core", "dagster", "engine", "gpu", "hf", "job", "rl"} <= folders, folders


@pytest.mark.parametrize("path", _test_modules(), ids=lambda p: str(p.relative_to(TESTS)))
def test_module_declares_exactly_one_tier(path):
    module_level, elsewhere = tiers_of(path)
    assert len(module_level) == 1, (
        f"{path.name}: pytestmark names tiers {module_level}; exactly one of {TIERS} is required"
    )
    assert not elsewhere, f"{path.name}: tier marks outside pytestmark: {elsewhere} (split the module instead)"


def test_folders_are_packages_without_path_hacks():
    folders = {p.parent for p in TESTS.rglob("*.py")}
    assert all((f / "__init__.py").is_file() for f in folders), sorted(
        str(f) for f in folders if not (f / "__init__.py").is_file()
    )
    for path in sorted(set(TESTS.rglob("*.py")) - {Path(__file__).resolve()}):
        text = path.read_text()
        assert "sys.path.insert" not in text and "from conftest import" not in text, path.name
        # A sibling helper is imported relatively (`from .helpers import x`): a bare `import helpers`
        # only works when some other test happened to put the folder on sys.path.
        siblings = {p.stem for p in path.parent.glob("*.py")} - {"__init__"}
        bare = re.findall(r"^\s*(?:from|import) (\w+)\b", text, re.M)
        assert not siblings & set(bare), (
            f"{path.name} imports sibling test module(s) {sorted(siblings & set(bare))} without a dot"
        )


def test_the_checker_sees_tiers(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text(
        "import pytest\npytestmark = [pytest.mark.integration, pytest.mark.timeout(9)]\n"
        "@pytest.mark.gpu\ndef test_a():\n    pass\n"
    )
    assert tiers_of(path) == (["integration"], ["gpu"])


def test_the_slow_module_list_names_modules_that_exist():
    """conftest.SLOW_MODULES orders `make test`'s modules; a renamed module must not drop out."""
    from tests.conftest import SLOW_MODULES

    root = TESTS.parent
    missing = [m for m in SLOW_MODULES if not (root / m).is_file()]
    assert not missing, f"conftest.SLOW_MODULES names modules that do not exist: {missing}"
    assert len(set(SLOW_MODULES)) == len(SLOW_MODULES)
