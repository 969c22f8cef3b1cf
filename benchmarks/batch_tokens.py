"""Peak memory of one scoring call with and without `max_batch_tokens`: the shipped `smollm2-trec-dl` on
the first 16 DL19 queries' BM25 top 20 (~1,360-token prompts), all 16 handed to one `score_encoded`.

    python benchmarks/batch_tokens.py none        # one forward pass of 16 prompts
    python benchmarks/batch_tokens.py 4096        # passes of at most 4,096 padded tokens

Run each cap in its own process: ru_maxrss is the process's peak, so the line gives the peak before the
call (the model loaded) and after it. Needs ../shared/data and the SmolLM2 wheel (scripts/setup.sh).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hllm import Reranker  # noqa: E402
from hllm.data.readers import read_beir  # noqa: E402


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    cap = None if len(sys.argv) < 2 or sys.argv[1] == "none" else int(sys.argv[1])
    reranker = Reranker.load("smollm2-trec-dl", max_batch_tokens=cap)
    slates = read_beir(ROOT.parent / "shared" / "data" / "trec-dl19-passage-bm25top100", top_n=20)[:16]
    prompts = [reranker.encode(s.query.text, [c.text for c in s.candidates]) for s in slates]
    before, t0 = peak_mb(), time.perf_counter()
    reranker.score_encoded(prompts)
    print(f"max_batch_tokens={cap} prompts={len(prompts)} tokens/prompt~{sum(len(p.input_ids) for p in prompts) // len(prompts)} "
          f"peak RSS before the call {before:.0f} MB, after {peak_mb():.0f} MB, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
