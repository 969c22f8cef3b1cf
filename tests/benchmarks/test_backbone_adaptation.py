"""The one GPU command (issues #44, #48), kept alive on the CPU: the same script — `hllm.recipes.realtext` with the GPU
configs — end to end at a tiny size (backbones built from config, the multistage lists' top 8, two folds, three steps a
student), its report's lines asserted; and the backbone packing that carries the backbones to the GPU round-trips."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import backbone_adaptation  # noqa: E402
import pack  # noqa: E402


@pytest.mark.slow
@pytest.mark.data
def test_the_gpu_experiment_runs_end_to_end_at_a_tiny_size(shared_data, tmp_path):
    """The GPU command's configs (every variant: both backbones, LoRA and probe, five stages) through the recipe, tiny."""
    backbone_adaptation.main(["--tiny", "--data", str(shared_data / "trec-dl19-passage-multistage"), "--out", str(tmp_path)])
    text = (tmp_path / "backbone_adaptation.md").read_text()
    assert "share kept, tiny lora (bm25): " in text and "share kept, tiny ridge (bm25): " in text
    for stage in ("tasb", "ada2", "splade_pp_ed", "bm25", "bm25_rm3"):
        assert f"over {stage}: student " in text
    reports = json.loads((tmp_path / "backbone_adaptation.json").read_text())
    assert set(reports) == {"smollm2-dl19-multistage", "gemma3-dl19-multistage"}
    names = set()
    for report in reports.values():
        stages = report["by_stage"]
        assert stages["bm25"]["queries"] == 43 and set(stages) == {"bm25", "bm25_rm3", "tasb", "ada2", "splade_pp_ed"}
        for v in report["config"]["variants"]:
            names.add(v["name"])
            row = stages["tasb"]["table"][f"trial:{v['name']}@rankvicuna-7b+first-stage"]
            assert 0.0 <= row["nDCG@10"] <= 1.0 and len(row["per_query_nDCG@10"]) == 43
        assert stages["bm25"]["table"]["first_stage"]["nDCG@10"] < stages["bm25"]["table"]["teacher@rankvicuna-7b"]["nDCG@10"]
    assert names == {"smollm2-lora", "smollm2-lora-attention", "smollm2-probe", "gemma3-lora", "gemma3-probe"}


def test_the_packed_backbone_round_trips_within_int8_split_by_rows(tmp_path):
    t = torch.randn(64, 32)
    q = pack.quantize(t)
    assert q["int8"].dtype == torch.int8 and q["scale"].shape == (64, 1)
    back = pack.dequantize(q, torch.float32)
    assert (back - t).abs().max() <= t.abs().amax(dim=1, keepdim=True).max() / 127
    v = torch.randn(32)
    assert torch.allclose(pack.dequantize(pack.quantize(v), torch.float32), v, atol=1e-3)
    # a whole (tiny) backbone through parts smaller than its embedding matrix, and back
    from hllm.model.backbones import ModelConfig, load_backbone

    info = pack.pack_backbone(tmp_path / "tiny", "tiny", 2, part_mb=0.01)
    assert info["parts"] > 3
    model = pack.unpack_backbone(tmp_path / "tiny", info["parts"])
    back, _ = load_backbone(ModelConfig(preset="hf", path=str(model)))
    original, _ = load_backbone(ModelConfig())
    b, o = back.state_dict(), original.state_dict()
    assert len(back.model.layers) == 2 and set(b) <= set(o)
    for name, x in b.items():
        assert (x.float() - o[name]).abs().max() <= o[name].abs().max() / 100, name
    with pytest.raises(FileNotFoundError, match="carry every part"):
        pack.unpack_backbone(tmp_path / "tiny", info["parts"] + 1)


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
