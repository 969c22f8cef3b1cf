"""benchmarks/teacher_probe.py: the probes find relevance where it is, and the script runs on a job's run dir."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from teacher_probe import probe_rankings  # noqa: E402


def test_a_linear_probe_ranks_by_a_grade_that_is_linear_in_the_state():
    torch.manual_seed(0)
    direction = torch.randn(8)
    x = torch.randn(200, 8)
    grades = (x @ direction).round()  # (200,) the grade is a direction of the state
    perms = probe_rankings(x[:150], grades[:150], x[150:], [10] * 5)
    for slate, perm in zip(grades[150:].split(10), perms):
        assert slate[perm].tolist() == sorted(slate.tolist(), reverse=True)


def test_the_script_probes_a_job_teacher(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({
        "output_dir": str(run), "prompt": {"template": "compact"},
        "data": {"source": "synthetic", "synthetic": {"slate_size": 5, "catalogue_size": 200, "train_slates": 30,
                                                      "val_slates": 2, "test_slates": 6}},
        "teacher": {"bootstrap": False, "model": {"preset": "tiny", "hidden_size": 32, "layers": 2, "heads": 2,
                                                  "intermediate_size": 64}}}))
    out = tmp_path / "probe.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "teacher_probe.py"), "--run-dir", str(run),
                           "--probe-slates", "30", "--attention-slates", "3", "--threads", "1", "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    probes = [line for line in text.splitlines() if line.startswith(("| embeddings", "| after layer"))]
    assert len(probes) == 3 and all(0 < float(p.split("|")[2]) <= 1 for p in probes)  # embeddings + 2 layers
    assert "Grade read by the teacher's LM head" in text
    heads = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(heads) == 2
    for row in heads:
        for cell in row.strip("|").split("|")[1:]:
            on_ids, on_items = map(float, cell.split("/"))
            assert 0 <= on_ids <= 1 and 0 <= on_items <= 1 and on_ids + on_items <= 1.01
