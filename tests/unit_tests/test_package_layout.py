"""The package layout: imports only go downward (tools -> studies -> benchmarks -> training ->
model -> distributed -> pipeline -> common), what pretrain_gpt.py imports holds no study or measurement module, the pipeline
package starts no process, no module imports pretrain_gpt, and no two modules import each
other."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = [
    "megatron.common",
    "megatron.pipeline",
    "megatron.distributed",
    "megatron.model",
    "megatron.training",
    "megatron.benchmarks",
    "megatron.studies",
]  # bottom to top


def module_path(module: str) -> str | None:
    base = os.path.join(ROOT, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def imported_modules(path: str) -> set[str]:
    """Our modules that `path` imports (megatron.pipeline/training/studies), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith(tuple(LAYERS)) and module_path(n))
    return found


def our_modules() -> list[str]:
    modules = []
    for layer in LAYERS:
        for directory, _, files in os.walk(os.path.join(ROOT, *layer.split("."))):
            package = os.path.relpath(directory, ROOT).replace(os.sep, ".")
            modules += [f"{package}.{f[:-3]}" for f in files if f.endswith(".py")]
    return sorted(modules)


def layer_of(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module.startswith(layer))


@pytest.mark.parametrize("module", our_modules())
def test_imports_only_go_downward(module):
    upward = [m for m in imported_modules(module_path(module)) if layer_of(m) > layer_of(module)]
    assert not upward, f"{module} imports {upward} from a layer above it"


def test_pretrain_gpt_imports_no_study():
    seen, todo = set(), [os.path.join(ROOT, "pretrain_gpt.py")]
    while todo:
        for module in imported_modules(todo.pop()) - seen:
            seen.add(module)
            todo.append(module_path(module))
    assert "megatron.training.training" in seen  # the walk does follow the training loop
    studies = sorted(m for m in seen if m.startswith(("megatron.studies", "megatron.benchmarks")))
    assert not studies, f"pretrain_gpt.py's import graph holds {studies}"


@pytest.mark.parametrize("module", [m for m in our_modules() if m.startswith("megatron.pipeline")])
def test_the_pipeline_package_starts_no_process(module):
    """Schedules, runtime, transport, state and the simulator core: launchers and benchmarks
    that start processes (or find pretrain_gpt.py) live in megatron.benchmarks."""
    source = open(module_path(module)).read()
    for needle in ("subprocess", "pretrain_gpt", "multiprocessing"):
        assert needle not in source, f"{module} mentions {needle}"


def test_each_package_says_what_lives_there():
    for layer in LAYERS:
        for directory, _, files in os.walk(os.path.join(ROOT, *layer.split("."))):
            if "__init__.py" in files and "__pycache__" not in directory:
                tree = ast.parse(open(os.path.join(directory, "__init__.py")).read())
                assert ast.get_docstring(tree), f"{directory}/__init__.py has no docstring"


@pytest.mark.parametrize("module", our_modules())
def test_no_module_imports_the_script(module):
    """pretrain_gpt.py is a command line; the library (studies included) imports its GPT step
    from megatron.training.gpt_step."""
    assert "pretrain_gpt" not in _imported_names(module_path(module)), module


def _imported_names(path: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _import_graph() -> dict[str, set[str]]:
    """Module -> our modules it imports (absolute imports, at any depth, packages as their
    __init__); `from package import module` counts as importing the module."""
    graph = {}
    for module in our_modules():
        name = module[: -len(".__init__")] if module.endswith(".__init__") else module
        imported = imported_modules(module_path(module))
        # `from megatron.x import y` names both megatron.x and megatron.x.y: keep the module
        graph[name] = {m for m in imported if not any(o.startswith(m + ".") for o in imported)}
        graph[name].discard(name)
    return graph


def test_no_import_circle():
    """A circle (a imports b, b imports a, even inside a function) means two modules that
    cannot be read, tested or moved apart."""
    graph, circles = _import_graph(), []

    def visit(module: str, path: list[str]) -> None:
        for other in sorted(graph.get(module, ())):
            if other in path:
                circles.append(path[path.index(other) :] + [other])
            elif other not in done:
                visit(other, path + [other])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, circles[:3]


def test_the_schedules_the_simulator_and_the_projection_import_no_torch():
    """tools/simulate_pipeline.py and the projections start in a fraction of a second: their
    packages import neither torch nor megatron-core."""
    import subprocess
    import sys

    modules = ["megatron.pipeline.schedules", "megatron.pipeline.simulation",
               "megatron.benchmarks.projection", "megatron.benchmarks.balance"]  # fmt: skip
    check = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules " \
            "if m.split('.')[0] == 'torch' or m.startswith('megatron.core')))"  # fmt: skip
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
