"""The site's generated sources: an API page per public module, and the notebooks as pages.

Both are written into the source folder when the build starts (``config-inited``), from what the package and the
repository hold, so that a name added to ``bayesncl_pyro._PUBLIC`` or a notebook added to ``notebooks/`` gets its
page without an edit here:

* ``api/<module>.rst``: one page per module that ``bayesncl_pyro._PUBLIC`` names, documenting exactly the public
  names that live there, under their top-level path (``bayesncl_pyro.BayesNCLHead``); the priors' module also gets
  every prior registered for ``--prior``. What those names give back and the functions beside them (``RETURNED``:
  ``load_run``'s ``TrainedRun``, the head's ``HeadOutput``, the report) are documented under their module's path, on
  that module's page. So is the code that the equations of ``maths.md`` link to (``MATHS``: the model's and the
  guide's parts, the ELBO, the estimators), a class with the methods that compute them. ``api/index.rst`` lists every
  name with its page.
* ``notebooks/<name>.ipynb``: each notebook of the repository's ``notebooks/``, taken executed from
  ``BAYESNCL_EXECUTED_NOTEBOOKS`` (default ``docs/_build/executed``, where tests/test_notebook.py writes the copies it
  ran) where a copy there has the same cells, else as it is stored (no outputs), for myst-nb to execute.

The docstrings' indented blocks (code examples, layouts) are shown as written (:func:`literal_blocks`). A guide page's
link to code that names nothing fails the build (:func:`broken_code_link`). A file is rewritten only when its text
changes, so an unchanged page is not read again by an incremental build.
"""

import importlib
import inspect
import json
import os
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
EXECUTED = Path(os.environ.get("BAYESNCL_EXECUTED_NOTEBOOKS") or DOCS / "_build" / "executed")
LIST_ITEM = re.compile(r"([*+-]|\d+[.)]|#\.)\s")
# what the public names give back, and the functions beside them that the notebooks call, each with its module: not
# importable from the top level, documented at their module's path
RETURNED = {
    "TrainedRun": "bayesncl_pyro.evaluate.run",
    "HeadOutput": "bayesncl_pyro.infer.output",
    "Report": "bayesncl_pyro.evaluate.report",
    "write_report": "bayesncl_pyro.evaluate.report",
    "inspect": "bayesncl_pyro.evaluate.figures",
}
# the code that computes the equations of maths.md, which links each to its entry (and so to its [source]), each with
# its module: a class is shown with the methods named here ("Class.method"), those that compute the maths
MATHS = {
    "BernoulliGates": "bayesncl_pyro.guides.gates",
    "GumbelSigmoidGates.inclusion": "bayesncl_pyro.guides.gates",
    "GateGuide.logits": "bayesncl_pyro.guides.gates",
    "BayesianHead.prior": "bayesncl_pyro.guides.gates",
    "ContrastiveModel.forward": "bayesncl_pyro.models.bayesncl",
    "info_nce_rows": "bayesncl_pyro.nn.losses",
    "info_nce_flip_differences": "bayesncl_pyro.nn.losses",
    "bernoulli_kl": "bayesncl_pyro.nn.losses",
    "MeanFieldELBO.terms": "bayesncl_pyro.infer.elbo",
    "GateEstimator.value": "bayesncl_pyro.infer.estimators",
    "ModeStraightThrough.value": "bayesncl_pyro.infer.estimators",
    "SampledStraightThrough.value": "bayesncl_pyro.infer.estimators",
    "Relaxed.value": "bayesncl_pyro.infer.estimators",
    "LocalExpectation": "bayesncl_pyro.infer.estimators",
    "LocalExpectationELBO.particle": "bayesncl_pyro.infer.estimators",
    "GumbelSigmoid": "bayesncl_pyro.infer.estimators",
}


def public_modules() -> dict[str, list[str]]:
    """The modules that hold the public names, each with its names, in the order ``_PUBLIC`` lists them."""
    import bayesncl_pyro

    modules: dict[str, list[str]] = {}
    for name, module in bayesncl_pyro._PUBLIC.items():
        modules.setdefault(module, []).append(name)
    return modules


def _summary(obj) -> str:
    """The first line of a class's or function's docstring; for a registry (a dict), the names it holds."""
    if isinstance(obj, dict):
        return "the registry of: " + ", ".join(f"``{key}``" for key in obj)
    doc = inspect.getdoc(obj)
    return doc.splitlines()[0] if doc else ""


def _write(path: Path, text: str):
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _directive(name: str, obj, members: list[str] | None = None) -> str:
    """The autodoc directive of ``name``; a class with every documented member, or only ``members`` where given."""
    if members is not None:
        listed = f"   :members: {', '.join(members)}\n" if members else ""
        return f".. autoclass:: {name}\n{listed}   :show-inheritance:\n"
    if isinstance(obj, type):
        # the head's program and evaluation live in mixins of their own (infer/program.py, infer/evaluation.py): its
        # page shows them, not nn.Module's
        inherited = "   :inherited-members: Module\n" if name.endswith("BayesNCLHead") else ""
        return f".. autoclass:: {name}\n   :members:\n{inherited}   :show-inheritance:\n"
    if callable(obj):
        return f".. autofunction:: {name}\n"
    return f".. autodata:: {name}\n   :no-value:\n"


def _title(text: str, mark: str = "=") -> str:
    return f"{text}\n{mark * len(text)}\n"


def registered_priors() -> list[type]:
    """The classes of the priors that ``--prior NAME`` picks, in the registry's order."""
    from bayesncl_pyro.models.priors import PRIORS

    return list(PRIORS.values())


def _registered_priors() -> str:
    """The priors that ``--prior NAME`` picks, each documented at its own module's path."""
    from bayesncl_pyro.models.priors import PRIORS

    lines = ["", _title("Registered priors", "-"), "The priors that ``--prior NAME`` picks from ``PRIORS``:", "",
             ".. list-table::", "   :header-rows: 1", "", "   * - ``--prior``", "     - class"]
    blocks = []
    for key, cls in PRIORS.items():
        path = f"{cls.__module__}.{cls.__qualname__}"
        lines += [f"   * - ``{key}``", f"     - :class:`{path}`"]
        blocks.append(f".. autoclass:: {path}\n   :members:\n   :show-inheritance:\n")
    return "\n".join(lines) + "\n\n" + "\n".join(blocks)


def _by_module(names: dict[str, str]) -> dict[str, list[str]]:
    modules: dict[str, list[str]] = {}
    for name, module in names.items():
        modules.setdefault(module, []).append(name)
    return modules


def returned_modules() -> dict[str, list[str]]:
    """The modules of ``RETURNED``'s names, each with its names."""
    return _by_module(RETURNED)


def maths_modules() -> dict[str, dict[str, list[str]]]:
    """The modules of ``MATHS``' names, each with its classes and functions, a class with its methods listed there."""
    modules: dict[str, dict[str, list[str]]] = {}
    for name, module in MATHS.items():
        owner, _, member = name.partition(".")
        modules.setdefault(module, {}).setdefault(owner, []).extend([member] if member else [])
    return modules


def maths_objects() -> dict[str, object]:
    """Every class, method and function of ``MATHS``, by its path: what the API pages show of it."""
    found = {}
    for module, names in maths_modules().items():
        here = importlib.import_module(module)
        for name, members in names.items():
            obj = found[f"{module}.{name}"] = getattr(here, name)
            found |= {f"{module}.{name}.{m}": getattr(obj, m) for m in members}
    return found


def _table(rows: list[tuple[str, str, object]]) -> list[str]:
    out = [".. list-table::", "   :header-rows: 1", "", "   * - name", "     - module", "     - what it is"]
    for path, module, obj in rows:
        out += [f"   * - :py:obj:`{path}`", f"     - :doc:`{module}`", f"     - {_summary(obj)}"]
    return out


def write_api_pages(out: Path = DOCS / "api"):
    """``api/index.rst`` and a page per module that documents a name; pages of modules no longer named are removed."""
    import bayesncl_pyro

    modules, returned, maths = public_modules(), returned_modules(), maths_modules()
    texts: dict[str, str] = {}
    for module, names in modules.items():
        body = [_title(module), f".. automodule:: {module}", "   :no-members:", "", ".. currentmodule:: bayesncl_pyro",
                "", f"Public names defined here, imported as ``from bayesncl_pyro import {', '.join(names)}``.", ""]
        for name in names:
            body.append(_directive(name, getattr(bayesncl_pyro, name)))
        texts[module] = "\n".join(body)
        if module == "bayesncl_pyro.models.priors":
            texts[module] += _registered_priors()
    for module, names in returned.items():
        here = importlib.import_module(module)
        body = ["", _title("What it gives back", "-")] if module in texts else [
            _title(module), f".. automodule:: {module}", "   :no-members:", ""]
        body += [f".. currentmodule:: {module}", "",
                 f"Imported as ``from {module} import {', '.join(names)}``.", ""]
        body += [_directive(name, getattr(here, name)) for name in names]
        texts[module] = texts.get(module, "") + "\n".join(body)
    for module, names in maths.items():
        here = importlib.import_module(module)
        body = ["", _title("What computes the maths", "-")] if module in texts else [
            _title(module), f".. automodule:: {module}", "   :no-members:", ""]
        body += [f".. currentmodule:: {module}", "", "The code of the equations of :doc:`/maths`.", ""]
        body += [_directive(name, obj, members if isinstance(obj, type) else None)
                 for name, members in names.items() for obj in [getattr(here, name)]]
        texts[module] = texts.get(module, "") + "\n".join(body)
    index = [_title("API reference"),
             "The public names, importable from the top level (``from bayesncl_pyro import Config``); each stays",
             "there when its module moves. A page per module that defines them:", "",
             *_table([(f"bayesncl_pyro.{n}", m, getattr(bayesncl_pyro, n)) for m, ns in modules.items() for n in ns]),
             "", _title("What they give back", "-"),
             "What the public names return, and the functions beside them that the notebooks call, imported from",
             "their module (``from bayesncl_pyro.evaluate.report import Report``):", "",
             *_table([(f"{m}.{n}", m, getattr(importlib.import_module(m), n)) for m, ns in returned.items()
                      for n in ns]),
             "", _title("What computes the maths", "-"),
             "The classes and functions that compute the equations of :doc:`/maths`, each linked from its equation:",
             "", *_table([(f"{m}.{n}", m, getattr(importlib.import_module(m), n)) for m, ns in maths.items()
                          for n in ns]),
             "", ".. toctree::", "   :maxdepth: 1", "", *(f"   {m}" for m in texts), ""]
    for module, text in texts.items():
        _write(out / f"{module}.rst", text)
    _write(out / "index.rst", "\n".join(index))
    for stale in out.glob("*.rst"):
        if stale.stem not in {"index", *texts}:
            stale.unlink()


def _cells(nb: dict) -> list[tuple[str, str]]:
    join = lambda s: "".join(s) if isinstance(s, list) else s  # noqa: E731 -- nbformat stores either
    return [(c["cell_type"], join(c["source"])) for c in nb["cells"]]


def _site_links(nb: dict):
    """Make a notebook's Markdown links to docs/ right from the site's docs/notebooks/.

    In the repository they are ``../docs/gates.md`` (from notebooks/); on the site, ``../gates.md``.
    """
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = text.replace("](../docs/", "](../")


def copy_notebooks(out: Path = DOCS / "notebooks", executed: Path = EXECUTED) -> dict[str, bool]:
    """Each notebook of ``notebooks/`` into ``out``, executed where ``executed`` holds a copy with the same cells.

    Returns:
        Each notebook's name, and whether its copy came executed (myst-nb then leaves it as it is).
    """
    found = {}
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(source.read_text())
        ran = executed / source.name
        found[source.name] = False
        if ran.exists():
            ran_nb = json.loads(ran.read_text())
            if _cells(ran_nb) == _cells(nb):
                nb = ran_nb
                nb["metadata"].setdefault("mystnb", {})["execution_mode"] = "off"
                found[source.name] = True
        _site_links(nb)
        _write(out / source.name, json.dumps(nb, indent=1) + "\n")
    for stale in out.glob("*.ipynb"):
        if stale.name not in found:
            stale.unlink()
    return found


def literal_blocks(app, what, name, obj, options, lines):
    """Shows a docstring's indented block after a top-level paragraph as it is written (a code example, a layout).

    docutils would take it for a block quote and run its lines together: the ``::`` that reST wants goes before it.
    """
    i = 1
    while i < len(lines) - 1:
        before, blank, block = lines[i - 1], lines[i], lines[i + 1]
        if (not blank.strip() and before.strip() and not before[0].isspace() and not before.rstrip().endswith("::")
                and not before.startswith((":", "..")) and not LIST_ITEM.match(before)
                and block.startswith("    ") and block.strip()):
            lines.insert(i, "")
            lines.insert(i + 1, "::")
            i += 3
        i += 1


def broken_code_link(app, env, node, contnode):
    """A guide page's (or a notebook's) link to code whose target is documented nowhere: a warning, so ``-W`` fails.

    Sphinx warns of an unresolved reference only in its nitpicky mode, which would also flag every type in the API
    pages' signatures that has no page here (torch's, Python's: no intersphinx); a guide page names its code on
    purpose, and a name that moved or was misspelt would render as plain code with no link.
    """
    from sphinx.util import logging  # Sphinx's own only here: the tests read the rest of this file without it

    if node.get("refdomain") == "py" and not node.get("refdoc", "").startswith("api/"):
        logging.getLogger(__name__).warning(
            "%s link to %r, which no API page documents: name it by its documented path (api/index)",
            node.get("reftype"), node.get("reftarget"), location=node, type="ref", subtype="py")


def _generate(app, config):
    write_api_pages()
    for name, ran in copy_notebooks().items():
        how = "executed by the tests" if ran else f"to execute (mode {config.nb_execution_mode})"
        print(f"notebook {name}: {how}")


def setup(app):
    """Writes the generated sources when the build starts."""
    app.connect("config-inited", _generate)
    app.connect("autodoc-process-docstring", literal_blocks)
    app.connect("missing-reference", broken_code_link)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
