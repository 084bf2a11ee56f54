"""Where artifacts live: one configurable root, laid out as in docs/architecture.md.

```
<root>/<partition>/registration.json          which manifest file and sha the partition is
<root>/<partition>/manifest.json               byte-identical snapshot of that manifest
<root>/<partition>/plan/plan.json (+ .sha256)
<root>/<partition>/critic/...                  checkpoints, contracts, `latest`
<root>/<partition>/canary/<run id>/...         canary outputs (never promotable)
<root>/<partition>/reports/ev-<sha12>.json (+ .sha256, + plots)
<root>/<partition>/handoff/miles/              the promoted critic for Miles (--critic-load DIR)
<root>/<partition>/handoff/hf/                 the scalar Hugging Face critic (mse; verl)
<root>/<partition>/handoff/.staging-<run id>/  an export in progress (removed when it ends)
<root>/registry/<partition>.json               promotion records
```
"""

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field


class ArtifactStore(ConfigurableResource):
    """The artifacts root. Relative roots resolve against the working directory of the process."""

    root: str = Field(default="artifacts", description="Folder that holds every partition's artifacts.")

    @property
    def root_path(self) -> Path:
        return Path(self.root).expanduser().resolve()

    def partition_dir(self, partition_key: str) -> Path:
        if not partition_key or "/" in partition_key or partition_key in (".", "..", "registry"):
            raise ValueError(f"unusable partition key {partition_key!r}")
        return self.root_path / partition_key

    def registration_path(self, partition_key: str) -> Path:
        return self.partition_dir(partition_key) / "registration.json"

    def manifest_snapshot_path(self, partition_key: str) -> Path:
        return self.partition_dir(partition_key) / "manifest.json"

    def plan_path(self, partition_key: str) -> Path:
        return self.partition_dir(partition_key) / "plan" / "plan.json"

    def critic_dir(self, partition_key: str) -> Path:
        return self.partition_dir(partition_key) / "critic"

    def canary_dir(self, partition_key: str, run_id: str) -> Path:
        return self.partition_dir(partition_key) / "canary" / run_id

    def reports_dir(self, partition_key: str) -> Path:
        return self.partition_dir(partition_key) / "reports"

    def report_path(self, partition_key: str, contract_sha256: str) -> Path:
        return self.reports_dir(partition_key) / f"ev-{contract_sha256[:12]}.json"

    def handoff_dir(self, partition_key: str) -> Path:
        return self.partition_dir(partition_key) / "handoff"

    def handoff_staging_dir(self, partition_key: str, run_id: str) -> Path:
        return self.handoff_dir(partition_key) / f".staging-{run_id}"

    def registry_path(self, partition_key: str) -> Path:
        return self.root_path / "registry" / f"{partition_key}.json"


class ManifestInbox(ConfigurableResource):
    """The folder the sensor watches for manifests, and the data roots datasets must lie under."""

    folder: str = Field(default="manifests", description="Folder scanned for `*.json` manifests.")
    data_roots: list[str] = Field(
        default_factory=list,
        description="When non-empty, dataset paths outside these folders are refused "
        "(docs/rules.md#bad-input-and-safety).",
    )

    default_training: str | None = Field(
        default=None,
        description="A JSON file holding the training spec of manifests that carry none "
        "(docs/rules.md#training-spec); unset: such manifests are refused by name.",
    )

    @property
    def folder_path(self) -> Path:
        return Path(self.folder).expanduser().resolve()

    @property
    def default_spec_path(self) -> Path | None:
        return Path(self.default_training).expanduser().resolve() if self.default_training else None

    def roots(self) -> list[Path] | None:
        return [Path(r).expanduser().resolve() for r in self.data_roots] or None
