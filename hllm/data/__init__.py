"""Data: readers (BEIR, rank_llm, hLLM JSONL), the embedded generator, splits, the rankings store, the traffic log
and the stage cache. Imports only `hllm.config` and `hllm.records`."""
