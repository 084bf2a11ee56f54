"""The import graph of `value_assets`, read statically: no cycles, and every layer imports only
what docs/architecture.md allows (function-level imports count: a lazy import is still a
dependency)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[1] / "value_assets"
HEAVY = ("torch", "megatron", "ray", "transformers", "safetensors")
# The only packages outside the standard library the core may import (docs/architecture.md): every
# process that reads a dataset or a contract imports the core, so it stays small (pandas, once
# imported for one hash function, cost each such process ~0.4 s).
CORE_THIRD_PARTY = ("numpy", "pyarrow", "simdjson")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of everything `path` imports, at any depth of the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            # `from value_assets.gpu.workers import cluster` imports the submodule
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _all_imports() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_no_import_cycle():
    graph = _graph()
    # Package __init__ edges are implicit parents, not cycles of their own.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in ("core", "gpu", "resources"):
        return parts[1]
    return "top"


def test_layers():
    breaches = []
    for mod, imports in sorted(_all_imports().items()):
        layer = _layer(mod)
        for imp in sorted(imports):
            top = _top(imp)
            inner = imp.split(".")[1] if top == "value_assets" and "." in imp else None
            if layer == "core":
                bad = (
                    top not in sys.stdlib_module_names and top not in CORE_THIRD_PARTY and top != "value_assets"
                ) or (top == "value_assets" and inner not in (None, "core"))
            elif layer == "gpu":
                # The job talks to Dagster only through dagster_pipes.
                bad = (
                    top == "dagster"
                    or (top.startswith("dagster_") and top != "dagster_pipes")
                    or (top == "value_assets" and inner not in (None, "core", "gpu"))
                )
            elif layer == "resources":
                bad = top in HEAVY or (top == "value_assets" and inner == "gpu")
            else:
                # The Dagster code location and the CLI stay light; only the CLI registers the GPU
                # commands (value_assets.gpu.commands declares arguments and imports torch lazily).
                allowed_gpu = mod == "value_assets.cli" and (
                    imp == "value_assets.gpu" or imp.startswith("value_assets.gpu.commands")
                )
                bad = top in HEAVY or (top == "value_assets" and inner == "gpu" and not allowed_gpu)
            if bad:
                breaches.append(f"{mod} ({layer}) imports {imp}")
    assert not breaches, "\n".join(breaches)


# The GPU package's sub-layers, lowest first (docs/architecture.md#the-gpu-package): a module may
# import its own sub-layer and the ones before it, never one after it. The entry points (`gpu.commands`,
# `gpu.pipes_job`) sit above them all; the package's __init__ imports none of them.
GPU_ORDER = ("model", "runtime", "convert", "workers", "drivers")
GPU_ENTRY_POINTS = ("commands", "pipes_job")


def _gpu_rank(mod: str) -> int | None:
    """The position of a `value_assets.gpu.*` module in GPU_ORDER (entry points after it, the
    package itself before it); None outside the GPU package."""
    parts = mod.split(".")
    if parts[:2] != ["value_assets", "gpu"]:
        return None
    if len(parts) == 2:
        return -1
    if parts[2] in GPU_ENTRY_POINTS:
        return len(GPU_ORDER)
    return GPU_ORDER.index(parts[2])


def test_gpu_sub_layers_import_only_downwards():
    modules = set(_graph())
    unknown = [
        m for m in modules if m.startswith("value_assets.gpu.") and m.split(".")[2] not in GPU_ORDER + GPU_ENTRY_POINTS
    ]
    assert not unknown, f"GPU modules outside the known sub-layers (add them to GPU_ORDER): {unknown}"
    breaches = []
    for mod, imports in sorted(_all_imports().items()):
        rank = _gpu_rank(mod)
        if rank is None:
            continue
        for imp in sorted(imports):
            target = _gpu_rank(imp) if imp in modules or imp.rsplit(".", 1)[0] in modules else None
            if target is not None and imp != "value_assets.gpu" and target > rank:
                breaches.append(f"{mod} imports {imp}")
    assert not breaches, "\n".join(breaches)


def test_the_gpu_order_ranks_the_sub_layers():
    """The ranks the rule compares (runtime below convert: runtime -> convert was the breach this rule found)."""
    assert _gpu_rank("value_assets.gpu.runtime.checkpoint") < _gpu_rank("value_assets.gpu.workers.worker")
    assert _gpu_rank("value_assets.gpu.model.gpt_critic") < _gpu_rank("value_assets.gpu.runtime.step")
    assert _gpu_rank("value_assets.gpu.drivers.train") < _gpu_rank("value_assets.gpu.pipes_job")
    assert _gpu_rank("value_assets.core.plan") is None


def test_gpu_commands_module_is_light():
    """`value_assets.gpu.commands` is imported by the light CLI: it may not import torch/ray/megatron at
    module level."""
    tree = ast.parse((PKG / "gpu" / "commands.py").read_text())
    top_level = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top_level.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            top_level.add(node.module or "")
    assert not [m for m in top_level if _top(m) in HEAVY]


def test_job_drivers_read_the_backbone_without_torch_and_jsonl_without_pyarrow(tmp_path):
    """The train and evaluate drivers check and record the backbone's shape; only the workers
    build the model. Importing torch and megatron-core in every driver cost ~5 s per GPU job.
    pyarrow is imported for Parquet data only: reading JSONL (the driver, a Pipes process, the CLI)
    spares its ~0.2 s import."""
    import subprocess
    import sys

    from value_assets.core.demo_data import make_demo_data

    manifest = make_demo_data(tmp_path, rows=8, heldout_rows=4, seed=0)
    code = (
        "import sys; from value_assets.gpu.drivers.train import prepare; from value_assets.gpu.drivers.evaluate "
        "import evaluate; from value_assets.gpu.convert.bootstrap import resolve_backbone; resolve_backbone('tiny', "
        "seed=0, hf_config=None); from value_assets.core.manifest import load_manifest; from "
        f"value_assets.core.dataset import validate_dataset; mf = load_manifest({str(manifest)!r}); assert "
        f"len(validate_dataset(mf.train, mf.objective)) == 8; print(sorted({{m.split('.')[0] for m in sys.modules}} & "
        f"{{'torch', 'megatron', 'ray', 'pyarrow'}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_every_module_name_is_unique_in_the_package():
    """A file name says which process a module serves: no two modules share one (three "jobs" once
    meant Dagster jobs, job settings and job drivers; two `warm_cluster.py` the launcher's folder and
    the helper process)."""
    from collections import Counter

    names = Counter(p.name for p in PKG.rglob("*.py") if p.name != "__init__.py")
    assert [name for name, n in names.items() if n > 1] == []
