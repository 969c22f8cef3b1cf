import pkgutil
import subprocess
import sys

import hllm


def test_hllm_imports_no_ray_mlflow_or_deepspeed():
    modules = [m.name for m in pkgutil.walk_packages(hllm.__path__, "hllm.")]
    assert len(modules) >= 10
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'mlflow', 'deepspeed'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"hllm pulled in: {out.stdout.strip()}"
