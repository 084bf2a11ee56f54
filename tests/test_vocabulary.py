"""One vocabulary across the Pipes boundary (`value_assets/core/vocabulary.py`): the assets every
GPU task reports exist in the graph, the graph has exactly the vocabulary's assets and checks, and
no module that speaks to Dagster or through Pipes (the top-level modules, `assets/`, `resources/`,
`gpu/`) but the lineage reader writes an asset name as a string: a renamed asset would otherwise
leave a stale name behind that nothing catches. (`core/` names no asset; its documents have a field
`batch_plan`, the plan a contract binds, which is not the asset.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from value_assets.core import vocabulary as v

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[1] / "value_assets"
LINEAGE_READER = PKG / "lineage.py"


def _dagster_and_pipes_modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if p != LINEAGE_READER and p.relative_to(PKG).parts[0] != "core")


def test_the_graph_has_exactly_the_vocabularys_assets_and_every_task_reports_real_ones():
    from value_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert keys == set(v.ASSETS)
    checks = {key.name for key in graph.asset_check_keys}
    assert checks == {v.DATASET_INTEGRITY, v.CONTRACT_INTEGRITY, v.EV_GATE}
    for task in v.TASKS.values():
        assert task.reports and set(task.reports) <= keys, task.name


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string literal of a module, except the Python names listed in `__all__`."""
    tree = ast.parse(path.read_text(), str(path))
    exported = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        for n in ast.walk(node.value)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported
    ]


def test_no_dagster_or_pipes_module_but_the_lineage_reader_spells_an_asset_name():
    found = [
        f"{path.relative_to(PKG.parent)}:{line}: {value!r}"
        for path in _dagster_and_pipes_modules()
        for line, value in _string_constants(path)
        if value in v.ASSETS
    ]
    assert not found, "\n".join(found)


def test_the_rule_sees_a_spelled_name(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text('__all__ = ["ev_report"]\nKEY = "ev_report"\nOTHER = f"the {KEY} is " + "ev_report_x"\n')
    assert [value for _, value in _string_constants(planted) if value in v.ASSETS] == ["ev_report"]
