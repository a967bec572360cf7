#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU machine (one device, minutes of time):
# the CUDA tests, then the seed's workloads at real size on one GPU, fp16, AdamW. Every step runs
# even when one before it failed; each writes its own log under $OUT (at most 8 files come back).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh          # from the repository root
#
# On the lent machine DSpark is not installed: it runs from src/ (PYTHONPATH), on the python3 that
# holds that machine's CUDA PyTorch. GPT-2 124M runs at global batch 32, not the article's 256: at
# 1024 tokens a sequence's fp16 activations and logits take about 1 GB, so 256 of them do not fit
# one GPU, and the lab has no micro-batching yet (README, "Figures").
set -u
OUT=${OUT:-gpu-session}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name(0))'
} > "$OUT/machine.txt" 2>&1

# 1. the tests marked gpu: the engine on one GPU against the CPU reference (fp32, bf16, fp16 with
#    loss scaling), the NCCL backend choice and the allocator-based peak memory
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py \
  tests/engine/test_observe_gpu.py > "$OUT/cuda_tests.txt" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.txt"

# 2. the seed's workloads at real size on one GPU: ResNet-50 at the article's batch 256, GPT-2 124M
#    at 32 (see above); one round each, 3 warm-up and 10 timed steps
bench() {
  local name=$1 batch=$2
  timeout 270 "$PY" -m dspark.cli.main bench --workloads "$name" --devices 1 --strategies replicate \
    --precision fp16 --global-batch "$batch" --rounds 1 --warmup 3 --steps 10 \
    --db "$OUT/ledger.sqlite" --json "$OUT/$name.json" --no-progress > "$OUT/$name.txt" 2>&1
  echo "exit $?" >> "$OUT/$name.txt"
}
bench resnet50 256
bench gpt2-124m 32
