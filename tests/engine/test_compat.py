"""The CPU compatibility layer refuses megatron-core releases it was not written for."""

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("version", ["0.16.1", "0.16.0rc2", "0.19.2"])
def test_supported_megatron_versions_pass(version):
    from value_assets.gpu.runtime.compat import check_megatron_version

    check_megatron_version(version)


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "0.20.0", "1.0.0", "garbage"])
def test_other_megatron_versions_are_refused(version):
    from value_assets.gpu.runtime.compat import check_megatron_version

    with pytest.raises(RuntimeError, match=f"megatron-core {version}.*supports 0.16, 0.19"):
        check_megatron_version(version)


MARK = "--- the imports are done ---"


@pytest.fixture(scope="module")
def fresh_gpu_process():
    """One fresh interpreter, every warning shown, that imports what the driver and each Ray worker
    import, then applies the CPU patches."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    modules = [
        "value_assets.gpu.commands",
        "value_assets.gpu.workers.worker",
        "value_assets.gpu.runtime.step",
        "value_assets.gpu.model.gpt_critic",
        "value_assets.gpu.runtime.checkpoint",
        "value_assets.gpu.convert.bootstrap",
    ]
    code = "; ".join(
        [
            *(f"import {m}" for m in modules),
            "import sys, warnings",
            "warnings.warn('ours stays')",
            "import megatron.core.jit as j",
            "print('torch._dynamo' in sys.modules, j.jit_fuser.__qualname__)",
            f"print({MARK!r}, file=sys.stderr, flush=True)",
            "from value_assets.gpu.runtime.compat import apply_cpu_compat",
            "assert apply_cpu_compat()",
        ]
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_importing_the_job_prints_no_megatron_warning(fresh_gpu_process):
    """A fresh process importing what the driver and each Ray worker import (even with every
    warning shown) prints none of megatron-core's import-time warnings; another's still shows."""
    imports = fresh_gpu_process.stderr.split(MARK, 1)[0]
    assert [line for line in imports.splitlines() if "Warning" in line] == ["<string>:1: UserWarning: ours stays"]
    # megatron's jit_fuser (torch.compile) is deferred to first call: nothing imported dynamo.
    assert fresh_gpu_process.stdout.splitlines()[0].split() == ["False", "_compile_on_first_call.<locals>.jit_fuser"], (
        fresh_gpu_process.stdout
    )


def test_a_deferred_jit_fuser_compiles_once_at_the_first_call():
    from value_assets.gpu import _compile_on_first_call

    compiled: list = []

    def compile_fn(fn):
        compiled.append(fn)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def swish(x, *, beta=1):
        """doc"""
        return x * beta

    fused = _compile_on_first_call(compile_fn)(swish)
    assert compiled == [] and fused.__name__ == "swish" and fused.__doc__ == "doc"
    assert fused(3, beta=2) == ("compiled", 6) and fused(4) == ("compiled", 4)
    assert compiled == [swish]  # once, with the undecorated function


def test_a_jit_fuser_whose_compiler_fails_runs_the_function_as_written_and_says_so():
    from value_assets.gpu import _compile_on_first_call

    def broken_compiler(fn):
        def compiled(*a, **k):
            raise RuntimeError("no triton here\nsecond line")

        return compiled

    calls = []

    def gate(x):
        calls.append(x)
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    fused = _compile_on_first_call(broken_compiler)(gate)
    with pytest.warns(
        RuntimeWarning, match=r"gate runs uncompiled: torch.compile failed here \(RuntimeError: no triton here\)"
    ):
        assert fused(3) == 6
    assert fused(4) == 8 and calls == [3, 4]  # uncompiled from then on, no second compile attempt
    # The function's own error is not taken for a compiler failure: it raises.
    with pytest.raises(ValueError, match="negative"):
        _compile_on_first_call(broken_compiler)(gate)(-1)
