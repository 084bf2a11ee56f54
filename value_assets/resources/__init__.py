"""Dagster resources: where artifacts live, where manifests arrive, and how the GPU job runs.

This package is imported by the Dagster process; it never imports torch, megatron or
`value_assets.gpu` (tests/dagster/test_dg_layers.py and tests/test_imports.py check it).
"""

from value_assets.resources.artifacts import ArtifactStore, ManifestInbox
from value_assets.resources.launchers import (
    GpuJobLauncher,
    K8sPodLauncher,
    RayJobLauncher,
    SubprocessLauncher,
    accept_results,
)

__all__ = [
    "ArtifactStore",
    "ManifestInbox",
    "GpuJobLauncher",
    "SubprocessLauncher",
    "RayJobLauncher",
    "K8sPodLauncher",
    "accept_results",
]
