"""Helper for test_multinode.py, run in its own process: a head node and a worker node on this
machine (separate raylets, separate resources), then the data stage, teacher generation and
distillation with `cluster.spread=true`. Writes, as JSON, the Ray nodes that made slates, ranked
them and trained."""

import json
import sys
from pathlib import Path

from ray.cluster_utils import Cluster

from hllm.config import load_config
from hllm.job.config import student_ranker_config
from pipelines import data, teacher_gen, train_student
from pipelines.common import PipelineConfig


def main(out: str, overrides: list[str]) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    cluster.add_node(num_cpus=2, resources={"worker": 1})
    cluster.wait_for_nodes()
    try:
        cfg = load_config(PipelineConfig, None, overrides + [f"output_dir={out}", f"cluster.address={cluster.address}",
                                                             "cluster.spread=true"])
        teacher_model, rankings = teacher_gen.run(cfg, splits=("train", "val"))
        result = train_student.train(cfg, student_ranker_config(cfg, teacher_model), rankings["train"].directory,
                               rankings["val"].directory)
        with result.checkpoint.as_directory() as d:
            train_nodes = sorted({p.read_text() for p in Path(d).glob("node.rank*")})
        import ray
        result_doc = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
                      "data_nodes": sorted(data.run(cfg).stats.tasks_by_node["slates"]),  # reused: its record
                      "teacher_nodes": sorted(rankings["train"].stats.nodes),  # from the store's footers
                      "train_nodes": train_nodes, "steps": result.metrics["step"]}
        # To a file, not stdout: Ray workers' log lines reach this process's stdout in any order.
        (Path(out) / "result.json").write_text(json.dumps(result_doc))
    finally:
        import ray

        ray.shutdown()  # disconnect the driver before removing the nodes
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
