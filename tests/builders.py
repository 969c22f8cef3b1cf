"""What tests in several folders build the same way: a tiny BEIR folder, the one-process and Ray jobs' tiny overrides,
a traffic record. (Fixtures live in conftest.py; this module holds plain functions and constants.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hllm.data.traffic import TrafficRecord

WORDS = ["acme", "zenith", "kairo", "red", "blue", "green", "leather", "cotton", "wool", "boots", "shirt", "backpack"]

# the single-process job (hllm.recipes.local_job) at a size that runs in seconds
ONE_PROCESS_JOB = [
    "data.synthetic.catalogue_size=300", "data.synthetic.slate_size=6", "data.synthetic.train_slates=16",
    "data.synthetic.val_slates=2", "data.synthetic.test_slates=6",
    "teacher.model.hidden_size=32", "teacher.model.layers=1", "teacher.model.heads=2",
    "teacher.model.intermediate_size=64", "teacher.model.context_length=256",
    "teacher.bootstrap_cfg.train.steps=3", "teacher.bootstrap_cfg.train.batch_size=4",
    "student.head.positions=6", "student.head.width=32", "student.adapt.lora_r=2",
    "student.train.steps=3", "student.train.batch_size=4", "eval.latency_requests=2", "eval.latency_warmup=1",
    # a teacher of a few steps (or none) copies its input: the gates that stop that (tests/hllm/data/test_store.py) are off
    "student.max_teacher_same_as_input=1.0", "student.max_teacher_tau_to_input=1.0",
]

# the Ray job (pipelines/) at a size that runs in a minute on 2 cores
PIPELINE_JOB = [
    "data.synthetic.catalogue_size=300", "data.synthetic.slate_size=6", "data.synthetic.train_slates=32",
    "data.synthetic.val_slates=2", "data.synthetic.test_slates=6",
    "teacher.bootstrap=false", "teacher.model.hidden_size=32", "teacher.model.layers=1", "teacher.model.heads=2",
    "teacher.model.intermediate_size=64", "teacher.model.context_length=256",
    "teacher.generation.constrained=true", "teacher.generation.batch_size=8",
    "cluster.teacher_actors=1", "cluster.teacher_cpus_per_actor=0.5", "cluster.teacher_batch_slates=8",
    "cluster.train_workers=2", "cluster.train_cpus_per_worker=1",
    "student.head.positions=6", "student.head.width=32", "student.adapt.lora_r=2",
    "student.train.batch_size=4", "student.train.warmup_steps=1",
    "eval.latency_requests=2", "eval.latency_warmup=1", "distill.zero_stage=2",
    # a teacher of a few steps (or none) copies its input: the gates that stop that (tests/hllm/data/test_store.py) are off
    "student.max_teacher_same_as_input=1.0", "student.max_teacher_tau_to_input=1.0",
]

# the session's finished tiny job (conftest.tiny_job): test_pipeline_train_student checks it, the flywheel refreshes a copy
PIPELINE_TINY_JOB = PIPELINE_JOB + ["student.train.steps=4", "distill.checkpoint_every=2", "cluster.teacher_batch_slates=4",
                                   "eval.batch_slates=3"]


def beir_folder(root: Path, queries: int = 3, docs: int = 10, judged_extra: str | None = None) -> Path:
    """A tiny BEIR folder: `queries` queries with `docs` candidates each in the run."""
    (root / "qrels").mkdir(parents=True)
    (root / "runs").mkdir()
    with open(root / "corpus.jsonl", "w") as fh:
        for d in range(queries * docs):
            text = " ".join(WORDS[(d * k) % len(WORDS)] for k in (1, 3, 5))
            fh.write(json.dumps({"_id": f"d{d}", "title": "", "text": text}) + "\n")
    qids = [f"q{q}" for q in range(queries)] + ([judged_extra] if judged_extra else [])
    with open(root / "queries.jsonl", "w") as fh:
        for q, qid in enumerate(qids):
            fh.write(json.dumps({"_id": qid, "text": f"{WORDS[q]} {WORDS[q + 3]} boots"}) + "\n")
    qrels = ["query-id\tcorpus-id\tscore"] + [f"q{q}\td{q * docs + d}\t{(d * 7 + q) % 4}" for q in range(queries)
                                             for d in range(docs)]
    if judged_extra:
        qrels.append(f"{judged_extra}\td0\t3")
    (root / "qrels" / "test.tsv").write_text("\n".join(qrels) + "\n")
    run = ["query-id\tcorpus-id\trank\tscore"] + [f"q{q}\td{q * docs + d}\t{d + 1}\t{100 - d}" for q in range(queries)
                                                 for d in range(docs)]
    (root / "runs" / "bm25_top100.tsv").write_text("\n".join(run) + "\n")
    return root


def traffic_record(i: int, key: str = "k1", docs=None, order=None, warnings=()) -> TrafficRecord:
    """A served request as the traffic log keeps it."""
    docs = docs or [f"doc {i} a", f"doc {i} b", f"doc {i} c"]
    return TrafficRecord(f"r{i}", time.time(), "models:/m/1", key, f"query {i}", docs, order or [2, 0, 1],
                         [0.9, 0.5, 0.1], len(docs), 12.5, 0.0, list(warnings))
