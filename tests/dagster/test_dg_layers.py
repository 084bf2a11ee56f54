"""Layer rule: the Dagster process never imports torch, megatron or value_assets.gpu."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import json, sys
import value_assets.definitions as d
import value_assets.resources
d.defs.resolve_asset_graph()
seen = {}
for name in d.DEPLOYMENTS:
    d.make_definitions(d.resources_for(name)).resolve_asset_graph()
    seen[name] = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron') or
    m.startswith('value_assets.gpu'))
print(json.dumps(seen))
"""


def test_definitions_import_no_gpu_stack(tmp_path):
    """One process (importing Dagster and the code location costs ~2.5 CPU-s) builds the
    definitions of every deployment in turn; after each, nothing of the GPU stack is imported."""
    env = {
        **os.environ,
        "VALUE_ASSETS_DEPLOYMENT": "local",
        "RAY_ADDRESS": "http://127.0.0.1:8265",
        "VALUE_ASSETS_GPU_IMAGE": "registry.example/value-assets-gpu:test",
        "DAGSTER_HOME": str(tmp_path),
    }
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"local": [], "ray": [], "kubernetes": []}
