"""The teacher-rankings store (typed Parquet, one reader) and the rankings stage that fills it."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hllm.config import load_config
from hllm.data import store
from hllm.recipes.job import JobConfig
from hllm.recipes.stages import DegenerateTeacher, teacher_rankings_stage, train_student_stage
from hllm.records import ParseCounts, RankedSlate, TeacherRanking


def ranked(slates):
    return [RankedSlate(s, TeacherRanking(s.slate_id, list(range(len(s.candidates)))[::-1], "[2] > [1]",
                                          ParseCounts(total=1, ok=1), 40, 12, 0.5, [[0, 4]], "node-a")) for s in slates]


def test_round_trip_keeps_every_field_in_nested_columns(small_splits, tmp_path):
    items = ranked(small_splits["train"][:6])
    items[0].slate.extra_qrels = {"judged-outside": 2}
    items[1].ranking.permutation = None  # unparseable, not repaired
    store.write_shard(items[:4], tmp_path)
    store.write_shard(items[4:], tmp_path)
    assert store.read_rankings(tmp_path) == sorted(items, key=lambda i: i.slate.slate_id)
    assert sorted(store.finished_ids(tmp_path)) == sorted(i.slate.slate_id for i in items)
    schema = pq.read_schema(store.shards(tmp_path)[0])
    assert schema.field("slate").type.field("candidates").type.value_type.field("text").type == pa.string()
    assert schema.field("ranking").type.field("counts").type.field("ok").type == pa.int64()
    assert not any(f.type == pa.string() and f.name in ("slate", "ranking") for f in schema)  # no JSON in a column


def test_shards_are_written_atomically_and_named_by_their_slates(small_splits, tmp_path):
    items = ranked(small_splits["train"][:3])
    path = store.write_shard(items, tmp_path)
    assert path.name == store.shard_name([i.slate.slate_id for i in reversed(items)])  # order-free
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temp file was renamed away


def test_the_rankings_stage_resumes_where_it_stopped(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}"])
    slates = small_splits["train"][:10]
    calls: list[list[str]] = []

    def dies_after_one_shard(pending, directory: Path):
        calls.append([s.slate_id for s in pending])
        store.write_shard(ranked(pending[:4]), directory)
        raise RuntimeError("worker lost")

    with pytest.raises(RuntimeError, match="worker lost"):
        teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, dies_after_one_shard)

    def ranks_all(pending, directory: Path):
        calls.append([s.slate_id for s in pending])
        store.write_shard(ranked(pending), directory)

    out = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, ranks_all)
    assert calls[1] == [s.slate_id for s in slates[4:]]  # only what was missing
    assert [i.slate.slate_id for i in out.items] == [s.slate_id for s in slates]  # the split's order
    assert out.stats["resumed_from"] == 4 and out.stats["generated_now"] == 6 and out.counts.ok == 10
    again = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, ranks_all)
    assert len(calls) == 2 and again.stats["generated_now"] == 0  # complete: nothing ranked again


def test_a_split_with_a_missing_slate_is_an_error(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="1 slates missing"):
        teacher_rankings_stage(cfg, cfg.teacher.model, "train", small_splits["train"][:3],
                               lambda pending, d: store.write_shard(ranked(pending[:2]), d))


def copies_input(slates, directory: Path, copied: int):
    """Writes rankings where the first `copied` slates keep the input order, the rest reversed."""
    items = ranked(slates)
    for i in items[:copied]:
        i.ranking.permutation = list(range(len(i.slate.candidates)))
    store.write_shard(items, directory)


def test_a_teacher_that_copies_its_input_is_stopped_before_distillation(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}"])
    slates = small_splits["train"][:10]
    train = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, lambda p, d: copies_input(p, d, 8))
    assert train.stats["same_as_input"] == pytest.approx(0.8)
    assert train.stats["tau_to_input"] == pytest.approx(0.8 * 1.0 + 0.2 * -1.0)
    fitted = []
    fit = lambda rcfg, tr, va, out: fitted.append(out) or {"steps": 0}
    with pytest.raises(DegenerateTeacher, match=r"80.0% of its answers repeat the input .*max_teacher_same_as_input 0.5"):
        train_student_stage(cfg, cfg.teacher.model, train, train, fit)
    assert not fitted  # stopped before any training
    relaxed = load_config(JobConfig, None, [f"output_dir={tmp_path}", "student.max_teacher_same_as_input=0.9"])
    train_student_stage(relaxed, relaxed.teacher.model, train, train, fit)
    assert len(fitted) == 1


def test_the_tau_threshold_catches_a_teacher_that_only_nudges_the_input(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}", "student.max_teacher_tau_to_input=0.5"])
    slates = small_splits["train"][:4]

    def swaps_last_two(pending, directory):
        items = ranked(pending)
        for i in items:
            n = len(i.slate.candidates)
            i.ranking.permutation = list(range(n - 2)) + [n - 1, n - 2]
        store.write_shard(items, directory)

    train = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, swaps_last_two)
    assert train.stats["same_as_input"] == 0.0 and train.stats["tau_to_input"] > 0.9
    with pytest.raises(DegenerateTeacher, match="Kendall tau to the input order 0.9"):
        train_student_stage(cfg, cfg.teacher.model, train, train, lambda *a: {"steps": 0})
