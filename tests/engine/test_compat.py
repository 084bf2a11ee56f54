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
