"""Training: losses (Sinkhorn cross-entropy, ...), the one loop, closed-form head fits and the cached-state trainer.
Imports `hllm.eval`, `hllm.reranker` and below."""
