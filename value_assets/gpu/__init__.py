"""What runs on the Ray cluster: critic model, packing, losses, training step, checkpoint IO.

Imports core, torch, megatron-core and ray; never dagster.

Importing this package hides megatron-core's import-time warnings (on CPU: "Transformer Engine
and Apex are not installed", deprecations of its own modules, torch's `jit.script_method`
deprecation its fused kernels trigger): nothing in them is for the user to act on. Every process
that runs the job imports this package before megatron (the CLI commands, the Pipes job, and each
Ray worker when it loads its actor class), so this one place covers them all; our own warnings and
everyone else's stay.
"""

import warnings as _warnings


def quiet_megatron_warnings() -> None:
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        _warnings.filterwarnings("ignore", category=category, module=r"megatron")  # also megatron_fsdp
    _warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning)


quiet_megatron_warnings()
