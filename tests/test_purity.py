"""The library boundary, read from the source (AST), so a lazy import inside a function counts too."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import hllm

FORBIDDEN = {"ray", "mlflow", "deepspeed", "fastapi", "pydantic", "matplotlib"}
LIBRARY = Path(hllm.__file__).parent


def dotted_imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (also `importlib.import_module("x")` literals), dotted."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the modules a file imports."""
    return {name.split(".")[0] for name in dotted_imports(path)}


def test_the_check_sees_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import ray.train\n    from mlflow import log_metric\n    importlib.import_module('deepspeed')\n")
    assert imported_modules(probe) == {"ray", "mlflow", "deepspeed"}


def test_hllm_source_imports_no_framework():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) >= 15
    bad = {str(f.relative_to(LIBRARY)): sorted(imported_modules(f) & FORBIDDEN) for f in files}
    assert not {f: m for f, m in bad.items() if m}, f"hllm/ imports frameworks: {bad}"


def test_nothing_in_hllm_imports_the_pipelines_or_serve():
    bad = {str(f.relative_to(LIBRARY)): sorted(imported_modules(f) & {"pipelines", "serve", "benchmarks"})
           for f in LIBRARY.rglob("*.py")}
    assert not {f: m for f, m in bad.items() if m}


def test_importing_every_module_loads_no_framework():
    modules = [m.name for m in pkgutil.walk_packages(hllm.__path__, "hllm.")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"hllm pulled in: {out.stdout.strip()}"


def test_the_single_process_job_is_a_leaf():
    """Recipes import the library; nothing imports the recipe."""
    importers = [str(f) for root in ("hllm", "pipelines", "serve", "benchmarks") for f in (LIBRARY.parent / root).rglob("*.py")
                 if "hllm.workflow" in dotted_imports(f)]
    assert importers == []

