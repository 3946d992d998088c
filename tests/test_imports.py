"""The installed package's modules import downwards only: no circle, not even one closed by an import inside a
function (which hides the circle from Python until that function runs, and from a reader always), and no import
from a higher layer than the module's own, the layers being those that the package's docstring lists."""

import ast
import graphlib
import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "bayesncl_pyro"


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


def layers() -> tuple[list[str], set[str]]:
    """The layers from the ground up as the package's docstring lists them ("" for the modules at the package's
    root), and the names of those root modules, the leaves, as it lists them."""
    doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / "__init__.py").read_text()))
    rows = re.findall(r"^    (\*\.py|\w+/) +(.*)$", doc, re.M)
    leaves = re.search(r"the leaves: ([\w,\s]+)", doc).group(1)  # the list may go on over the lines below
    return ["" if row == "*.py" else row.rstrip("/") for row, _ in rows], set(re.split(r"[,\s]+", leaves.strip()))


def layer_of(module: str) -> str:
    """bayesncl_pyro.infer.head -> "infer"; bayesncl_pyro.config, bayesncl_pyro.rundir.commit (a leaf that is a
    package) and the package itself -> ""."""
    parts = module.split(".")[1:]
    return parts[0] if parts and parts[0] not in LEAVES else ""


ORDER, LEAVES = layers()


def test_the_package_imports_downwards_only():
    modules = package_modules()
    assert {"bayesncl_pyro.config", "bayesncl_pyro.data.pipeline", "bayesncl_pyro.models.priors",
            "bayesncl_pyro.guides.gates"} <= modules.keys()
    graph = import_graph(modules)
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"an import circle: {' -> '.join(e.args[1])}") from None
    roots = {m.split(".")[1] for m in modules if m.count(".") == 1} - set(ORDER)
    assert roots == LEAVES, "the modules (and packages that are no layer) at the package's root are the leaves"
    assert {layer_of(m) for m in modules} <= set(ORDER), "every subpackage is a layer the docstring lists"
    upward = [f"{a} -> {b}" for a in modules for b in graph[a] if ORDER.index(layer_of(b)) > ORDER.index(layer_of(a))]
    assert not upward, f"imports from a higher layer: {upward}"


def test_the_layers_are_read_from_the_docstring():
    assert ORDER[0] == "" and ORDER.index("data") < ORDER.index("infer") < ORDER.index("train")
    assert {"errors", "config", "rundir"} <= LEAVES
    assert [layer_of(m) for m in ("bayesncl_pyro", "bayesncl_pyro.config", "bayesncl_pyro.rundir.commit",
                                  "bayesncl_pyro.data", "bayesncl_pyro.infer.head")] == ["", "", "", "data", "infer"]


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
