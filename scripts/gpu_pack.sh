#!/usr/bin/env bash
# Prepares the one GPU experiment of issues #44/#48 (benchmarks/gpu/backbone_adaptation.py: hllm.recipes.realtext with
# configs/realtext/gpu/*.yaml) to travel to a lent GPU machine, which has torch, transformers, peft and scipy but no
# weights, no ../shared and no ir_measures, and takes at most 64 MiB a call: the cut SmolLM2 and Gemma 3 backbones in
# int8 parts, DL19's five first stages with RankVicuna's runs and DL21, and the missing wheels, all in ignored folders
# (gpu_pack/, .whl/). Then prints the device calls to make, in order.
#   scripts/gpu_pack.sh            # after scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/gpu_pack/' .git/info/exclude 2>/dev/null || echo '/gpu_pack/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf gpu_pack .whl
.venv/bin/python benchmarks/gpu/pack.py pack gpu_pack
# the GPU image's Python is 3.12: the wheels hLLM imports there and it lacks (metrics, BM25 for the embedded data, DeepSpeed's own)
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "ir-measures==0.4.3" "pytrec-eval-terrier==0.5.11" "pydantic==2.14.4" "pydantic-core==2.50.5" \
  "annotated-types==0.8.0" "typing-inspection==0.4.5" "hjson==3.1.0" "rank-bm25==0.2.2" 2>&1 | grep -v "is ignored" || true
# DeepSpeed is a source distribution on PyPI: its wheel is pure Python (ops compile when used; the step uses none)
.venv/bin/python -m pip wheel --quiet --no-deps -w .whl "deepspeed==0.19.8" 2>&1 | grep -v "is ignored" || true
parts=$(ls -d gpu_pack/*/part* gpu_pack/*/meta | sort)
install='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;'
echo
echo "sizes (MiB): $(cat gpu_pack/pack.json | tr -d '\n ')"
echo "Device calls, in order (each carries at most 64 MiB; what earlier calls carried stays on the machine while it is held):"
for p in $parts; do
  echo "  run(carry=[\"$p\"], command=\"ls -la $p\", timeout_s=60)"
done
echo "  run(carry=[\"gpu_pack/data\", \"gpu_pack/pack.json\", \".whl\"], timeout_s=600, command="
echo "      \"$install python3 benchmarks/gpu/pack.py unpack gpu_pack && PYTHONUNBUFFERED=1 python3 benchmarks/gpu/deepspeed_step.py --pack gpu_pack 2>&1 | tee \$OUT/deepspeed.txt; PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/gpu/backbone_adaptation.py --pack gpu_pack --out \$OUT 2>&1 | tee \$OUT/log.txt\")"
echo "Make each call within 30 s of the one before (a warm machine keeps what was carried; a cold one starts bare). A run cut"
echo "by its timeout keeps its finished (trial, fold) files in \$OUT/<config>/folds: carry that \$OUT into the next call with --resume. Then"
echo "copy \$OUT/backbone_adaptation.md and deepspeed.txt to reports/ (they name the GPU) and commit. Budget: ~2 min start,"
echo "<1 min a part (SmolLM2 2, Gemma 3 5, two metas), ~1 min to unpack, ~1 min the DeepSpeed step, 7 min of folds."
