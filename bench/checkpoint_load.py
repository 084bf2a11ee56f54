"""What checked reads cost when a critic is loaded (benchmark, not a test): prints a table.

A critic (random weights, Adam state after one step) is saved once with `save_critic`; then, in
this one process, each way of loading it is timed:

* `verify`: the driver's check of every file against the contract (`verify_checkpoint`),
* `megatron`: megatron-core's own `dist_checkpointing.load` (no check; unpickles the index),
* `checked`: `load_model_weights` / `load_critic` with the contract (gpu/runtime/checkpoint.py:
  every file read whole once and hashed, only checked bytes used),

for the forward-only load (model tensors, as evaluation and export) and the resume load (model and
optimizer). The files are in the page cache after the save, so the table compares the CPU work of
reading, hashing and decoding, not disk speed. Targets: a checked load costs at most the check
itself on top of megatron's (checked <= megatron + verify).

    python bench/checkpoint_load.py --model 1.5b [--dir /tmp] [--repeat 2]
    python bench/checkpoint_load.py --model tiny             # CPU smoke run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "0.5b", "1.5b"])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint is written (removed after)")
    ap.add_argument("--repeat", type=int, default=2, help="timings per row; the best is shown")
    ap.add_argument("--profile", action="store_true", help="print where a checked forward-only load spends its time")
    args = ap.parse_args()

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from value_assets.core.checkpoint_files import describe_folder, verify_checkpoint
    from value_assets.core.objective import Objective
    from value_assets.gpu.model.gpt_critic import BackboneConfig, build_critic
    from value_assets.gpu.model.packing import Row, pack_rows
    from value_assets.gpu.runtime import checkpoint as ckpt
    from value_assets.gpu.runtime.parallel import destroy, free_port, init_distributed
    from value_assets.gpu.runtime.step import optimizer_step, wrap_for_training

    presets = {"tiny": BackboneConfig.tiny, "0.5b": BackboneConfig.qwen2_5_0_5b, "1.5b": BackboneConfig.qwen2_5_1_5b}
    cuda = torch.cuda.is_available()
    init_distributed(0, 1, "127.0.0.1", free_port(), backend=None if cuda else "gloo")
    folder = Path(tempfile.mkdtemp(prefix="ckload", dir=args.dir))
    try:
        obj, cfg = Objective(), presets[args.model]()
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
        step = folder / "iter_0000001"
        step.mkdir()
        ckpt.save_critic(step, ddp, opt, iteration=1)
        contract = {"checkpoint": step.name, "checkpoint_files": describe_folder(step)}
        size_gb = sum(f["size"] for f in contract["checkpoint_files"]) / 1e9

        def megatron(with_optimizer: bool):
            def run():
                ckpt.safe_byte_entries()
                sd = ckpt._model_sharded_state_dict(ddp.module)
                state = {"model": sd, "iteration": torch.tensor(0, dtype=torch.int64)}
                if with_optimizer:
                    state["optimizer"] = opt.sharded_state_dict(sd, is_loading=True, metadata=ckpt._OPTIMIZER_METADATA)
                dist_checkpointing.load(state, str(step), strict=StrictHandling.RAISE_UNEXPECTED)

            return run

        rows_out = [("verify (driver, every file)", _best(lambda: verify_checkpoint(step, contract), args.repeat))]
        for label, with_opt in (("forward-only", False), ("resume", True)):
            plain = _best(megatron(with_opt), args.repeat)
            if with_opt:
                checked = _best(lambda: ckpt.load_critic(step, ddp, opt, contract=contract), args.repeat)
            else:
                checked = _best(lambda: ckpt.load_model_weights(step, ddp.module, contract=contract), args.repeat)
            rows_out += [(f"{label}: megatron", plain), (f"{label}: checked", checked)]
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
        f"\n{args.model} critic, {size_gb:.2f} GB of checkpoint files (model + Adam state), {device}, best of "
        f"{args.repeat}\n"
    )
    print("| load | seconds | GB/s of files |")
    print("| --- | --- | --- |")
    for name, seconds in rows_out:
        print(f"| {name} | {seconds:.2f} | {size_gb / seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
