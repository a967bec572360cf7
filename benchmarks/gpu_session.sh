#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU machine (one device, minutes of time):
# the CUDA tests, then the seed's workloads at real size on one GPU, fp16, AdamW. Every step runs
# even when one before it failed; each writes its own log under $OUT (9 files).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh          # from the repository root
#
# On the lent machine DSpark is not installed: it runs from src/ (PYTHONPATH), on the python3 that
# holds that machine's CUDA PyTorch. At 1024 tokens a GPT-2 sequence's fp16 activations and logits
# take about 1 GB, so 256 of them do not fit one GPU in one pass: the lab and
# benchmarks/one_device_vs_pytorch.py both run GPT-2 124M's 256 as 8 micro-batches of 32.
# Peak memory per engine is measured in isolation: the lab runs each configuration (DSpark, DDP) in
# its own worker process, and one_device_vs_pytorch.py measures each choice's peak alone on the
# device after the timed rounds (the others freed, the allocator's peak reset); a process-wide peak
# with all three alive would count two other copies of the model state in each figure.
# This version (isolated peaks, DDP beside DSpark in the lab) awaits a lent GPU: it has not run on
# one yet. Keep what it writes under benchmarks/results/<date>-<machine>/ (artifact.json is written
# for `make figures`), then pin it: python -m dspark.bench.figures --pin <date>-<machine>.
# Worst case 90 + 2 x 100 + 150 + 2 x 50 s = 9 min; about 4 minutes expected. 9 files come back.
set -u
OUT=${OUT:-gpu-session}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=220

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name(0))'
} > "$OUT/machine.txt" 2>&1

# 1. the tests marked gpu: the engine on one GPU against the CPU reference, every strategy in fp32,
#    bf16 and fp16 (loss scaling), on the single-process stand-in and on a real one-rank NCCL group;
#    clipping and an fp16 overflow in the GPU's order of work (the norm read after the optimizer is
#    queued); the NCCL backend choice, the step breakdown's CUDA events, the allocator's peak memory
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py \
  tests/engine/test_observe_gpu.py > "$OUT/cuda_tests.txt" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.txt"

# 2. the lab at real size on one GPU, fp16, with the step breakdown, the article's batch 256:
#    ResNet-50 in one pass, GPT-2 124M in 8 micro-batches of 32 (its max_micro_batch); DSpark's
#    replicate beside DDP (PyTorch's AMP recipe: autocast + GradScaler)
bench() {
  local name=$1 batch=$2
  timeout 100 "$PY" -m dspark.cli.main bench --workloads "$name" --devices 1 --strategies replicate,torch-ddp \
    --precision fp16 --global-batch "$batch" --rounds 1 --warmup 3 --steps 10 --profile \
    --db "$OUT/ledger.sqlite" --no-progress \
    > "$OUT/$name.txt" 2>&1
  echo "exit $?" >> "$OUT/$name.txt"
}
bench resnet50 256
bench gpt2-124m 256

# 3. side by side with plain PyTorch (autocast + GradScaler, AdamW default and fused) in interleaved
#    rounds, all in side_by_side.txt: (a) the seed's configuration, global batch 256, fp16, GPT-2
#    124M as 8 micro-batches of 32; (b) ResNet-50 again under the profiler (host syncs, kernel
#    launches per step); (c) GPT-2 124M in bf16 with clipping at 1.0, as nanoGPT trains
SBS=benchmarks/one_device_vs_pytorch.py
{
  timeout 150 "$PY" $SBS --workloads resnet50,gpt2-124m --global-batch 256 \
    --micro-batch resnet50=256,gpt2-124m=32 --precision fp16 --rounds 3 --steps 4 --warmup 2 \
    --json "$OUT/side_by_side.json"
  echo "exit $?"
  timeout 50 "$PY" $SBS --workloads resnet50 --global-batch 256 --micro-batch 256 \
    --precision fp16 --rounds 3 --steps 6 --profile
  echo "exit $?"
  timeout 50 "$PY" $SBS --workloads gpt2-124m --global-batch 32 --micro-batch 32 \
    --precision bf16 --clip 1.0 --rounds 3 --steps 6
  echo "exit $?"
} > "$OUT/side_by_side.txt" 2>&1

# 4. the record `make figures` reads: the lab's ledger rows with their hashes, the command that
#    measured them (this script), the commit, the machine
"$PY" -m dspark.cli.main bench export --db "$OUT/ledger.sqlite" --rows "$OUT/ledger.jsonl" \
  > "$OUT/export.txt" 2>&1 && rm -f "$OUT/ledger.sqlite"
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then COMMIT="$COMMIT (with uncommitted changes)"; fi
MACHINE=$(sed -n 3p "$OUT/machine.txt" | tr -d '"')
cat > "$OUT/artifact.json" <<JSON
{
  "title": "One GPU: the lab at real size, fp16, AdamW, DSpark beside DDP, each in its own processes",
  "command": "OUT=$OUT bash benchmarks/gpu_session.sh",
  "commit": "$COMMIT",
  "machine": "$MACHINE (machine.txt)",
  "notes": "The script's lab step: dspark bench --devices 1 --strategies replicate,torch-ddp --precision fp16 --global-batch 256 --rounds 1 --warmup 3 --steps 10 --profile, for resnet50 and for gpt2-124m (8 micro-batches of 32).",
  "ledger": "ledger.jsonl"
}
JSON
