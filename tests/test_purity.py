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


# What may import a recipe: the `hllm` command's dispatch and the MLflow-logged entry points that run one
# (pipelines/), the benchmarks (scripts that run a recipe or read its caches under its config; nothing imports them),
# and the tests. What the real-text recipes share lives in the library (hllm.train.probes, hllm.eval.metrics,
# hllm.data.splits): no recipe imports another.
RECIPE_IMPORTERS = ("pipelines/", "benchmarks/", "tests/")


def test_every_recipe_is_a_leaf_with_a_main():
    """Each module of hllm/recipes/ has a `main()` over the library; nothing else in the project imports one."""
    recipes = sorted(f for f in (LIBRARY / "recipes").glob("*.py") if f.name != "__init__.py")
    assert len(recipes) >= 3  # local_job, order, realtext: the glob found the recipes
    for f in recipes:
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(f.read_text()).body), f"{f.name}: no main()"
    importers = {(str(f.relative_to(LIBRARY.parent)), name) for root in ("hllm", "pipelines", "serve", "benchmarks", "scripts")
                 for f in (LIBRARY.parent / root).rglob("*.py") for name in dotted_imports(f)
                 if name.startswith("hllm.recipes.") and not str(f.relative_to(LIBRARY.parent)).startswith(RECIPE_IMPORTERS)}
    assert importers == set(), sorted(importers)


# The layers, top to bottom: a module may import its own layer and those below it, never one above.
LAYERS = ["recipes", "job", "serving", "train", "eval", "reranker", "teacher", "model", "data", "base"]
BASE = {"__init__", "config", "records", "uris"}  # what every layer shares, at the bottom


def layer_of(module: str) -> str:
    """`hllm.model.heads` -> "model"; `hllm.reranker` -> "reranker"; `hllm.config` -> "base"."""
    part = module.split(".")[1] if "." in module else "__init__"
    return "base" if part in BASE else part


def hllm_edges(root: Path = LIBRARY) -> set[tuple[str, str]]:
    """(importer, imported) for every import between hllm modules, anywhere in a file (lazy ones too)."""
    edges = set()
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        importer = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for name in dotted_imports(f):
            if name.startswith("hllm.") and name != importer:
                edges.add((importer, name))
    return edges


def wrong_way(edges: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{a} imports {b}: {layer_of(a)} sits below {layer_of(b)}" for a, b in edges
                  if layer_of(b) in LAYERS and LAYERS.index(layer_of(b)) < LAYERS.index(layer_of(a)))


def test_every_module_sits_in_a_layer():
    modules = {a for a, _ in hllm_edges()} | {b for _, b in hllm_edges()}
    assert {layer_of(m) for m in modules} <= set(LAYERS), sorted(m for m in modules if layer_of(m) not in LAYERS)
    roots = sorted(f.name for f in LIBRARY.glob("*.py"))
    assert len(roots) <= 6, f"modules at the root of hllm/: {roots}"


def test_imports_run_only_down_the_layers():
    assert wrong_way(hllm_edges()) == []


def test_a_wrong_way_import_fails_naming_both_modules(tmp_path):
    """The check itself: a copy of the tree with `hllm.data.store` importing the recipes is caught."""
    probe = tmp_path / "hllm"
    (probe / "data").mkdir(parents=True)
    (probe / "data" / "store.py").write_text("def f():\n    from hllm.job.stages import Rankings\n")
    assert wrong_way(hllm_edges(probe)) == [
        "hllm.data.store imports hllm.job.stages: data sits below job"]


def test_no_import_cycles_between_modules():
    """Module-level imports only (a lazy import inside a function cannot make an import-time cycle)."""
    graph: dict[str, set[str]] = {}
    for f in LIBRARY.rglob("*.py"):
        parts = f.relative_to(LIBRARY.parent).with_suffix("").parts
        importer = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        top = [n for n in ast.parse(f.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
        graph[importer] = {n for n in names if n.startswith("hllm.") and n != importer}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, path + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


# The Ray glue above the library: the registry and console helpers at its bottom (both Serve and the pipelines use
# them), Serve above them, the pipelines' stages and jobs on top (the job deploys Serve; Serve never runs a stage).
ROOT = LIBRARY.parent
GLUE_BASE = {"pipelines.registry", "pipelines.registry_model", "pipelines.console"}


def glue_layer(module: str) -> int:
    return 0 if module in GLUE_BASE else 1 if module.startswith("serve.") else 2


def glue_imports(package: str) -> dict[str, list[ast.ImportFrom | ast.Import]]:
    """module -> its import statements (anywhere in the file) of this project's glue packages."""
    out = {}
    for f in sorted((ROOT / package).glob("*.py")):
        nodes = [n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        out[f"{package}.{f.stem}"] = nodes
    return out


def imported_from(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module, name) pairs an import statement reads (name None for `import module`)."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    if node.level or not node.module:
        return []
    if node.module in ("serve", "pipelines"):  # `from pipelines import console`: the module console
        return [(f"{node.module}.{a.name}", None) for a in node.names]
    return [(node.module, a.name) for a in node.names]


def test_serve_and_the_pipelines_import_down_their_layers_and_no_private_names():
    wrong, private = [], []
    for package in ("serve", "pipelines"):
        for module, nodes in glue_imports(package).items():
            for node in nodes:
                for target, name in imported_from(node):
                    if target.split(".")[0] not in ("serve", "pipelines") or target == module:
                        continue
                    if glue_layer(target) > glue_layer(module):
                        wrong.append(f"{module} imports {target}")
                    if name is not None and name.startswith("_"):
                        private.append(f"{module} imports {target}.{name}")
    assert wrong == [] and private == [], (wrong, private)


def test_serve_has_no_import_cycle():
    """The apps share `serve.common`; neither imports the other at module level (the one-student app's builder hands
    a many-student config to `serve.students` lazily, and nothing imports `serve.app` back)."""
    graph = {}
    for f in (ROOT / "serve").glob("*.py"):
        top = [n for n in ast.parse(f.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[f"serve.{f.stem}"] = {t for n in top for t, _ in imported_from(n) if t.startswith("serve.")}
    assert "serve.app" not in set().union(*graph.values()), {m: t for m, t in graph.items() if "serve.app" in t}
    assert all(t in ("serve.common", "serve.schemas") for t in graph["serve.students"]), graph["serve.students"]


def test_the_tests_mirror_the_project():
    """A test file lives beside what it tests: tests/hllm/<layer>/, tests/pipelines/, tests/serve/, tests/deploy/,
    tests/benchmarks/; only this file (the whole project's layering) sits at the top."""
    tests = ROOT / "tests"
    misplaced = []
    for f in sorted(tests.rglob("test_*.py")):
        parts = f.relative_to(tests).parts
        ok = (parts == ("test_purity.py",) or (len(parts) == 2 and parts[0] in ("pipelines", "serve", "deploy", "benchmarks"))
              or (len(parts) == 3 and parts[0] == "hllm" and parts[1] in LAYERS and (LIBRARY / parts[1]).is_dir())
              or (len(parts) == 3 and parts[:2] == ("hllm", "reranker")))
        if not ok:
            misplaced.append(str(f.relative_to(ROOT)))
    assert misplaced == [], misplaced
    names = [f.name for f in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files of one name (pytest imports them by their base name)"


def test_no_test_imports_a_test_module_of_another_folder():
    """Shared test helpers live in tests/builders.py, tests/conftest.py and the helper modules beside them: a test module
    imported from another folder is found only if pytest happened to collect that folder first (pytest puts each test
    file's own folder on sys.path)."""
    import re

    tests = ROOT / "tests"
    wrong = []
    for f in sorted(tests.rglob("*.py")):
        for name in re.findall(r"^\s*(?:from|import) (test_\w+)", f.read_text(), flags=re.M):
            if not (f.parent / f"{name}.py").is_file():
                wrong.append(f"{f.relative_to(ROOT)} imports {name}")
    assert wrong == [], wrong
