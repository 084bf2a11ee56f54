"""gpu/runtime/checkpoint.py's checked reads: the slices kept while a file is hashed are the file's
bytes at those places, a mismatch with the pin uses none of them, only the chunks covering the
slices are read, and the torch_dist index never runs pickled code, pinned or not
(docs/rules.md#checkpoint-binding, #bad-input-and-safety)."""

from __future__ import annotations

import hashlib
import os
import pickle
import random

import pytest

from value_assets.core.chunks import FileBinding
from value_assets.core.errors import InputError

pytestmark = pytest.mark.unit


@pytest.fixture
def small_chunks(monkeypatch):
    from value_assets.gpu.runtime import checkpoint

    monkeypatch.setattr(checkpoint, "_CHUNK", 7)  # spans cross chunk boundaries everywhere


def whole_pin(data):
    """The binding of a contract written before chunk digests."""
    return FileBinding(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def chunk_pin(data, chunk_bytes=16):
    return FileBinding(
        size=len(data),
        chunk_bytes=chunk_bytes,
        chunks=tuple(hashlib.sha256(data[i : i + chunk_bytes]).hexdigest() for i in range(0, len(data), chunk_bytes)),
    )


@pytest.fixture
def counted_file(tmp_path, monkeypatch):
    """(data, path, its chunk pin, the index of every chunk read from then on): 64 chunks of 16 bytes."""
    from value_assets.gpu.runtime import checkpoint

    data = bytes(range(256)) * 4
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    read: list[int] = []
    real = checkpoint.read_chunk_into
    monkeypatch.setattr(checkpoint, "read_chunk_into", lambda fd, b, i, views: read.append(i) or real(fd, b, i, views))
    return data, path, chunk_pin(data), read


SPANS = [(0, 0), (0, 1), (5, 9), (6, 30), (500, 7), (993, 7), (0, 1000), (14, 14), (16, 16), (15, 2), (999, 1)]


@pytest.mark.parametrize("pin", ["whole file", "chunks", "none"])
def test_kept_spans_are_the_files_bytes_at_those_places(tmp_path, small_chunks, pin):
    from value_assets.gpu.runtime.checkpoint import read_checked

    rng = random.Random(0)
    data = bytes(rng.randrange(256) for _ in range(1000))
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    binding = {"whole file": whole_pin(data), "chunks": chunk_pin(data), "none": None}[pin]
    kept = read_checked(path, binding, SPANS)
    assert kept == {(off, n): data[off : off + n] for off, n in SPANS}  # the naive reference: slicing
    assert read_checked(path, binding)[(0, -1)] == data


def test_a_loads_small_read_keeps_its_checked_chunks_for_the_loads_later_read(counted_file):
    """megatron-core 0.19 reads the common state apart from the weights, from the same file: the
    chunks that small read checked are used by the later read from memory (not read again), once;
    every other chunk is read and checked as always, and the cache holds at most its limit."""
    from value_assets.gpu.runtime import checkpoint

    data, path, pin, read = counted_file
    cache = checkpoint.ChunkCache(limit=4)
    assert checkpoint.read_checked(path, pin, [(40, 20)], cache=cache) == {(40, 20): data[40:60]}
    assert read == [2, 3]
    read.clear()
    assert checkpoint.read_checked(path, pin, [(0, 1024)], cache=cache) == {(0, 1024): data}
    assert read == [i for i in range(64) if i not in (2, 3)]  # every chunk checked once in the load
    read.clear()
    changed = bytearray(data)
    changed[100] ^= 1  # chunk 6: a later read of a chunk not kept is checked again and refused
    path.write_bytes(bytes(changed))
    with pytest.raises(InputError, match=r"chunk 6 of 64 \(bytes 96\.\.111\)"):
        checkpoint.read_checked(path, pin, [(0, 1024)], cache=cache)
    big = checkpoint.ChunkCache(limit=4)
    checkpoint.read_checked(path, pin, [(0, 80)], cache=big)  # 5 chunks: more than the limit, none kept
    assert big.take(path, 0) is None


def test_only_the_chunks_covering_the_spans_are_read(counted_file):
    """A forward-only load needs the model's tensors, not the optimizer state beside them: a chunk
    no span touches is neither read nor checked (a change there is the driver's verify's to find)."""
    from value_assets.gpu.runtime import checkpoint

    data, path, pin, read = counted_file
    changed = bytearray(data)
    changed[40 * 16] ^= 1  # a chunk no span touches
    path.write_bytes(bytes(changed))
    assert checkpoint.read_checked(path, pin, [(20, 20), (100, 0), (15 * 16, 33)]) == {
        (20, 20): data[20:40],
        (100, 0): b"",
        (240, 33): data[240:273],
    }
    assert sorted(read) == [1, 2, 15, 16, 17]


@pytest.mark.parametrize(
    "where, chunk", [(0, 0), (517, 32), (999, 62)], ids=["first chunk", "middle chunk", "short last chunk"]
)
def test_a_changed_chunk_that_a_span_needs_is_refused_by_index(tmp_path, where, chunk):
    from value_assets.gpu.runtime.checkpoint import read_checked

    data = bytes(range(250)) * 4  # 62 chunks of 16 bytes and one of 8
    pin = chunk_pin(data)
    changed = bytearray(data)
    changed[where] ^= 1
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(changed))
    lo, hi = chunk * 16, min(chunk * 16 + 16, 1000) - 1
    with pytest.raises(
        InputError,
        match=rf"__0_0\.distcp: chunk {chunk} of 63 \(bytes {lo}\.\.{hi}\): read sha256 [0-9a-f]{{64}}, the "
        rf"contract binds {pin.chunks[chunk]}; the file changed after the checkpoint was verified",
    ):
        read_checked(path, pin, [(0, 3), (500, 30), (990, 10)])


@pytest.mark.parametrize("change", ["one byte more", "one byte less"])
def test_a_chunked_file_of_another_size_is_refused_before_reading(tmp_path, change):
    from value_assets.gpu.runtime.checkpoint import read_checked

    data = bytes(range(256)) * 4
    path = tmp_path / "common.pt"
    path.write_bytes(data + b"\0" if change == "one byte more" else data[:-1])
    size = len(data) + (1 if change == "one byte more" else -1)
    with pytest.raises(InputError, match=rf"common\.pt: size {size}, the contract binds 1024; the file changed"):
        read_checked(path, chunk_pin(data), [(0, 10)])


@pytest.mark.parametrize("pin", ["chunks", "whole file"])
def test_a_pinned_file_swapped_for_a_symlink_is_not_followed(tmp_path, pin):
    """The link leads to the very bytes the contract binds, and is still refused: a contracted save
    holds regular files only, and an older contract's whole-file pin is no exception."""
    from value_assets.gpu.runtime.checkpoint import read_checked

    data = b"weights" * 10
    (tmp_path / "elsewhere").write_bytes(data)
    os.symlink(tmp_path / "elsewhere", tmp_path / "__0_0.distcp")
    binding = chunk_pin(data) if pin == "chunks" else whole_pin(data)
    with pytest.raises(InputError, match=r"__0_0\.distcp: a symlink now \(never followed\); the file changed after"):
        read_checked(tmp_path / "__0_0.distcp", binding, [(0, 7)])
    assert read_checked(tmp_path / "__0_0.distcp", None, [(0, 7)]) == {(0, 7): b"weights"}  # a backbone's own folder


@pytest.mark.parametrize("change", ["a flipped byte", "one byte more", "one byte less"])
def test_a_file_that_differs_from_its_whole_file_pin_is_refused(tmp_path, small_chunks, change):
    from value_assets.gpu.runtime.checkpoint import read_checked

    data = bytes(range(256)) * 4
    pin = whole_pin(data)
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


@pytest.mark.parametrize("pin", ["whole file", "chunks", "none"])
def test_a_span_past_the_end_is_refused(tmp_path, pin):
    from value_assets.gpu.runtime.checkpoint import read_checked

    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    binding = {"whole file": whole_pin(b"0123456789"), "chunks": chunk_pin(b"0123456789", 4), "none": None}[pin]
    with pytest.raises(InputError, match=r"ends at byte 10, before the index's entry at \(offset, length\) \(8, 4\)"):
        read_checked(path, binding, [(8, 4)])


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
    pins = {".metadata": chunk_pin(data)} if pinned else None
    with pytest.raises(InputError, match=r"\.metadata: refusing to unpickle posix\.mkdir"):
        _CheckedReader(tmp_path, pins).read_metadata()
    assert not marker.exists()


def test_an_index_file_the_contract_does_not_bind_is_not_read(tmp_path):
    from value_assets.gpu.runtime.checkpoint import _CheckedReader

    (tmp_path / ".metadata").write_bytes(b"anything")
    with pytest.raises(InputError, match=r"\.metadata: the contract does not bind this file; it is not read"):
        _CheckedReader(tmp_path, {"common.pt": whole_pin(b"x")}).read_metadata()


def test_a_file_gone_after_the_check_is_named(tmp_path):
    from value_assets.gpu.runtime.checkpoint import _CheckedReader

    with pytest.raises(InputError, match=r"\.metadata: missing; the file changed after the checkpoint was verified"):
        _CheckedReader(tmp_path, {".metadata": chunk_pin(b"x")}).read_metadata()


def test_a_saved_critic_comes_back_exactly_from_checked_chunks(tmp_path, monkeypatch):
    """megatron-core's own load through the checked reader, with chunks small enough that tensors
    straddle chunk boundaries: model and Adam state come back bit for bit, each chunk of a data
    file is read once per load, a forward-only load leaves the optimizer's chunks unread, a
    contract with whole-file digests still loads, and a chunk changed after the check is refused
    by index before anything is used (under an old contract: by file)."""
    import dataclasses
    from collections import Counter

    import numpy as np
    import torch

    from value_assets.core.checkpoint_files import describe_folder
    from value_assets.core.objective import Objective
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic
    from value_assets.gpu.model.packing import Row, pack_rows
    from value_assets.gpu.runtime import checkpoint
    from value_assets.gpu.runtime.parallel import destroy, init_distributed
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training

    init_distributed(0, 1, master_port=0, seed=1234)
    try:
        obj, cfg = Objective(), dataclasses.replace(BackboneConfig.tiny(), vocab_size=1024)
        rng = np.random.default_rng(0)
        rows = [
            Row(row_id=i, tokens=rng.integers(0, 1000, size=24), response_length=8, returns=np.zeros(8))
            for i in range(2)
        ]
        ddp, opt = wrap_for_training(build_critic(cfg, obj), lr=1e-3, weight_decay=0.0, clip_grad=1.0)
        optimizer_step(ddp, opt, pack_rows(rows, 4096), 2, obj)
        save = tmp_path / "iter_0000001"
        save.mkdir()
        checkpoint.save_critic(save, ddp, opt, iteration=1)
        contract = {"checkpoint": save.name, "checkpoint_files": describe_folder(save, chunk_bytes=4096)}
        shards = {f["size"] for f in contract["checkpoint_files"] if f["path"].endswith(".distcp")}
        total = sum(len(f["chunk_sha256"]) for f in contract["checkpoint_files"] if f["path"].endswith(".distcp"))

        read: list[tuple[int, int]] = []  # (file size, chunk index) of each chunk read
        events: list[tuple[int, int] | None] = []  # the same, and None for each tensor torch decodes
        real, real_decode = checkpoint.read_chunk_into, checkpoint.decode_record
        shared: list[bool] = []  # per decoded tensor: its storage is the checked span's buffer

        def counted(fd, b, i, views):
            read.append((b.size, i))
            events.append((b.size, i))
            return real(fd, b, i, views)

        def decoded(data):
            events.append(None)
            tensor = real_decode(data)
            if torch.is_tensor(tensor) and tensor.numel():
                begin = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
                shared.append(begin <= tensor.untyped_storage().data_ptr() < begin + len(data))
            return tensor

        monkeypatch.setattr(checkpoint, "read_chunk_into", counted)
        monkeypatch.setattr(checkpoint, "decode_record", decoded)
        ddp2, opt2 = wrap_for_training(build_critic(cfg, obj), lr=1e-3, weight_decay=0.0, clip_grad=1.0)
        assert checkpoint.load_critic(save, ddp2, opt2, contract=contract) == 1
        # One pass: a data file is decoded while its later chunks are still being read and checked
        # (its first tensor is decoded before its last chunk is read), not read whole first.
        biggest = max(shards)
        last_read = max(j for j, e in enumerate(events) if e is not None and e[0] == biggest)
        first_read = min(j for j, e in enumerate(events) if e is not None and e[0] == biggest)
        assert any(e is None for e in events[first_read:last_read]), "the file was read whole before decoding"
        # One copy: each tensor is decoded in place from the buffer its bytes were read and checked
        # in (only the copy into the model is left), not copied out of it into a storage of its own.
        assert shared and all(shared), shared
        monkeypatch.setattr(checkpoint, "decode_record", real_decode)
        for (name, a), b in zip(ddp.module.state_dict().items(), ddp2.module.state_dict().values(), strict=True):
            if torch.is_tensor(a):
                assert torch.equal(a, b), name
        after = [optimizer_step(m, o, pack_rows(rows, 4096), 2, obj)["loss"] for m, o in ((ddp, opt), (ddp2, opt2))]
        assert after[0] == after[1]  # the Adam state came back too
        data_reads = Counter(r for r in read if r[0] in shards)
        assert sum(data_reads.values()) == len(data_reads) == total  # every data chunk, once

        read.clear()
        forward = build_critic(cfg, obj)
        assert checkpoint.load_model_weights(save, forward, contract=contract) == 1
        data_reads = Counter(r for r in read if r[0] in shards)
        assert sum(data_reads.values()) == len(data_reads) < total / 2  # the optimizer's chunks left unread

        # A contract written before chunk digests (whole-file sha256) still loads, the old way.
        old = {
            "checkpoint": save.name,
            "checkpoint_files": [
                {
                    "path": f["path"],
                    "size": f["size"],
                    "sha256": hashlib.sha256((save / f["path"]).read_bytes()).hexdigest(),
                }
                for f in contract["checkpoint_files"]
            ],
        }
        model = build_critic(cfg, obj)
        assert checkpoint.load_model_weights(save, model, contract=old) == 1
        for (name, a), b in zip(forward.state_dict().items(), model.state_dict().values(), strict=True):
            if torch.is_tensor(a):
                assert torch.equal(a, b), name

        shard = next(save.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[4096 * 2 + 7] ^= 1  # chunk 2: model tensors (the first bytes of the shard)
        shard.write_bytes(bytes(data))
        with pytest.raises(InputError, match=rf"{shard.name}: chunk 2 of \d+ \(bytes 8192\.\.12287\): read sha256"):
            checkpoint.load_model_weights(save, build_critic(cfg, obj), contract=contract)
        with pytest.raises(InputError, match=rf"{shard.name}: read sha256 [0-9a-f]{{64}}, the contract binds"):
            checkpoint.load_model_weights(save, build_critic(cfg, obj), contract=old)
    finally:
        destroy()


def test_a_span_read_as_a_file_equals_bytesio():
    """`_ViewFile` (what torch's zip reader reads a record's index from) against io.BytesIO of the
    same bytes, on random seeks and reads, readinto and readall included."""
    import io

    from value_assets.gpu.runtime.checkpoint import _ViewFile

    rng = random.Random(0)
    data = bytes(rng.randrange(256) for _ in range(300))
    ours, ref = _ViewFile(memoryview(data)), io.BytesIO(data)
    for _ in range(200):
        where, whence = rng.randrange(-20, 320), rng.choice([io.SEEK_SET, io.SEEK_CUR, io.SEEK_END])
        if (0 if whence == io.SEEK_SET else ref.tell() if whence == io.SEEK_CUR else 300) + where < 0:
            continue
        assert ours.seek(where, whence) == ref.seek(where, whence)
        n = rng.randrange(0, 80)
        assert ours.read(n) == ref.read(n)
        buf_a = bytearray(rng.randrange(0, 50))
        buf_b = bytearray(len(buf_a))
        assert ours.readinto(buf_a) == ref.readinto(buf_b) and buf_a == buf_b
        assert ours.tell() == ref.tell()
    ours.seek(17)
    ref.seek(17)
    assert ours.read() == ref.read()


def test_a_record_decodes_in_place_as_torch_load_decodes_it():
    """`decode_record` against torch.load (the reference) on records of several dtypes and shapes,
    views of larger storages, a scalar and an empty tensor among them: equal values, dtype, shape
    and strides, and each tensor's storage lies inside the record's own buffer (no copy)."""
    import io

    import numpy as np
    import torch

    from value_assets.gpu.runtime.checkpoint import decode_record

    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 30, generator=g)
    cases = [
        base,
        base[5:17],  # a view: torch.save stores its whole storage
        base.t(),  # non-contiguous strides
        base.to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (33,), generator=g),
        torch.tensor(3.5, dtype=torch.float64),
        torch.zeros(0, 4),
        torch.arange(10, dtype=torch.int8),
    ]
    for tensor in cases:
        raw = io.BytesIO()
        torch.save(tensor, raw)
        buf = np.frombuffer(bytearray(raw.getvalue()), dtype=np.uint8)
        data = memoryview(buf).cast("B")
        ours, ref = decode_record(data), torch.load(io.BytesIO(raw.getvalue()), weights_only=True)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape and ours.stride() == ref.stride()
        assert torch.equal(ours, ref)
        if ours.numel():
            at = ours.untyped_storage().data_ptr() - buf.ctypes.data
            assert 0 <= at < len(data), "decoded into a storage of its own"


def test_preadv_full_fills_every_buffer_as_pread_would(tmp_path):
    """The scatter read behind the checked reads against slicing the file (the reference): random
    cuts into buffers, empty buffers among them, more buffers than one preadv takes, a read past
    the end of the file (short, only at the end)."""
    from value_assets.core.chunks import preadv_full

    rng = random.Random(1)
    data = bytes(rng.randrange(256) for _ in range(5000))
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, total, pieces in [(0, 5000, 7), (123, 3000, 2500), (4000, 2000, 30), (0, 0, 3)]:
            cuts = sorted(rng.randrange(0, total + 1) for _ in range(pieces - 1))
            sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
            bufs = [bytearray(n) for n in sizes]
            got = preadv_full(fd, [memoryview(b) for b in bufs], offset)
            expect = data[offset : offset + total]
            assert got == len(expect)
            assert b"".join(bufs)[:got] == expect
    finally:
        os.close(fd)


def test_a_changed_last_chunk_is_refused_after_decoding_began(tmp_path):
    """Streaming hands out early spans before later chunks are checked: a change in the file's
        last chunk is still refused by index when the load reaches a span that needs it, and no span
    that needs it is given out."""
    from value_assets.gpu.runtime.checkpoint import _checked_spans, _SpanSource

    data = bytes(range(256)) * 4
    pin = chunk_pin(data)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    fd = os.open(path, os.O_RDONLY)
    try:
        spans = [(0, 100), (100, 900), (1000, 24)]
        source = _SpanSource(path, _checked_spans(path, fd, pin, spans, None, None))
        assert source.open((0, 100)) == data[:100]
        assert source.open((0, 100)) == data[:100]  # the same stored item asked for again
        assert source.open((100, 900)) == data[100:1000]  # chunks 6-62, all checked
        with pytest.raises(InputError, match=r"chunk 63 of 64 \(bytes 1008\.\.1023\): read sha256"):
            source.open((1000, 24))
    finally:
        os.close(fd)
