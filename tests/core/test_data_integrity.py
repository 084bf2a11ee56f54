"""docs/rules.md#contract: a contract names only bytes that were trained on. Every JSONL row read after validation is
checked against the digest of the line that was validated."""

import pytest

from tests.core.coretest_helpers import ref_for, row, write_jsonl
from value_assets.core.dataset import validate_dataset
from value_assets.core.errors import InputError
from value_assets.core.objective import Objective

pytestmark = pytest.mark.unit


def test_a_row_rewritten_after_validation_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [row(f"r{i}", returns=[1.0, 1.0]) for i in range(4)])
    ds = validate_dataset(ref_for(path, 4), Objective())
    assert ds.row(2).returns.tolist() == [1.0, 1.0]
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"1.0", b"0.0")  # same length, labels swapped, in place
    path.write_bytes(b"".join(lines))
    with pytest.raises(InputError, match=r"t\.jsonl:3: row changed since the dataset was validated"):
        ds.row(2)
    assert ds.row(1).sample_id == "r1"  # untouched rows still read
