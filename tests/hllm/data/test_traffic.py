"""The traffic log (hllm.data.traffic) and the flywheel's library steps (hllm.job.refresh), without Ray."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hllm.job.refresh import (NothingToRefresh, RefreshConfig, gate, pseudo_grades, refuse_foreign, replay_mix,
                                   reused_rankings, select_slates, side_by_side)
from hllm.records import ParseCounts, RankedSlate, TeacherRanking
from hllm.data.traffic import (SCHEMA, TrafficLog, TrafficLogConfig, TrafficRecord, clean_rows, log_files, read_log, row_status,
                               scan)

from builders import traffic_record as record

ROOT = Path(__file__).resolve().parents[3]


def test_flushed_by_size_and_by_time_one_closed_file_each(tmp_path):
    log = TrafficLog(TrafficLogConfig(str(tmp_path), flush_records=4, flush_seconds=0.4), writer="w")
    for i in range(4):
        log.append(record(i))
    deadline = time.time() + 5
    while not log_files(tmp_path) and time.time() < deadline:
        time.sleep(0.05)
    assert len(log_files(tmp_path)) == 1  # the size flush, without waiting for the time
    log.append(record(4))
    time.sleep(1.5)  # the time flush
    files = log_files(tmp_path)
    assert len(files) == 2 and all(f.parent.name.startswith("date=") for f in files)
    rows = read_log(files)
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2", "r3", "r4"]
    assert rows[0]["order"] == [2, 0, 1] and rows[0]["documents"] == ["doc 0 a", "doc 0 b", "doc 0 c"]
    log.close()
    assert log.stats["written"] == 5 and log.stats["write_errors"] == 0


def test_documents_are_cut_off_the_request_path_and_retention_deletes_the_oldest(tmp_path):
    cut_calls = []

    def cut(docs):
        cut_calls.append(len(docs))
        return [d[:5] for d in docs]

    log = TrafficLog(TrafficLogConfig(str(tmp_path), flush_records=1000, flush_seconds=60, retention_bytes=None), cut=cut)
    log.append(record(0, docs=["a long document", "another long one"], order=[0, 1]))
    assert cut_calls == []  # append does not cut
    log.flush()
    assert read_log(log_files(tmp_path))[0]["documents"] == ["a lon", "anoth"]
    for i in range(3):
        log.append(record(i))
        log.flush()
    size = sum(p.stat().st_size for p in log_files(tmp_path))
    log.cfg.retention_bytes = size // 2
    deleted = log.enforce_retention()
    kept = log_files(tmp_path)
    assert deleted >= 2 and sum(p.stat().st_size for p in kept) <= size // 2
    assert read_log(kept)[-1]["request_id"] == "r2"  # the newest survive
    log.close()


def test_a_failed_write_keeps_the_records_and_counts_it(tmp_path, monkeypatch):
    log = TrafficLog(TrafficLogConfig(str(tmp_path), flush_records=100, flush_seconds=60, max_buffer=100))
    log.append(record(0))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(pq, "write_table", full_disk)
        assert log.flush() is None and log.stats["write_errors"] == 1
        for i in range(1, 120):
            log.append(record(i))
        assert log.flush() is None and log.stats["dropped"] == 20  # past max_buffer: the oldest go, counted
    assert log.flush() is not None and log.stats["written"] == 100  # kept, written at the next flush
    assert read_log(log_files(tmp_path))[0]["request_id"] == "r20"
    log.close()


def test_sigkill_loses_at_most_the_unflushed_buffer(tmp_path):
    """A writer killed with SIGKILL mid-stream: every flushed file is whole, and what is lost is the
    unflushed buffer (and a batch being written at the time of the kill)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})
        from hllm.data.traffic import TrafficLog, TrafficLogConfig
        from builders import traffic_record as record
        log = TrafficLog(TrafficLogConfig({str(tmp_path)!r}, flush_records=50, flush_seconds=30))
        i = 0
        while True:
            log.append(record(i)); i += 1
            print(i, flush=True)
            time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    sent = 0
    for line in proc.stdout:
        sent = int(line)
        if sent >= 530:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sent += sum(1 for _ in proc.stdout)  # appended (and said so) before the kill
    assert sent >= 530, f"the writer stopped after {sent} records (it must be killed mid-stream)"
    found = scan(tmp_path)
    assert found.skipped == []  # no half-written file (a temp file may remain: readers never list it)
    lost = sent - found.rows
    print(f"SIGKILL after {sent} records: {found.rows} on disk, {lost} lost (flush_records 50)")
    # lost: the buffer (< flush_records) plus, when the kill lands during a write, the batch being written
    assert 0 <= lost < 2 * 50, (sent, found.rows)


def test_corrupt_truncated_and_foreign_files_are_skipped_and_counted(tmp_path):
    log = TrafficLog(TrafficLogConfig(str(tmp_path), flush_records=100, flush_seconds=60))
    for i in range(3):
        log.append(record(i))
    good = log.flush()
    log.close()
    truncated = good.with_name("part-0000000000001-x-000001.parquet")
    truncated.write_bytes(good.read_bytes()[:-40])
    (good.parent / "part-0000000000002-x-000002.parquet").write_text("not parquet at all")
    pq.write_table(pq.read_table(good).drop_columns(["order"]), good.parent / "part-0000000000003-x-000003.parquet")
    found = scan(tmp_path)
    assert found.files == [good] and len(found.skipped) == 3
    assert {why.split(":")[0] for _, why in found.skipped} == {"unreadable", "not a traffic log file"}
    assert found.rows == 3
    with pytest.raises(FileNotFoundError, match="no traffic log"):
        scan(tmp_path / "missing")


def test_rows_are_classified_deduplicated_sampled_and_split():
    rows = [vars(record(i)) for i in range(40)]
    rows += [vars(record(0))]  # a duplicate request
    rows += [vars(record(100, key="other"))]  # another model's prompt or vocabulary
    rows += [vars(record(101, warnings=["unknown words"]))]
    rows += [vars(record(102, order=[0, 0, 1]))]  # a repeat
    rows += [vars(record(103, order=[2]))]  # top_n = 1 asked: the order returned is the best one
    kept, counts = clean_rows(rows, "k1")
    assert counts == {"rows": 45, "ok": 42, "other_model": 1, "warned": 1, "malformed": 1, "sampled_out": 0}
    sel = select_slates(kept, counts, RefreshConfig(max_slates=30, min_slates=5, traffic_test_fraction=0.3))
    assert sel.counts["duplicates"] == 1 and sel.counts["over_max_slates"] == 11 and len(sel.train) + len(sel.test) == 30
    assert 3 <= len(sel.test) <= 18 and not {s.slate_id for s in sel.train} & {s.slate_id for s in sel.test}
    again = select_slates(list(reversed(kept)), counts, RefreshConfig(max_slates=30, min_slates=5, traffic_test_fraction=0.3))
    assert again.cycle == sel.cycle  # order of the log does not matter
    half = clean_rows(rows, "k1", share=0.5)[1]
    assert 10 < half["ok"] < 32 and half["ok"] + half["sampled_out"] == 42
    assert row_status(rows[0], "k1", 0.5) == row_status(rows[40], "k1", 0.5)  # duplicates sample alike
    with pytest.raises(NothingToRefresh, match="usable distinct requests"):
        select_slates(kept[:3], counts, RefreshConfig(min_slates=5))


def test_an_empty_or_foreign_log_is_refused_with_a_message():
    with pytest.raises(NothingToRefresh, match="no records"):
        refuse_foreign({"rows": 0, "other_model": 0, "files_skipped": 2}, set(), "k1", "/logs")
    with pytest.raises(NothingToRefresh, match="another prompt or vocabulary"):
        refuse_foreign({"rows": 5, "other_model": 5}, {"k9"}, "k1", "/logs")
    refuse_foreign({"rows": 5, "other_model": 4}, {"k9", "k1"}, "k1", "/logs")  # some rows are the champion's: fine


def _ranked(i: int, perm: list[int], grades=None) -> RankedSlate:
    r = record(i)
    from hllm.data.traffic import request_key, to_slate

    slate = to_slate({**vars(r), "key": request_key(r.query, r.documents)})
    if grades:
        slate.grades = grades
    return RankedSlate(slate, TeacherRanking(slate.slate_id, perm, "", ParseCounts()))


def test_pseudo_labels_side_by_side_and_the_gate():
    assert pseudo_grades([2, 0, 1]) == [2, 2, 3]
    assert pseudo_grades(list(range(9))) == [3, 2, 2, 1, 1, 1, 1, 0, 0]
    original = [_ranked(0, [0, 1, 2], grades=[3, 0, 0]), _ranked(1, [1, 0, 2], grades=[0, 2, 0])]
    traffic = [_ranked(2, [2, 1, 0]), _ranked(3, [0, 2, 1])]
    perms = {"same_as_teacher": [[0, 1, 2], [1, 0, 2], [2, 1, 0], [0, 2, 1]],
             "reversed": [[2, 1, 0], [2, 0, 1], [0, 1, 2], [1, 2, 0]]}
    figures = side_by_side(perms, original, traffic)
    best, worst = figures["same_as_teacher"], figures["reversed"]
    assert best["original.nDCG@10"] == 1.0 and best["traffic.kendall_tau"] == 1.0 and best["traffic.nDCG@10_vs_teacher"] == 1.0
    assert worst["traffic.kendall_tau"] == -1.0 and worst["traffic.nDCG@10_vs_teacher"] < 1.0 and "traffic.nDCG@10" not in worst
    cfg = RefreshConfig(tolerance=0.01, min_gain=0.0)
    assert gate(worst, best, cfg).promote
    refused = gate(best, worst, cfg)
    assert not refused.promote and "worse than the tolerance" in refused.text() and "no gain" in refused.text()
    assert not gate(best, best, cfg).promote  # equal is no gain


def test_replay_mix_holds_the_share():
    new = [_ranked(i, [0, 1, 2]) for i in range(30)]
    old = [_ranked(100 + i, [0, 1, 2]) for i in range(100)]
    mix = replay_mix(new, old, 0.5, seed=0)
    assert len(mix) == 60 and mix[:30] == new
    assert len(replay_mix(new, old[:5], 0.5, seed=0)) == 35 and replay_mix(new, old, 0.0, 0) == new


def test_the_served_teachers_rankings_in_the_log_are_reused_as_labels():
    """Escalated requests carry the served teacher's ranking (teacher_order): the refresh keeps that row of a repeated
    request and labels its slate with it instead of asking the job's teacher again (and only a whole permutation)."""
    rows = [vars(record(i)) for i in range(12)]
    escalated = vars(record(3))
    escalated["teacher_order"], escalated["time"] = [1, 2, 0], rows[3]["time"] + 5  # later, but carries a label
    rows.append(escalated)
    partial = vars(record(4))
    partial["teacher_order"] = [1]  # not a whole permutation: not a label
    rows.append(partial)
    kept, counts = clean_rows(rows, "k1")
    sel = select_slates(kept, counts, RefreshConfig(max_slates=30, min_slates=5, traffic_test_fraction=0.3))
    assert sel.counts["duplicates"] == 2 and sel.counts["teacher_labelled"] == 1
    (slate_id, order), = sel.teacher_orders.items()
    assert order == [1, 2, 0]
    slates = sel.train + sel.test
    reused = reused_rankings(slates, sel.teacher_orders)
    assert [(r.slate.slate_id, r.ranking.permutation, r.ranking.counts.ok) for r in reused] == [(slate_id, [1, 2, 0], 1)]
    off = select_slates(kept, counts, RefreshConfig(max_slates=30, min_slates=5, traffic_test_fraction=0.3,
                                                    reuse_teacher_orders=False))
    assert off.teacher_orders == {} and off.cycle == sel.cycle
    with pytest.raises(ValueError, match="champion's own alias"):
        RefreshConfig(rollout_alias="champion")
    assert RefreshConfig(rollout_alias="challenger").rollout_alias == "challenger"


def test_schema_matches_the_record():
    assert SCHEMA.names == list(TrafficRecord.__dataclass_fields__)


def test_a_log_written_before_the_cascade_columns_reads_with_their_defaults(tmp_path):
    log = TrafficLog(TrafficLogConfig(str(tmp_path), flush_records=100, flush_seconds=60))
    escalated = record(1)
    escalated.answered_by, escalated.teacher_order = "teacher", [2, 0, 1]
    log.append(record(0))
    log.append(escalated)
    new = log.flush()
    log.close()
    old = new.with_name("part-0000000000001-x-000001.parquet")  # as an earlier version wrote it
    pq.write_table(pq.read_table(new).drop_columns(["answered_by", "teacher_order", "arm", "shadow_model", "shadow_order",
                                                    "shadow_kendall_tau", "shadow_top10_overlap", "shadow_latency_ms",
                                                    "shadow_error"]), old)
    found = scan(tmp_path)
    assert sorted(found.files) == sorted([new, old]) and not found.skipped
    rows = {(p.name, r["request_id"]): r for p in found.files for r in read_log([p])}
    assert rows[new.name, "r1"]["answered_by"] == "teacher" and rows[new.name, "r1"]["teacher_order"] == [2, 0, 1]
    assert rows[new.name, "r0"]["answered_by"] == "student" and rows[new.name, "r0"]["teacher_order"] == []
    assert rows[old.name, "r1"]["answered_by"] == "student" and list(rows[old.name, "r1"]["teacher_order"]) == []


def test_the_champion_must_be_a_registry_alias():
    for wrong in ("runs/default/student", "models:/hllm-student/3", "models:/@champion"):
        with pytest.raises(ValueError, match="models:/NAME@ALIAS"):
            RefreshConfig(champion=wrong)
