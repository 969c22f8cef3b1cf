"""The teacher-rankings store (typed Parquet, one reader) and the rankings stage that fills it."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hllm.config import load_config
from hllm.data import store
from hllm.job.config import JobConfig
from hllm.job.stages import DegenerateTeacher, StudentFit, teacher_rankings_stage, train_student_stage
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

    def pending(source, directory):  # what a ranker does: skip what the store holds
        done = set(store.finished_ids(directory))
        return [s for b in source.batches(3) for s in b if s.slate_id not in done]

    def dies_after_one_shard(source, directory: Path):
        todo = pending(source, directory)
        calls.append([s.slate_id for s in todo])
        store.write_shard(ranked(todo[:4]), directory)
        raise RuntimeError("worker lost")

    with pytest.raises(RuntimeError, match="worker lost"):
        teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, dies_after_one_shard)

    def ranks_all(source, directory: Path):
        todo = pending(source, directory)
        calls.append([s.slate_id for s in todo])
        store.write_shard(ranked(todo), directory)

    out = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, ranks_all)
    assert calls[1] == [s.slate_id for s in slates[4:]]  # only what was missing
    assert [i.slate.slate_id for i in out.items] == [s.slate_id for s in slates]  # the split's order
    assert out.stats.resumed_from == 4 and out.stats.generated_now == 6 and out.counts.ok == 10
    again = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, ranks_all)
    assert len(calls) == 2 and again.stats.generated_now == 0  # complete: nothing ranked again


def test_the_split_is_checked_against_the_store_footers_alone(small_splits, tmp_path):
    from hllm.job.stages import ranking_summary

    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}"])
    slates = small_splits["train"][:6]
    source = store.SplitSlates.held("train", slates)
    folder = tmp_path / "slates"  # the same split as shards on disk, as the data stage leaves it
    folder.mkdir()
    pq.write_table(store.slates_table(slates[:4]), folder / "a.parquet")
    pq.write_table(store.slates_table(slates[4:]), folder / "b.parquet")
    on_disk = store.SplitSlates("train", 6, source.id_sum, folder=folder)
    assert [s for b in on_disk.batches(3) for s in b] == slates and store.head(folder, 2) == slates[:2]
    out = teacher_rankings_stage(cfg, cfg.teacher.model, "train", on_disk, 
                                 lambda src, d: {"wrote": store.write_shard(ranked(src.load()), d, ranking_summary(ranked(src.load()))).name})
    assert out.stats.ranker["wrote"].startswith("part-") and out.stats.to_json()["wrote"] == out.stats.ranker["wrote"]  # what the ranker returns is kept with the stats
    assert out.stats.slates == 6 and out.stats.counts.ok == 6 and out.stats.rankings == 6
    assert sorted(i.slate.slate_id for i in out.items) == sorted(s.slate_id for s in slates)  # read when asked, by id
    ix = store.index(out.directory)  # from the footer alone
    assert (ix.slates, ix.id_sum) == (6, source.id_sum) and ix.summary["output_tokens"] == 6 * 12
    # one slate written twice and another missing: the count agrees, the id sum does not
    store.write_shard(ranked([slates[0]]), tmp_path / "twice")
    store.write_shard(ranked([slates[0], slates[1]]), tmp_path / "twice")
    assert store.index(tmp_path / "twice").slates == 3
    swapped = store.SplitSlates("train", 3, store.id_sum(s.slate_id for s in slates[:3]), slates[:3])
    cfg2 = load_config(JobConfig, None, [f"output_dir={tmp_path / 'b'}"])
    with pytest.raises(RuntimeError, match="rows of other slates"):
        teacher_rankings_stage(cfg2, cfg2.teacher.model, "train", swapped,
                               lambda src, d: [store.write_shard(ranked([slates[0]]), d),
                                               store.write_shard(ranked([slates[0], slates[1]]), d)])


def test_a_footer_summary_adds_up_and_old_shards_are_summarised_from_their_rows(small_splits, tmp_path):
    from hllm.job.stages import ranking_summary

    items = ranked(small_splits["train"][:5])
    store.write_shard(items[:2], tmp_path, ranking_summary(items[:2]))
    pq.write_table(store.to_table(items[2:]), tmp_path / store.shard_name([i.slate.slate_id for i in items[2:]]))  # no footer
    ix = store.index(tmp_path, ranking_summary)
    whole = {**ranking_summary(items), **store.base_summary(items)}
    tau = ix.summary.pop("tau_to_input_sum")
    assert tau == pytest.approx(whole.pop("tau_to_input_sum")) and ix.shards == 2 and ix.summary == whole


def test_a_split_with_a_missing_slate_is_an_error(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="1 slates missing"):
        teacher_rankings_stage(cfg, cfg.teacher.model, "train", small_splits["train"][:3],
                               lambda source, d: store.write_shard(ranked(source.slates[:2]), d))


def copies_input(slates, directory: Path, copied: int):
    """Writes rankings where the first `copied` slates keep the input order, the rest reversed."""
    items = ranked(slates)
    for i in items[:copied]:
        i.ranking.permutation = list(range(len(i.slate.candidates)))
    store.write_shard(items, directory)


def test_a_teacher_that_copies_its_input_is_stopped_before_distillation(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}"])
    slates = small_splits["train"][:10]
    train = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, lambda src, d: copies_input(src.slates, d, 8))
    assert train.stats.same_as_input == pytest.approx(0.8)
    assert train.stats.tau_to_input == pytest.approx(0.8 * 1.0 + 0.2 * -1.0)
    fitted = []
    fit = lambda rcfg, tr, va, out: fitted.append(out) or StudentFit(steps=0, seconds=0.0, final_loss=0.0)
    with pytest.raises(DegenerateTeacher, match=r"80.0% of its answers repeat the input .*max_teacher_same_as_input 0.5"):
        train_student_stage(cfg, cfg.teacher.model, train, train, fit)
    assert not fitted  # stopped before any training
    relaxed = load_config(JobConfig, None, [f"output_dir={tmp_path}", "student.max_teacher_same_as_input=0.9"])
    train_student_stage(relaxed, relaxed.teacher.model, train, train, fit)
    assert len(fitted) == 1


def test_the_tau_threshold_catches_a_teacher_that_only_nudges_the_input(small_splits, tmp_path):
    cfg = load_config(JobConfig, None, [f"output_dir={tmp_path}", "student.max_teacher_tau_to_input=0.5"])
    slates = small_splits["train"][:4]

    def swaps_last_two(source, directory):
        items = ranked(source.slates)
        for i in items:
            n = len(i.slate.candidates)
            i.ranking.permutation = list(range(n - 2)) + [n - 1, n - 2]
        store.write_shard(items, directory)

    train = teacher_rankings_stage(cfg, cfg.teacher.model, "train", slates, swaps_last_two)
    assert train.stats.same_as_input == 0.0 and train.stats.tau_to_input > 0.9
    with pytest.raises(DegenerateTeacher, match="Kendall tau to the input order 0.9"):
        train_student_stage(cfg, cfg.teacher.model, train, train, lambda *a: StudentFit(steps=0, seconds=0.0, final_loss=0.0))
