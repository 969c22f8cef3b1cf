"""Model loading and exposure: safetensors only, no remote code unless asked, no pickle loads,
local Ray bound to loopback."""

import json
import re
from pathlib import Path

import pytest
import torch

from hllm.model.backbones import ModelConfig, load_backbone, save_backbone

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def saved_model(tmp_path, tiny_backbone):
    model, tokenizer = tiny_backbone
    save_backbone(model, tokenizer, tmp_path / "model")
    return tmp_path / "model", model, tokenizer


def test_pickled_weights_are_refused(saved_model):
    path, model, _ = saved_model
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")  # the legacy format: a pickle
    with pytest.raises(OSError, match="safetensors"):
        load_backbone(ModelConfig(preset="hf", path=str(path)))


def test_remote_code_runs_only_when_the_config_asks(saved_model):
    path, _, _ = saved_model
    marker = path / "remote_code_ran"
    (path / "evil_modeling.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(preset="hf", path=str(path))
    assert cfg.trust_remote_code is False
    try:
        load_backbone(cfg)  # transformers ignores auto_map without trust_remote_code
    except Exception:
        pass  # refusing is fine too; running the file is not
    assert not marker.exists()


def test_no_pickle_loads_in_the_library_or_the_server():
    pattern = re.compile(r"\btorch\.load\(|\bpickle\.loads?\(|\bjoblib\.load\(")
    offenders = [f"{p.relative_to(ROOT)}:{i + 1}" for d in ("hllm", "serve") for p in (ROOT / d).rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert offenders == []
    for name in ("model/backbones.py",):
        assert "use_safetensors=True" in (ROOT / "hllm" / name).read_text()


def test_local_ray_keeps_dashboard_and_job_server_on_loopback():
    script = (ROOT / "scripts" / "run_local.sh").read_text()
    start = next(line for line in script.splitlines() if line.strip().startswith("ray start"))
    assert "--dashboard-host=127.0.0.1" in start and "--head" in start
    assert 'python -m pipelines.submit --address "http://127.0.0.1:' in script  # the job goes to the loopback head
    common = (ROOT / "pipelines" / "common.py").read_text()
    assert 'ray.init(num_cpus=cfg.local_cpus, include_dashboard=False, dashboard_host="127.0.0.1", **quiet)' in common
    launch = (ROOT / "serve" / "launch.py").read_text()  # `hllm serve`'s own Ray: no dashboard, Serve on loopback
    assert "ray.init(address=args.address, include_dashboard=False" in launch and 'default="127.0.0.1"' in launch
    assert "--dashboard-host=127.0.0.1" in (ROOT / "cluster.yaml").read_text()
