#!/usr/bin/env bash
# Verify a presharded output on the GPUs of one node before serving it (one process per GPU, NCCL).
#   examples/torchrun_verify.sh MODEL OUT [TP]
# Multi-node: the same command with --torchrun "--nnodes N --node-rank I --rdzv-backend c10d
# --rdzv-endpoint HOST:PORT --nproc-per-node G" on every node, N x G = TP; each node needs only the
# manifest and its own ranks' folders, and only the node of rank 0 needs MODEL.
set -euo pipefail
model=${1:?usage: $0 MODEL OUT [TP]}
out=${2:?usage: $0 MODEL OUT [TP]}
tp=${3:-8}

# Split once (CPU is enough) unless it is already there, then prove the bytes on the CPU.
[ -f "$out/tpshard-manifest.json" ] || tpshard split "$model" -o "$out" --tp "$tp"
tpshard check "$out" --source "$model"

# Prove the numbers on the deployment hardware: every layer, then the whole decoder vs transformers.
# --torchrun keeps verify's exit codes (0 ok, 1 mismatch, 2 bad input, 3 a rank crashed or hung);
# plain torchrun would turn every failure into 1.
tpshard verify "$out" --source "$model" --model --backend nccl --timeout 1800 \
    --torchrun "--standalone --nproc-per-node $tp" --report verify-report.json --junit verify-junit.xml

# With fewer GPUs than ranks (e.g. one GPU), NCCL cannot run; --backend auto (the default) then runs
# gloo ranks that share the GPUs, and says so:
#   tpshard verify "$out" --source "$model"
