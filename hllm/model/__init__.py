"""The model: backbones, prompts, item states, the N x K head, decoders (Hungarian), the single-pass ranker, windows
and calibration. Imports `hllm.data` and below."""
