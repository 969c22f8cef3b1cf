#!/usr/bin/env bash
# Prepares the one GPU experiment of issue #44 (benchmarks/gpu/backbone_adaptation.py) to travel to a lent GPU machine,
# which has torch, transformers, peft and scipy but no weights, no ../shared and no ir_measures, and takes at most
# 64 MiB a call: the cut SmolLM2 backbone in int8 parts, DL19/DL21 with RankVicuna's run, and the missing wheels, all
# in ignored folders (gpu_pack/, .whl/). Then prints the device calls to make, in order.
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
parts=$(ls -d gpu_pack/part* | sort)
last=$(echo "$parts" | tail -1)
install='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;'
echo
echo "sizes (MiB): $(cat gpu_pack/pack.json | tr -d '\n ')"
echo "Device calls, in order (each carries at most 64 MiB; the first parts stay on the machine while it is held):"
for p in $parts; do
  [ "$p" = "$last" ] && break
  echo "  run(carry=[\"$p\"], command=\"ls -la $p\", timeout_s=60)"
done
echo "  run(carry=[\"$last\", \"gpu_pack/meta\", \"gpu_pack/data\", \"gpu_pack/pack.json\", \".whl\"], timeout_s=600, command="
echo "      \"$install python3 benchmarks/gpu/pack.py unpack gpu_pack && PYTHONUNBUFFERED=1 python3 benchmarks/gpu/deepspeed_step.py --pack gpu_pack 2>&1 | tee \$OUT/deepspeed.txt; PYTHONUNBUFFERED=1 python3 benchmarks/gpu/backbone_adaptation.py --pack gpu_pack --out \$OUT --budget-s 420 2>&1 | tee \$OUT/log.txt\")"
echo "Make the second call within 30 s of the first (a warm machine keeps part1; a cold one starts bare). Then copy"
echo "\$OUT/backbone_adaptation.md and deepspeed.txt to reports/ (they name the GPU) and commit. Budget: ~2 min start,"
echo "<1 min a part, ~1 min to unpack, ~1 min the DeepSpeed step, the experiment capped at 420 s of folds + the"
echo "cross-year fit: about 12 of the 15 device minutes."
