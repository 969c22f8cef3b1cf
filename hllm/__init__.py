"""hLLM: single-pass generative reranking.

    from hllm import Reranker
    Reranker.load("runs/default/student").rank("red leather boots", ["acme red leather boots", "blue shirt"])

The public API is `Reranker`, its result `RankedDocument` (with `Assessed`: a query's ranking with how sure the
single pass was, `Reranker.rank_assessed`), and `PromptTooLong` (raised when the documents cannot fit the model's
context). They are imported on first use, so `import hllm.config`
stays light.
"""

__all__ = ["Assessed", "PromptTooLong", "RankedDocument", "Reranker"]


def __getattr__(name: str):
    if name in __all__:
        from hllm import reranker

        return getattr(reranker, name)
    raise AttributeError(f"module 'hllm' has no attribute {name!r}")
