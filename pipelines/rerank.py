"""`hllm rerank --ray`: the collection's query shards fanned out over a Ray Data actor pool.

    hllm rerank --model runs/default/student --data DIR --out run.trec --ray --actors 4

The same mechanism as teacher generation (`pipelines/teacher_gen.py`): each actor loads the ranker
once (`hllm.job.collection.ShardRanker`, a GPU each where the cluster has them) and, per shard, ranks
it and writes it atomically (`hllm.eval.runfile.ShardWriter.write`); the driver joins the shards. On a
multi-node cluster the run file's folder must be storage every node sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from hllm.data import store
from hllm.eval.runfile import ShardedRun, ShardWriter
from hllm.job.collection import MapShards, RerankSpec, ShardRanker, answers_folder
from hllm.records import RerankRequest


class RerankActor:
    """Loads the ranker once; ranks and writes one shard per batch."""

    def __init__(self, spec: dict[str, Any], writer: ShardWriter, use_gpu: bool, queries: int, answers: str, workers: int):
        spec = RerankSpec(**{**spec, "device": "cuda" if use_gpu else "cpu", "threads": spec.get("threads") or 1})
        self.ranker, self.writer, self.tag = ShardRanker(spec, queries, answers, workers), writer, spec.tag

    def __call__(self, batch: pa.Table) -> dict[str, list]:
        shard = store.slates_from_rows(batch.to_pylist())
        orders, stats, notes = self.ranker(shard)
        self.writer.write(shard, orders, self.tag, stats, notes)
        return {"queries": [len(shard)]}


def ray_map_shards(actors: int, cpus_per_actor: float = 1.0, address: str | None = None) -> MapShards:
    def map_shards(spec: RerankSpec, run: ShardedRun, todo: list[list[RerankRequest]],
                   progress: Callable[[int], None]) -> None:
        import ray

        from pipelines.common import ClusterConfig, cluster_has_gpus, init_ray, wait_for_actors

        if not todo:
            return
        cluster = ClusterConfig(address=address)
        init_ray(cluster)
        gpu = cluster_has_gpus(cluster) and spec.teacher_url is None  # a served teacher needs no GPU here
        ds = ray.data.from_arrow([store.slates_table(shard) for shard in todo])  # a block per shard
        wait_for_actors(ds, cluster)
        size = min(actors, len(todo))
        done = ds.map_batches(
            RerankActor, fn_constructor_kwargs={"spec": dataclasses.asdict(spec), "writer": run.writer, "use_gpu": gpu,
                                                "queries": sum(map(len, run.shards)), "answers": str(answers_folder(run.out)),
                                                "workers": size},
            batch_size=None, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=size),
            num_gpus=1 if gpu else 0, num_cpus=cpus_per_actor)
        for row in done.iter_rows():
            progress(int(row["queries"]))
    return map_shards
