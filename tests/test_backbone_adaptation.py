"""Issue #44's one GPU command, kept alive on the CPU: the same script end to end at a tiny size (a backbone built
from config, DL19's first-stage top 8, two teacher-folds, three steps a student), its report's lines asserted; and
the backbone packing that carries SmolLM2 to the GPU machine round-trips."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import backbone_adaptation  # noqa: E402
import pack  # noqa: E402


@pytest.mark.slow
@pytest.mark.data
def test_the_gpu_experiment_runs_end_to_end_at_a_tiny_size(shared_data, tmp_path):
    backbone_adaptation.main(["--tiny", "--data", str(shared_data / "trec-dl19-passage-bm25top100"),
                              "--out", str(tmp_path)])
    text = (tmp_path / "backbone_adaptation.md").read_text()
    assert "share kept, lora: " in text and "share kept, frozen probe: " in text
    report = json.loads((tmp_path / "backbone_adaptation.json").read_text())
    assert report["folds_run"] == report["folds"] == 2 and report["queries"] == 43 and report["device"] == "cpu"
    assert set(report["students"]) == set(backbone_adaptation.STUDENTS)
    for student in report["students"].values():
        assert 0.0 <= student["nDCG@10"] <= 1.0 and -1.0 <= student["tau_to_teacher"] <= 1.0
        assert len(student["per_query"]) == 43
    assert 0.0 < report["first_stage"] < report["teacher"] < 1.0  # BM25 top 8 vs RankVicuna's order of them


def test_sub_slates_keep_first_stage_order_and_the_teachers_relative_order():
    import random

    from hllm.records import Candidate, Query, RerankRequest

    slate = RerankRequest(Query("q", "t"), [Candidate(f"d{i}", f"text {i}") for i in range(10)], grades=list(range(10)))
    perm = [9, 3, 7, 0, 1, 2, 4, 5, 6, 8]
    for sub, order in backbone_adaptation.sub_slates(slate, perm, 4, random.Random(0)):
        ids = [int(c.docid[1:]) for c in sub.candidates]
        assert ids == sorted(ids) and len(ids) == 4 and sub.grades == ids
        assert [ids[i] for i in order] == [p for p in perm if p in ids]


def test_the_packed_backbone_round_trips_within_int8():
    t = torch.randn(64, 32)
    q = pack.quantize(t)
    assert q["int8"].dtype == torch.int8 and q["scale"].shape == (64, 1)
    back = pack.dequantize(q, torch.float32)
    assert (back - t).abs().max() <= t.abs().amax(dim=1, keepdim=True).max() / 127
    v = torch.randn(32)
    assert torch.allclose(pack.dequantize(pack.quantize(v), torch.float32), v, atol=1e-3)


@pytest.mark.slow
def test_the_deepspeed_step_saves_and_loads_its_checkpoint(tmp_path):
    """Item 4's path (the library loop stepping a ZeRO-2 DeepSpeed engine, checkpoint saved and loaded), on the CPU
    with gloo, in its own process (it starts a process group)."""
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "deepspeed_step.py"), "--steps", "2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "deepspeed zero-2 lora steps on cpu" in done.stdout
    assert "trainable tensors equal; one more step from it" in done.stdout
