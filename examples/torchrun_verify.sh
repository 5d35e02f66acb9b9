#!/usr/bin/env bash
# Verify a presharded output on the GPUs of one node before serving it (one process per GPU, NCCL).
#   examples/torchrun_verify.sh MODEL OUT [TP]
# Multi-node: the same tpshard command under torchrun --nnodes N --node-rank I --rdzv-backend c10d
# --rdzv-endpoint HOST:PORT --nproc-per-node G, with N x G = TP.
set -euo pipefail
model=${1:?usage: $0 MODEL OUT [TP]}
out=${2:?usage: $0 MODEL OUT [TP]}
tp=${3:-8}

# Split once (CPU is enough) unless it is already there, then prove the bytes on the CPU.
[ -f "$out/tpshard-manifest.json" ] || tpshard split "$model" -o "$out" --tp "$tp"
tpshard check "$out" --source "$model"

# Prove the numbers on the deployment hardware: every layer, then the whole decoder vs transformers.
torchrun --standalone --nproc-per-node "$tp" -m tpshard verify "$out" --source "$model" \
    --model --report verify-report.json --junit verify-junit.xml

# With fewer GPUs than ranks (e.g. one GPU), NCCL cannot run; use CPU ranks instead:
#   tpshard verify "$out" --source "$model" --backend gloo
