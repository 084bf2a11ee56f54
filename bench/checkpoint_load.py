"""What checked reads cost when a critic is saved and loaded (benchmark, not a test): prints a table.

A critic (random weights, Adam state after one step) is saved with `save_critic`; then, in this
one process, each step is timed:

* `save`: megatron-core's `dist_checkpointing.save` of model and optimizer, and then the
  description the contract binds (`describe_folder`: every 16 MiB chunk of every file hashed, in
  threads), which is what hashing adds to a save;
* `verify`: the driver's check of every file against the contract (`verify_checkpoint`), with the
  chunk digests new contracts bind and with the whole-file sha256 older contracts bind;
* `megatron`: megatron-core's own `dist_checkpointing.load` (no check; unpickles the index);
* `checked`: `load_model_weights` / `load_critic` with the contract (gpu/runtime/checkpoint.py:
  only the chunks that hold the bytes the load asks for are read, each hashed and checked, and the
  tensors cut from those buffers); with `--old`, also with the whole-file contract (every file
  read whole and hashed, the pre-chunk way);

for the forward-only load (model tensors, as evaluation and export) and the resume load (model and
optimizer). Before the timings, megatron's load and the checked load each run once into tensors
overwritten first, and every restored tensor must equal the saved one bit for bit (the run stops
otherwise): a loader that skipped work could not time fast. The files are in the page cache after
the save, so the table compares the CPU work of reading, hashing and decoding, not disk speed.
Targets (issue 30, on the H200): verify <= 3 s for 1.5B, checked forward-only <= 2x megatron's,
checked resume <= 1.3x megatron's.

    python bench/checkpoint_load.py --model 1.5b [--dir /tmp] [--repeat 2] [--threads N] [--old]
    python bench/checkpoint_load.py --model tiny             # CPU smoke run
    python bench/checkpoint_load.py --model small            # CPU: about 1 GB of files
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _state_tensors(ddp, opt, with_optimizer: bool) -> list[torch.Tensor]:
    """The tensors a load restores: the model's (and, for a resume, every optimizer's fp32 main
    parameters and Adam moments; 0-dim entries such as the step count are left out)."""
    out = [t for t in ddp.module.state_dict().values() if torch.is_tensor(t) and t.dim() > 0]
    if with_optimizer:
        from value_assets.gpu.runtime.checkpoint import inner_optimizers

        for inner in inner_optimizers(opt):
            for group in inner.param_groups:
                for p in group["params"]:
                    out.append(p.data)
                    out += [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    return out


def _restores(load, collect, saved: list[torch.Tensor]) -> int:
    """Overwrite every tensor a load must restore, run the load, and require each tensor the model
    and optimizer then hold (`collect()`, gathered again: an optimizer's load may put new tensors in
    its state) to equal what was saved, bit for bit: a load that skipped a tensor (or read the wrong
    bytes) would time faster and fail here. Returns the number of elements compared."""
    with torch.no_grad():
        for t in collect():
            t.fill_(-3)
    load()
    _sync()
    tensors = collect()
    if len(tensors) != len(saved):
        raise SystemExit(f"a load left {len(tensors)} tensors where {len(saved)} were saved")
    bad = [i for i, (t, s) in enumerate(zip(tensors, saved, strict=True)) if not torch.equal(t.cpu(), s)]
    if bad:
        first = tensors[bad[0]]
        raise SystemExit(
            f"a load did not restore {len(bad)} of {len(tensors)} tensors (first: #{bad[0]}, "
            f"shape {tuple(first.shape)}, {(first.cpu() != saved[bad[0]]).sum().item()} elements differ)"
        )
    return sum(t.numel() for t in tensors)


def _presets():
    from value_assets.gpu.model.gpt_critic import BackboneConfig

    return {
        "tiny": BackboneConfig.tiny,
        # CPU-sized: 4 layers of width 1024, vocab 32768 (~80M parameters, ~1 GB of files with Adam).
        "small": lambda: BackboneConfig.tiny(
            num_layers=4,
            hidden_size=1024,
            ffn_hidden_size=2816,
            num_attention_heads=16,
            num_query_groups=4,
            vocab_size=32768,
        ),
        **{size: (lambda size=size: BackboneConfig.qwen2_5(size)) for size in ("0.5b", "1.5b", "3b", "7b")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "small", "0.5b", "1.5b", "3b", "7b"])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint is written (removed after)")
    ap.add_argument("--repeat", type=int, default=2, help="timings per row; the best is shown")
    ap.add_argument("--threads", type=int, default=None, help="hashing threads (default: one per core)")
    ap.add_argument("--chunk-mib", type=int, default=16, help="chunk size of the digests, MiB")
    ap.add_argument("--old", action="store_true", help="also time checked loads against a whole-file contract")
    ap.add_argument("--profile", action="store_true", help="print where a checked forward-only load spends its time")
    args = ap.parse_args()
    if args.threads is not None:
        from value_assets.core.chunks import THREADS_ENV

        os.environ[THREADS_ENV] = str(args.threads)

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from value_assets.core.checkpoint_files import describe_folder, verify_checkpoint
    from value_assets.core.chunks import hash_threads
    from value_assets.core.hashing import sha256_file
    from value_assets.core.objective import Objective
    from value_assets.gpu.model.gpt_critic import build_critic
    from value_assets.gpu.model.packing import Row, pack_rows
    from value_assets.gpu.runtime import checkpoint as ckpt
    from value_assets.gpu.runtime.parallel import destroy, init_distributed
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training

    cuda = torch.cuda.is_available()
    threads = hash_threads(1 << 30)
    chunk_bytes = args.chunk_mib << 20
    init_distributed(0, 1, "127.0.0.1", 0, backend=None if cuda else "gloo")
    folder = Path(tempfile.mkdtemp(prefix="ckload", dir=args.dir))
    rows_out: list[tuple[str, float]] = []
    checks: list[str] = []
    try:
        obj, cfg = Objective(), _presets()[args.model]()
        ddp, opt = wrap_for_training(build_critic(cfg, obj), lr=1e-5, weight_decay=0.0, clip_grad=1.0)
        rows = [
            Row(
                row_id=i,
                tokens=torch.randint(0, cfg.vocab_size, (64,)).numpy(),
                response_length=32,
                returns=torch.zeros(32).numpy(),
            )
            for i in range(2)
        ]
        optimizer_step(ddp, opt, pack_rows(rows, 4096), 2, obj)  # Adam state exists

        saves, describes = [], []
        step = None
        for r in range(args.repeat):  # each save into a fresh folder; the last one is loaded below
            if step is not None:
                shutil.rmtree(step.parent)
            step = folder / f"save{r}" / "iter_0000001"
            step.mkdir(parents=True)
            _sync()
            t0 = time.perf_counter()
            ckpt.save_critic(step, ddp, opt, iteration=1)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            files = describe_folder(step, chunk_bytes=chunk_bytes)
            describes.append(time.perf_counter() - t0)
        assert step is not None
        contract = {"checkpoint": step.name, "checkpoint_files": files}
        whole = {
            "checkpoint": step.name,
            "checkpoint_files": [
                {"path": f["path"], "size": f["size"], "sha256": sha256_file(step / f["path"])} for f in files
            ],
        }
        size_gb = sum(f["size"] for f in files) / 1e9
        rows_out += [("save: megatron (unchecked)", min(saves)), ("save: hash every chunk (describe)", min(describes))]

        def megatron(with_optimizer: bool, into_modules: bool = True):
            # Megatron-LM's own load: dist_checkpointing.load, then the loaded state into the model
            # (and the optimizer), as its load_checkpoint does; `into_modules=False` is the read alone.
            def run():
                ckpt.safe_byte_entries()
                sd = ckpt._model_sharded_state_dict(ddp.module)
                state = {"model": sd, "iteration": torch.tensor(0, dtype=torch.int64)}
                if with_optimizer:
                    state["optimizer"] = opt.sharded_state_dict(sd, is_loading=True, metadata=ckpt._OPTIMIZER_METADATA)
                loaded = dist_checkpointing.load(state, str(step), strict=StrictHandling.RAISE_UNEXPECTED)
                if into_modules:
                    ddp.module.load_state_dict(loaded["model"], strict=True)
                    if with_optimizer:
                        with torch.no_grad():
                            opt.load_state_dict(loaded["optimizer"])

            return run

        def checked(with_optimizer: bool, c):
            if with_optimizer:
                return lambda: ckpt.load_critic(step, ddp, opt, contract=c)
            return lambda: ckpt.load_model_weights(step, ddp.module, contract=c)

        rows_out += [
            ("verify (driver, every file): chunks", _best(lambda: verify_checkpoint(step, contract), args.repeat)),
            ("verify: whole-file sha256 (old contract)", _best(lambda: verify_checkpoint(step, whole), args.repeat)),
        ]
        for label, with_opt in (("forward-only", False), ("resume", True)):
            # Each loader, once, into overwritten tensors: it must restore what was saved.
            def collect(with_opt=with_opt):
                return _state_tensors(ddp, opt, with_opt)

            saved = [t.detach().to("cpu", copy=True) for t in collect()]
            for name, load in (("megatron", megatron(with_opt)), ("checked", checked(with_opt, contract))):
                n = _restores(load, collect, saved)
                checks.append(f"{label}, {name}: {len(saved)} tensors ({n / 1e9:.2f} G elements) restored bit for bit")
            del saved
            rows_out += [
                (f"{label}: megatron, read alone (unchecked)", _best(megatron(with_opt, False), args.repeat)),
                (f"{label}: megatron (unchecked)", _best(megatron(with_opt), args.repeat)),
                (f"{label}: the product's load, unchecked", _best(checked(with_opt, None), args.repeat)),
                (f"{label}: checked", _best(checked(with_opt, contract), args.repeat)),
            ]
            if args.old:
                rows_out.append((f"{label}: checked, old contract", _best(checked(with_opt, whole), args.repeat)))
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(ckpt.load_model_weights, step, ddp.module, contract=contract)
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    finally:
        destroy()
        shutil.rmtree(folder, ignore_errors=True)

    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"\n{args.model} critic, {size_gb:.2f} GB of checkpoint files in {len(files)} files (model + Adam state), "
        f"{device}, {threads} hashing threads ({os.cpu_count()} cores), {args.chunk_mib} MiB chunks, best of "
        f"{args.repeat}\n"
    )
    for line in checks:
        print(line)
    print()
    print("| step | seconds | GB/s of files |")
    print("| --- | --- | --- |")
    for name, seconds in rows_out:
        print(f"| {name} | {seconds:.3f} | {size_gb / seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
