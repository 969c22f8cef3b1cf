"""The pyfunc that `pipelines.registry.log_student` logs (MLflow "models from code": no pickle).

A DataFrame of (query, documents) rows -> each row's ranking (document indices, best first) and
scores; `params={"top_n": k}` keeps the best k.
"""

from __future__ import annotations

from typing import Any

import mlflow
import pandas as pd


class RerankerModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from hllm import Reranker

        self.reranker = Reranker.load(context.artifacts["student"], device="auto")

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        top_n = int((params or {}).get("top_n") or 0) or None
        ranked = self.reranker.rank_batch(list(model_input["query"]), [list(d) for d in model_input["documents"]],
                                          top_k=top_n)
        return pd.DataFrame({"ranking": [[r.index for r in rs] for rs in ranked],
                             "scores": [[r.score for r in rs] for rs in ranked]})


mlflow.models.set_model(RerankerModel())
