#!/usr/bin/env bash
# The checks and benchmarks to run on a GPU machine, in one go, from a checkout:
#
#     OUT=/tmp/gpu-out bash bench/gpu_session.sh            # every step
#     STEPS="tests selfcheck" bash bench/gpu_session.sh      # some of them
#
# Steps (each under its own time limit, each writing $OUT/<step>.log; a failing step does not
# stop the others; the last lines printed are one RESULT line per step, with its exit code):
#   tests      pytest -m gpu: the Triton kernels compiled on CUDA against their torch references,
#              Gemini on the device, the inference engine's Triton paths against transformers
#   selfcheck  phalanx selfcheck (kernels, collectives, plugins, inference, recipe smoke runs)
#   kernels    bench/kernel_speed.py --part gpu: each kernel against torch eager (bf16)
#   inference  bench/inference.py on a randomly initialised SmolLM2-135M-shaped Llama in bf16
#              (HF generate on the same GPU, same dtype, same prompts), then a profile of the engine;
#              inference_nographs: the same with every decode step eager (--cuda-graphs off)
#   engine_tests  the inference engine's CPU test files as they are: on a GPU machine an engine's
#              default device is the GPU, so greedy tokens are checked against transformers there
#              (CUDA graphs on, the Triton kernels compiled)
#   recipes    the recipe commands of tests/emulated on this real GPU (PHALANX_TESTS_ON_CUDA=1):
#              SFT, reward model, DPO, PPO, GRPO (+LoRA), LLaMA pretrain/SFT/export, diffusion, video,
#              protein on one rank; runs of more ranks than GPUs skip
#
# Packages the machine lacks can travel as wheels in .whl/ (installed into /tmp/site first).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_session}
STEPS=${STEPS:-"tests selfcheck kernels inference inference_nographs engine_tests recipes"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline \
       TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/install.log" 2>&1 || echo "wheel install failed (see install.log)"
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/framework:$PWD/kernels:$PWD"
{
    date -u; nvidia-smi -L 2>&1; uptime
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| triton', triton.__version__,
'|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    grep -m1 "model name" /proc/cpuinfo
} 2>&1 | tee "$OUT/env.log"

declare -A RESULT
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    RESULT[$name]="rc=$rc $((SECONDS - start))s"
    tail -n 25 "$OUT/$name.log"
}

SMOL=/tmp/smollm2-shaped
if [[ " $STEPS " == *" inference"* && ! -f $SMOL/config.json ]]; then
    python3 -c "
import sys; sys.path.insert(0, 'bench')
from pathlib import Path
from inference import tiny_llama_dir
# SmolLM2-135M's shapes (random weights: throughput does not depend on them; EOS is ignored)
tiny_llama_dir(Path('$SMOL'), vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3)" >>"$OUT/env.log" 2>&1
fi

step tests 80 python3 -m pytest -q -m gpu -p no:cacheprovider -rA --continue-on-collection-errors tests
step selfcheck 180 python3 -m phalanx.cli selfcheck --json "$OUT/selfcheck.json"
step kernels 80 python3 bench/kernel_speed.py --part gpu --no-compile --reps 10
step inference 100 python3 bench/inference.py --model "$SMOL" --dtype bfloat16 --repeats 2 --no-compiled --profile
step inference_nographs 90 python3 bench/inference.py --model "$SMOL" --dtype bfloat16 --repeats 2 --no-compiled \
    --profile --cuda-graphs off
step engine_tests 240 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --continue-on-collection-errors \
    tests/framework/test_inference_engine.py tests/framework/test_inference_cuda_graphs.py \
    tests/framework/test_inference_families.py tests/framework/test_inference_speed_paths.py \
    tests/framework/test_inference_sampler.py tests/framework/test_inference_lora.py
step recipes 180 env PHALANX_TESTS_ON_CUDA=1 python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs \
    tests/emulated/test_recipe_chat_rlhf.py tests/emulated/test_recipe_chat_rlhf_lora.py \
    tests/emulated/test_recipe_llama_protein.py tests/emulated/test_recipe_video_diffusion.py

echo
for name in $STEPS; do echo "RESULT $name ${RESULT[$name]:-not run}"; done
