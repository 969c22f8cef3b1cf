"""Recipes: the jobs that run the library end to end (the single-process workflow, real text, ablations, the
flywheel, collection reranking, the cascade, the rollout's decisions). Leaves: they import every layer; nothing in
`hllm` imports them."""
