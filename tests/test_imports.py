"""The installed package's modules import downwards only: no circle, not even one closed by an import inside a
function (which hides the circle from Python until that function runs, and from a reader always)."""

import ast
import graphlib
import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name (a package's ``__init__`` by the package's): the
    packages pyproject.toml declares, each read where the installation finds it."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    modules = {}
    for package in packages:
        for path in Path(importlib.util.find_spec(package).submodule_search_locations[0]).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules among ``modules`` that it imports anywhere in its file, inside functions too.
    ``from P import N`` imports the module P.N if there is one, else P. A package's ``__getattr__`` (PEP 562)
    imports a lazy export only when that name is asked for, so its imports are those of a node of their own, P.N,
    which ``from P import N`` imports."""
    edges = []  # (importer, module named, name imported from it or None)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        lazy = {id(node) for top in tree.body if path.stem == "__init__" and isinstance(top, ast.FunctionDef)
                and top.name == "__getattr__" for node in ast.walk(top)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges += [(name, alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}:{node.lineno} imports relatively; the package imports absolutely"
                edges += [(f"{name}.{alias.asname or alias.name}" if id(node) in lazy else name, node.module,
                           alias.name) for alias in node.names]
    graph = {name: set() for name in [*modules, *(importer for importer, _, _ in edges)]}
    for importer, module, name in edges:
        target = next((t for t in ([f"{module}.{name}"] if name else []) + [module] if t in graph), None)
        if target is not None and target != importer:
            graph[importer].add(target)
    return graph


def test_the_package_imports_downwards_only():
    modules = package_modules()
    assert {"bayesncl_pyro.config", "bayesncl_pyro.data.pipeline", "bayesncl_pyro.models.priors",
            "bayesncl_pyro.guides.gates"} <= modules.keys()
    try:
        order = list(graphlib.TopologicalSorter(import_graph(modules)).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"an import circle: {' -> '.join(e.args[1])}") from None
    layers = ["bayesncl_pyro.models.priors", "bayesncl_pyro.head", "bayesncl_pyro.learner", "bayesncl_pyro.training"]
    assert sorted(layers, key=order.index) == layers


def test_the_graph_sees_a_circle_closed_inside_a_function(tmp_path):
    """The check itself: an import inside a function is an edge, and a lazy export's import is the export's."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("from p import VERSION\n")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("VERSION = 1\ndef __getattr__(name):\n    from c import Thing\n")
    graph = import_graph({"a": tmp_path / "a.py", "b": tmp_path / "b.py", "c": tmp_path / "c.py",
                          "p": tmp_path / "p" / "__init__.py"})
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"p"}, "p": set(), "p.Thing": {"c"}}
