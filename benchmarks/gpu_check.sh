#!/usr/bin/env bash
# The prepared GPU check of `tpshard verify` (docs/verify.md, "GPU check"): on a machine with one or
# more NVIDIA GPUs and its own CUDA torch, install tpshard without touching that torch, build a
# Llama-shaped model (~380 MB) and an FP8-block quantized one, split them at tp 1/2/4/8 (+ attn-dp 2),
# verify with NCCL where the GPU count allows (spawned and under torchrun) and with ranks sharing
# the GPUs otherwise, plant faults and see them caught, and write a report.
#
#   benchmarks/gpu_check.sh [OUT]                 # default OUT: ./gpu-check; report: OUT/report.md, OUT/report.json
#   benchmarks/gpu_check.sh --no-install [OUT]    # tpshard already installed
#   benchmarks/gpu_check.sh --cpu --small [OUT]   # no GPU: the same steps on CPU ranks, GPU steps skipped (the test runs this)
#
# Budget: under 8 minutes on one GPU. Exit 0 when every step gave the expected verdict.
set -euo pipefail
cd "$(dirname "$0")/.."
install=1
args=()
for a in "$@"; do
    case "$a" in
        --no-install) install=0 ;;
        *) args+=("$a") ;;
    esac
done
if [ "$install" = 1 ]; then
    # Keep the machine's torch: pin it as a constraint, so pip fails rather than replace it.
    torch_version=$(python3 -c 'import torch; print(torch.__version__)')
    constraints=$(mktemp)
    echo "torch==${torch_version}" > "$constraints"
    python3 -m pip install -q -e '.[verify]' -c "$constraints"
    after=$(python3 -c 'import torch; print(torch.__version__)')
    [ "$after" = "$torch_version" ] || { echo "gpu_check: torch changed from $torch_version to $after" >&2; exit 3; }
fi
exec python3 benchmarks/gpu_check.py "${args[@]}"
