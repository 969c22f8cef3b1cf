"""The GPU benchmark cannot rot: its tiny size runs on a CPU in CI (the figures come from a GPU run)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("student", [[], ["--state-layer", "1", "--pooling", "last+mean", "--head", "utility"]],
                         ids=["paper-head", "cut-real-text-student"])
def test_gpu_latency_benchmark_runs_at_a_tiny_size(tmp_path, student):
    out = tmp_path / "gpu_latency.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_latency.py"), "--tiny", "--device", "cpu",
                           "--dtype", "float32", "--out", str(out), *student], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 4  # N in {4, 8} x batch in {1, 2}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[5]) > 0 and float(cells[6]) > 0 and float(cells[8]) > 0  # prefill, single, AR (ms)


@pytest.mark.gpu
def test_gpu_latency_benchmark_on_cuda(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = tmp_path / "gpu_latency.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_latency.py"), "--shapes", "smollm2-135m",
                           "--sizes", "20", "--batches", "1", "--repeats", "3", "--ar-repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
