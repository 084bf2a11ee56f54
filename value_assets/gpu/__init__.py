"""What runs on the Ray cluster: critic model, packing, losses, training step, checkpoint IO.

Imports core, torch, megatron-core and ray; never dagster.

Importing this package hides megatron-core's import-time warnings (on CPU: "Transformer Engine
and Apex are not installed", deprecations of its own modules, torch's `jit.script_method`
deprecation its fused kernels trigger): nothing in them is for the user to act on. Every process
that runs the job imports this package before megatron (the CLI commands, the Pipes job, and each
Ray worker when it loads its actor class), so this one place covers them all; our own warnings and
everyone else's stay.

For the same reason it defers megatron-core's `jit_fuser` (`torch.compile`, applied as a decorator
to ~40 fused elementwise functions while `megatron.core` imports) to each function's first call:
decorating imports torch._dynamo and inductor, ~1.5 s of CPU in every process that imports
megatron (each Ray worker, each rank), although the critic calls at most one of those functions
(the fused SwiGLU, on CUDA only). A function that is called compiles then, as torch.compile would
at its first call anyway.
"""

from __future__ import annotations

import functools as _functools
import importlib.abc as _abc
import sys as _sys
import warnings as _warnings

from value_assets.core.errors import exc_summary as _exc_summary


def quiet_megatron_warnings() -> None:
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        _warnings.filterwarnings("ignore", category=category, module=r"megatron")  # also megatron_fsdp
    _warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning
    )


def _compile_on_first_call(compile_fn):
    """A `jit_fuser` that applies `compile_fn` (torch.compile) to a function at its first call.

    If that first compiled call fails and the function as written then succeeds on the same
    arguments, the compiler cannot build here (no Triton or C compiler, an unsupported GPU): the
    function runs uncompiled from then on, with one warning naming it. An error of the function
    itself still raises (from the uncompiled call)."""

    def jit_fuser(fn):
        compiled = None

        @_functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is not None:
                return compiled(*args, **kwargs)
            candidate = compile_fn(fn)
            try:
                out = candidate(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (any compiler failure)
                out = fn(*args, **kwargs)
                _warnings.warn(
                    f"megatron's fused {fn.__module__}.{fn.__qualname__} runs uncompiled: torch.compile "
                    f"failed here ({_exc_summary(exc)})",
                    RuntimeWarning,
                    stacklevel=2,
                )
                compiled = fn
                return out
            compiled = candidate
            return out

        return call

    return jit_fuser


class _DeferMegatronJit(_abc.MetaPathFinder):
    """Runs megatron.core.jit as usual, then swaps its `jit_fuser` for the deferred one, if (and
    only if) that is `torch.compile`: any other choice (torch.jit.script on an old torch, the
    no-op decorator) is left as megatron made it."""

    NAME = "megatron.core.jit"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.NAME:
            return None
        for finder in _sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_defer(module):
            exec_module(module)
            torch = getattr(module, "torch", None)
            if torch is not None and getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = _compile_on_first_call(torch.compile)

        loader.exec_module = exec_then_defer  # this spec's loader instance only
        return spec


def defer_megatron_jit() -> None:
    """Install the deferral (idempotent); no effect once megatron.core.jit is imported."""
    if not any(isinstance(f, _DeferMegatronJit) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _DeferMegatronJit())


quiet_megatron_warnings()
defer_megatron_jit()
