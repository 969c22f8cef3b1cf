"""The autoregressive teacher: generation, parsing of its answers (with validity counts) and the first-stage and
one-token baselines. Imports `hllm.model` and below."""
