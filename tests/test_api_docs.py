"""The API reference describes every argument and every return value of what it documents.

The callables checked are those the site's API pages show (docs/_ext/bayesncl_docs.py): the public names of
``bayesncl_pyro._PUBLIC``, what they return (``RETURNED``), every prior registered for ``--prior``, and the methods
of each of these classes that autodoc lists (its own public ones); and the code the maths page links to (``MATHS``),
a class with the methods listed there. Each docstring is read as the site reads it, through
napoleon's Google parser: an argument whose text is run into a neighbour's entry (a wrong indent) has no entry of its
own and fails here, as on the page.
"""

import ast
import dataclasses
import functools
import importlib
import inspect
import textwrap

import pytest
from helpers import docs_extension

import bayesncl_pyro

napoleon = pytest.importorskip("sphinx.ext.napoleon",
                               reason="the documentation site's packages: pip install -e '.[docs]'")
from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402 -- after the skip


@functools.cache
def documented() -> dict[str, object]:
    """Every callable the API pages show, by its path: the classes, their listed methods, the functions."""
    ext = docs_extension()
    found = {}
    objects = [getattr(bayesncl_pyro, n) for n in bayesncl_pyro._PUBLIC]
    objects += [getattr(importlib.import_module(m), n) for n, m in ext.RETURNED.items()]
    objects += list(ext.registered_priors())
    for obj in objects:
        if isinstance(obj, type):
            found[f"{obj.__module__}.{obj.__qualname__}"] = obj
            for name, member in vars(obj).items():
                if (name.startswith("_") and name != "__call__") or isinstance(member, (property,
                                                                                        functools.cached_property)):
                    continue
                if isinstance(member, (classmethod, staticmethod)):
                    member = member.__func__
                if inspect.isfunction(member) and member.__doc__:  # autodoc lists a member with a docstring
                    found[f"{obj.__module__}.{obj.__qualname__}.{name}"] = member
        elif inspect.isfunction(obj):
            found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found | ext.maths_objects()


def fields(doc: str, obj, what: str) -> tuple[dict[str, str], str | None]:
    """(argument -> its description, the Returns description) as napoleon renders the docstring."""
    lines = GoogleDocstring(doc, napoleon.Config(napoleon_use_param=True, napoleon_use_rtype=True), what=what,
                            obj=obj).lines()
    entries, key = {}, None
    for line in lines:
        if line.startswith(":"):
            head, _, text = line[1:].partition(":")
            key = head.split()[0], head.split()[-1].replace("\\*", "").lstrip("*")
            entries[key] = text.strip()
        elif key is not None and line.startswith(" ") and line.strip():
            entries[key] = (entries[key] + " " + line.strip()).strip()
        else:
            key = None
    params = {name: text for (kind, name), text in entries.items() if kind in ("param", "parameter", "arg")}
    returns = next((text for (kind, _), text in entries.items() if kind in ("returns", "return", "yields")), None)
    return params, returns


def _attribute_docs(cls: type) -> set[str]:
    """The fields of a dataclass that carry a docstring of their own (a string right after the field)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id for a, b in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def _returns_a_value(fn) -> bool:
    annotation = inspect.signature(fn).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError):
        return False
    nodes, own = list(tree.body), []
    while nodes:  # the function's own statements, not those of a function defined inside it
        node = nodes.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            own.append(node)
            nodes.extend(ast.iter_child_nodes(node))
    return any(isinstance(n, ast.Return) and n.value is not None and not (
        isinstance(n.value, ast.Constant) and n.value.value is None) for n in own) or any(
        isinstance(n, (ast.Yield, ast.YieldFrom)) for n in own)


def gaps(obj) -> list[str]:
    """What the docstring of a class or function leaves undescribed: its arguments, its Returns."""
    doc = inspect.getdoc(obj) if isinstance(obj, type) else obj.__doc__ and inspect.cleandoc(obj.__doc__)
    if not doc:
        return ["no docstring"]
    what = "class" if isinstance(obj, type) else "function"
    params, returns = fields(doc, obj, what)
    try:
        signature = inspect.signature(obj)
    except ValueError:
        return []
    names = [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")]
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        names = [n for n in names if n not in _attribute_docs(obj)]
    out = [f"argument {n!r} has no description of its own" for n in names if not params.get(n)]
    out += [f"documents {n!r}, which it does not take" for n in params if n not in names
            and not (isinstance(obj, type) and dataclasses.is_dataclass(obj))]
    if not isinstance(obj, type) and _returns_a_value(obj) and not returns:
        out.append("no Returns description")
    return out


def test_the_checked_set_holds_every_public_name_and_what_it_returns():
    found = documented()
    assert len(found) > 40
    for name in ("bayesncl_pyro.evaluate.run.TrainedRun.novelty", "bayesncl_pyro.evaluate.run.load_run",
                 "bayesncl_pyro.infer.head.BayesNCLHead.forward", "bayesncl_pyro.evaluate.report.write_report",
                 "bayesncl_pyro.evaluate.figures.inspect", "bayesncl_pyro.config.Config.from_dict",
                 "bayesncl_pyro.train.trainer.Trainer.fit", "bayesncl_pyro.models.bayesncl.ContrastiveModel.forward",
                 "bayesncl_pyro.infer.estimators.ModeStraightThrough.value", "bayesncl_pyro.nn.losses.bernoulli_kl"):
        assert name in found, name


def test_the_check_finds_an_argument_run_into_its_neighbours_text_and_a_missing_returns():
    def merged(a, b) -> int:
        """Add.

        Args:
            a: the first,
              b: the second (indented too far: napoleon reads it as a's text).
        """

    def fine(a, *rest, **load) -> int:
        """Add.

        Args:
            a: the first.
            *rest: the others.
            **load: passed on.

        Returns:
            The sum.
        """

    assert gaps(merged) == ["argument 'b' has no description of its own", "no Returns description"]
    assert gaps(fine) == []


@pytest.mark.parametrize("path", sorted(documented()))
def test_every_argument_and_return_value_is_described(path):
    problems = gaps(documented()[path])
    assert not problems, f"{path}: " + "; ".join(problems)


# -- an example per name, run here ---------------------------------------------------------------------------------

def _named() -> dict[str, object]:
    """Every name a user calls that the API pages list: the public ones and what they give back (the code the maths
    page links to is read beside its equations, not called)."""
    ext = docs_extension()
    return {**{n: getattr(bayesncl_pyro, n) for n in bayesncl_pyro._PUBLIC},
            **{n: getattr(importlib.import_module(m), n) for n, m in ext.RETURNED.items()}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """The run the examples read: two steps of BayesNCL on the digits (K = 16), evaluated, its gates exported."""
    from bayesncl_pyro.evaluate.arviz_export import export_gates

    folder = tmp_path_factory.mktemp("examples") / "run"
    cfg = bayesncl_pyro.Config(dataset="digits", max_steps=2, batch_size=64, proj_dim=16, workers=0, out=str(folder))
    bayesncl_pyro.Trainer(cfg, progress=False).fit().evaluate()
    export_gates(folder)
    return str(folder)


def test_every_name_has_an_example():
    missing = [n for n, obj in _named().items() if ">>>" not in (obj.__doc__ or "")]
    assert not missing


@pytest.mark.parametrize("name", sorted(_named()))
def test_the_examples_run(name, run_dir, tmp_path, monkeypatch, capsys):
    """Each name's examples (its docstring's and its methods'), as a user reads them: the public names imported, a
    trained run at ``run_dir`` and an empty ``folder``; files the examples write go to a temporary folder."""
    import doctest
    from pathlib import Path

    import torch

    monkeypatch.chdir(tmp_path)
    obj = _named()[name]
    globs = {**vars(importlib.import_module(obj.__module__)), **_named(), "torch": torch, "Path": Path,
             "run_dir": run_dir, "folder": str(tmp_path / "new-run")}
    tests = [t for t in doctest.DocTestFinder().find(obj, name, globs=globs) if t.examples]
    assert tests
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.summarize(verbose=False).failed == 0, "".join(report)
