#!/usr/bin/env bash
# The GPU paths in one run of at most 8 minutes, on a GPU machine's own Python (its torch and
# transformers kept), with tiny models built from configs and no downloaded weights:
#   1. the built-in demo on CUDA, float32, then bf16 autocast: accuracy as on the CPU;
#   2. the padding-free passes and the fused output layer against the padded passes, on CUDA;
#   3. one PPO iteration's passes on a SmolLM2-135M-shaped model: seconds and peak memory;
#   4. the generation server (ppo-rlhf serve, issue 59) with a trainer beside it on one GPU, and on
#      two (the server on the second), synchronous and --max-staleness 1, weights pushed over NCCL
#      (skipped, saying so, where the image has no vLLM).
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # here, once: the packages the GPU image lacks, into .whl/
#   bash benchmarks/gpu_check.sh OUT              # on the GPU machine (the device tool: carry .whl)
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu_check.sh OUT   # the dry run, on a CPU
#
# What the GPU image lacks of the project's needs (its package list, /work/.library/device/KINDS.md):
# datasets (and dill, multiprocess) and gymnasium (and farama-notifications); everything else --
# torch, transformers, accelerate, peft, safetensors, tokenizers, tensorboard, matplotlib, pyyaml,
# tqdm, numpy -- it holds.  The wheels are pure Python, a few MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18 gymnasium==1.2.2 farama-notifications==0.0.4 filelock==3.20.0"
if [ "${1:-}" = "--fetch-wheels" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl $WHEELS
    grep -qxF "/.whl/" .git/info/exclude || echo "/.whl/" >> .git/info/exclude
    du -sh .whl
    exit 0
fi

OUT="${1:-runs/gpu_check}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
start=$(date +%s)
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD/src:/tmp/site:${PYTHONPATH:-}"
else
    export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 - <<'EOF'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
EOF

# 1. The demo: SFT -> reward model -> PPO -> evaluation on 2,000 held-out prompts, float32 then bf16.
if [ -n "${QUICK:-}" ]; then steps="--sft-steps 40 --rm-steps 20 --ppo-iterations 3"; else steps=""; fi
for precision in no bf16; do
    cat > "$OUT/stages_$precision.yaml" <<EOF
sft: {device: $DEVICE, mixed_precision: "$precision"}
rm: {device: $DEVICE, mixed_precision: "$precision"}
ppo: {device: $DEVICE, mixed_precision: "$precision"}
EOF
    python3 -m ppo_rlhf.cli demo --out "$OUT/demo_$precision" --overwrite --stages-config "$OUT/stages_$precision.yaml" \
        $steps > "$OUT/demo_$precision.log" 2>&1
    python3 - "$OUT/demo_$precision/summary.json" "$precision" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
before, after = summary["before"], summary["after"]
print(f"demo ({sys.argv[2]}): exact match {before.get('eval/exact_match')} -> {after.get('eval/exact_match')}, "
      f"PPO {summary['ppo_seconds']} s")
EOF
    echo "  $(( $(date +%s) - start )) s so far"
done

# 2, 3 and 4. The passes against the padded ones; one iteration's seconds and memory; the server.
size=smollm2; [ -n "${QUICK:-}" ] && size=tiny
python3 benchmarks/gpu_check.py --device "$DEVICE" --size "$size" --out "$OUT/gpu_check.json"
echo "gpu_check: $(( $(date +%s) - start )) s in all"
