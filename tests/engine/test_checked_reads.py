"""gpu/runtime/checkpoint.py's checked reads: the slices kept while a file is hashed are the file's
bytes at those places, a mismatch with the pin uses none of them, and the torch_dist index never
runs pickled code, pinned or not (docs/rules.md#checkpoint-binding, #bad-input-and-safety)."""

from __future__ import annotations

import hashlib
import os
import pickle
import random

import pytest

from value_assets.core.errors import InputError

pytestmark = pytest.mark.unit


@pytest.fixture
def small_chunks(monkeypatch):
    from value_assets.gpu.runtime import checkpoint

    monkeypatch.setattr(checkpoint, "_CHUNK", 7)  # spans cross chunk boundaries everywhere


def test_kept_spans_are_the_files_bytes_at_those_places(tmp_path, small_chunks):
    from value_assets.gpu.runtime.checkpoint import read_checked

    rng = random.Random(0)
    data = bytes(rng.randrange(256) for _ in range(1000))
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    spans = [(0, 0), (0, 1), (5, 9), (6, 30), (500, 7), (993, 7), (0, 1000), (14, 14)]
    kept = read_checked(path, (len(data), hashlib.sha256(data).hexdigest()), spans)
    assert kept == {(off, n): data[off : off + n] for off, n in spans}  # the naive reference: slicing
    assert read_checked(path, None)[(0, -1)] == data


@pytest.mark.parametrize("change", ["a flipped byte", "one byte more", "one byte less"])
def test_a_file_that_differs_from_its_pin_is_refused(tmp_path, small_chunks, change):
    from value_assets.gpu.runtime.checkpoint import read_checked

    data = bytes(range(256)) * 4
    pin = (len(data), hashlib.sha256(data).hexdigest())
    changed = {
        "a flipped byte": data[:100] + bytes([data[100] ^ 1]) + data[101:],
        "one byte more": data + b"\0",
        "one byte less": data[:-1],
    }[change]
    path = tmp_path / "common.pt"
    path.write_bytes(changed)
    with pytest.raises(
        InputError, match=r"common\.pt: read (sha256 [0-9a-f]{64}|\d+ bytes), the contract binds .*the file changed"
    ):
        read_checked(path, pin, [(0, 10)])


def test_a_span_past_the_end_is_refused(tmp_path):
    from value_assets.gpu.runtime.checkpoint import read_checked

    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    with pytest.raises(InputError, match=r"ends at byte 10, before the index's entry at \(offset, length\) \(8, 4\)"):
        read_checked(path, None, [(8, 4)])


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("pinned", [False, True])
def test_a_planted_index_is_never_unpickled(tmp_path, pinned):
    """Unpinned (a backbone folder the user names): the restricted unpickler refuses the global.
    Pinned to the planted bytes themselves (a forged contract): still refused, by the same unpickler."""
    from value_assets.gpu.runtime.checkpoint import _CheckedReader

    marker = tmp_path / "pwned"
    data = pickle.dumps(_Payload(marker))
    (tmp_path / ".metadata").write_bytes(data)
    pins = {".metadata": (len(data), hashlib.sha256(data).hexdigest())} if pinned else None
    with pytest.raises(InputError, match=r"\.metadata: refusing to unpickle posix\.mkdir"):
        _CheckedReader(tmp_path, pins).read_metadata()
    assert not marker.exists()


def test_an_index_file_the_contract_does_not_bind_is_not_read(tmp_path):
    from value_assets.gpu.runtime.checkpoint import _CheckedReader

    (tmp_path / ".metadata").write_bytes(b"anything")
    with pytest.raises(InputError, match=r"\.metadata: the contract does not bind this file; it is not read"):
        _CheckedReader(tmp_path, {"common.pt": (1, "0" * 64)}).read_metadata()


def test_a_file_gone_after_the_check_is_named(tmp_path):
    from value_assets.gpu.runtime.checkpoint import _CheckedReader

    with pytest.raises(InputError, match=r"\.metadata: missing; the file changed after the checkpoint was verified"):
        _CheckedReader(tmp_path, {".metadata": (1, "0" * 64)}).read_metadata()
