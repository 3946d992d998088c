"""The documentation site (docs/): it builds with no warning (``sphinx-build -W``), every page is built, its API pages
document every public name of bayesncl_pyro on the page of the module that defines it, a new public name gets its
entry with no edit to the site, and in Chromium the index shows the navigation and a notebook page its figures."""

import html as html_module
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from helpers import ROOT, docs_extension

import bayesncl_pyro
from bayesncl_pyro.models.priors import PRIORS

DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
OWN_PRIOR = ROOT / "notebooks" / "your_own_prior.ipynb"
INSPECT = ROOT / "notebooks" / "inspect_gates.ipynb"


def build_site(out: Path, executed: list[Path], executed_notebook) -> Path:
    """``sphinx-build -W`` of docs/ into ``out/html``, the notebooks in ``executed`` shown as the tests ran them, the
    others without outputs (not run: ``nb_execution_mode=off``). Fails on any warning."""
    for module in ("sphinx", "myst_nb", "furo"):
        pytest.importorskip(module, reason="the documentation site's packages: pip install -e '.[docs]'")
    folder = out / "executed"
    folder.mkdir(parents=True)
    for path in executed:
        nbformat.write(executed_notebook(path)[0], folder / path.name)
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-D", "nb_execution_mode=off",
         str(DOCS), str(out / "html")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "BAYESNCL_EXECUTED_NOTEBOOKS": str(folder)})
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    assert "WARNING" not in build.stderr and "ERROR" not in build.stderr, build.stderr
    for path in NOTEBOOKS:  # the build took the executed copies, and only those
        state = "executed by the tests" if path in executed else "to execute (mode off)"
        assert f"notebook {path.name}: {state}" in build.stdout
    return out / "html"


@pytest.fixture(scope="module")
def site(tmp_path_factory, executed_notebook):
    """The site as the default test run builds it: your_own_prior.ipynb executed (its test runs it anyway)."""
    return build_site(tmp_path_factory.mktemp("site"), [OWN_PRIOR], executed_notebook)


def _title(path: Path) -> str:
    """A page's title: the first heading of a Markdown file or of a notebook's first cell."""
    text = nbformat.read(path, as_version=4).cells[0].source if path.suffix == ".ipynb" else path.read_text()
    return next(line[2:].strip() for line in text.splitlines() if line.startswith("# "))


def _ids(page: Path) -> set[str]:
    """The objects a page documents at the top level of the package: ``bayesncl_pyro.<name>``."""
    return set(re.findall(r'id="(bayesncl_pyro\.[A-Za-z_]\w*)"', page.read_text()))


@pytest.mark.slow  # reads the whole site, whose build takes 25 s; .ci/run also builds it with -W
def test_every_page_is_built_with_its_title(site):
    modules = docs_extension().public_modules()
    pages = {p.stem: _title(p) for p in DOCS.glob("*.md")}
    pages |= {f"notebooks/{p.stem}": _title(p) for p in NOTEBOOKS}
    pages |= {f"api/{m}": m for m in modules} | {"api/index": "API reference"}
    assert {"index", "METHOD", "RESULTS", "PERFORMANCE", "RELIABILITY", "training", "gates", "own_code", "model",
            "run_folder"} <= set(pages) and len(NOTEBOOKS) >= 2
    for page, title in pages.items():
        html = (site / f"{page}.html").read_text()
        h1 = re.search(r"<h1>(.*?)<a class=\"headerlink\"", html, re.S)
        assert h1 and re.sub(r"<[^>]+>", "", h1.group(1)).strip().replace("\u2019", "'") == title.replace("`", ""), page


@pytest.mark.slow  # reads the whole site, whose build takes 25 s; .ci/run also builds it with -W
def test_every_public_name_has_an_entry_on_its_modules_page(site):
    modules = docs_extension().public_modules()
    assert sorted(n for names in modules.values() for n in names) == bayesncl_pyro.__all__
    for module, names in modules.items():
        # exactly the module's public names, under their top-level path; a docstring's example shown as written
        assert _ids(site / "api" / f"{module}.html") == {f"bayesncl_pyro.{n}" for n in names}, module
        assert "<blockquote" not in (site / "api" / f"{module}.html").read_text(), module
        assert all(getattr(importlib.import_module(module), n) is getattr(bayesncl_pyro, n) for n in names)
    index = (site / "api" / "index.html").read_text()
    for name in bayesncl_pyro.__all__:
        assert f'href="{bayesncl_pyro._PUBLIC[name]}.html#bayesncl_pyro.{name}"' in index, name
    # the prior contract: the base class with what a prior writes, and every prior --prior can name
    priors = (site / "api" / "bayesncl_pyro.models.priors.html").read_text()
    for method in ("rate", "forward", "make_guide"):
        assert f'id="bayesncl_pyro.Prior.{method}"' in priors, method
    for name, cls in PRIORS.items():
        assert f'id="{cls.__module__}.{cls.__qualname__}"' in priors and f'<span class="pre">{name}</span>' in priors


def test_a_new_public_name_gets_its_entry_with_no_edit_to_the_site(tmp_path, monkeypatch):
    """The API pages come from ``bayesncl_pyro._PUBLIC``: a name added there (here in a module with no page yet) gets
    an entry and its module a page; a module no longer public loses its page."""
    ext = docs_extension()
    monkeypatch.setitem(bayesncl_pyro._PUBLIC, "MeanFieldELBO", "bayesncl_pyro.infer.elbo")
    (tmp_path / "bayesncl_pyro.gone.rst").write_text("a module that held public names once\n")
    ext.write_api_pages(tmp_path)
    page = (tmp_path / "bayesncl_pyro.infer.elbo.rst").read_text()
    assert ".. currentmodule:: bayesncl_pyro" in page and ".. autoclass:: MeanFieldELBO" in page
    index = (tmp_path / "index.rst").read_text()
    assert ":py:obj:`bayesncl_pyro.MeanFieldELBO`" in index and "   bayesncl_pyro.infer.elbo\n" in index
    assert not (tmp_path / "bayesncl_pyro.gone.rst").exists()
    assert {p.stem for p in tmp_path.glob("*.rst")} == {"index", *ext.public_modules(), *ext.returned_modules(),
                                                         *ext.maths_modules()}


def test_an_indented_block_after_a_paragraph_of_a_docstring_is_shown_as_written():
    """The docstrings' code examples are indented blocks after a paragraph: reST wants ``::`` before them, or it runs
    their lines together as a quote. Lists, fields (napoleon's Args), directives and marked blocks keep theirs."""
    ext = docs_extension()
    lines = ["Summary.", "", "    a = 1", "    b = 2", "", "Text."]
    ext.literal_blocks(None, "module", "m", None, {}, lines)
    assert lines == ["Summary.", "", "::", "", "    a = 1", "    b = 2", "", "Text."]
    for kept in (["Layout::", "", "    x  y"], ["* an item", "", "    its paragraph"], [".. note::", "", "    a"],
                 [":param x: the x", "    of the y"], ["Summary.", "", "  two spaces: a quote"]):
        ext.literal_blocks(None, "module", "m", None, {}, lines := list(kept))
        assert lines == kept


def test_a_notebook_copy_whose_cells_changed_is_not_taken_as_executed(tmp_path):
    """An executed copy from before an edit of the notebook is stale: the site takes the notebook as stored."""
    ext = docs_extension()
    executed = tmp_path / "executed"
    executed.mkdir()
    nb = nbformat.read(OWN_PRIOR, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    nbformat.write(nb, executed / OWN_PRIOR.name)
    stale = nbformat.read(INSPECT, as_version=4)
    stale.cells[0].source += "\nan edit since the tests ran it"
    nbformat.write(stale, executed / INSPECT.name)
    found = ext.copy_notebooks(tmp_path / "out", executed)
    assert found[OWN_PRIOR.name] and not found[INSPECT.name]
    copied = nbformat.read(tmp_path / "out" / OWN_PRIOR.name, as_version=4)
    assert copied.cells[1].outputs[0].text == "ran\n" and copied.metadata.mystnb.execution_mode == "off"
    stored = nbformat.read(INSPECT, as_version=4)
    ext._site_links(stored)  # as stored, but its links to docs/ made right from the site's docs/notebooks/
    assert nbformat.read(tmp_path / "out" / INSPECT.name, as_version=4) == stored
    assert "](../docs/" in INSPECT.read_text() and "](../docs/" not in (tmp_path / "out" / INSPECT.name).read_text()


CODE_LINK = re.compile(r'<a class="reference internal" href="(api/[^"#]+)#([^"]+)"[^>]*><code class="xref py')


def _article(page: Path) -> str:
    """A page's own text, without the navigation around it."""
    html = page.read_text()
    return html[html.index("<article"):html.index("</article>")]


@pytest.mark.slow  # reads the whole site, whose build takes 25 s; .ci/run also builds it with -W
def test_every_equation_of_the_maths_page_is_followed_by_a_link_to_the_code_that_computes_it(site):
    """Each display equation of maths.md is followed, in the paragraph after it, by a link to the API entry of the code
    that computes it (whose [source] opens that code), and so is each gate estimator's row of its table; each link's
    entry exists."""
    html = _article(site / "maths.html")
    blocks = html.split('<div class="math notranslate nohighlight">')[1:]
    source = (DOCS / "maths.md").read_text().splitlines()
    assert len(blocks) == source.count("$$") // 2 >= 6
    for block in blocks:
        after = block.split("</div>", 1)[1].removeprefix("\n</div>")  # past the equation and its wrapper
        paragraph = re.match(r"\s*<p>(.*?)</p>", after, re.S)
        assert paragraph and CODE_LINK.search(paragraph.group(1)), block[:300]
    estimators = html[html.index('id="gate-estimators"'):html.index('id="the-bayesian-gating-head"')]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", estimators[estimators.index("<tbody"):], re.S)
    assert len(rows) == 5 and all(CODE_LINK.search(row) for row in rows)
    for page, anchor in CODE_LINK.findall(html):
        assert f'id="{anchor}"' in (site / page).read_text(), (page, anchor)


def test_a_guide_pages_link_to_code_that_names_nothing_fails_the_build(monkeypatch):
    """Outside its nitpicky mode Sphinx renders such a link as plain code, silently: the site's extension warns (so
    ``-W`` fails) for a link on a guide page or a notebook, not for the API pages' type hints (torch's types, which
    have no page here)."""
    logging = pytest.importorskip("sphinx.util.logging", reason="the documentation site's packages")
    said = []

    class Logger:
        def warning(self, message, *args, **kwargs):
            said.append(message % args)

    monkeypatch.setattr(logging, "getLogger", lambda name: Logger())
    ext = docs_extension()
    for refdoc, domain, target in (("maths", "py", "bayesncl_pyro.nope"), ("notebooks/inspect_gates", "py", "x.y"),
                                   ("api/bayesncl_pyro.config", "py", "torch.Tensor"), ("maths", "std", "nope")):
        ext.broken_code_link(None, None, {"refdomain": domain, "reftype": "func", "reftarget": target,
                                          "refdoc": refdoc}, None)
    assert [m.split(",")[0] for m in said] == ["func link to 'bayesncl_pyro.nope'", "func link to 'x.y'"]


def _pages() -> dict[str, Path]:
    """The site's pages written by hand, by their path on the site: docs/*.md (the README's and the changelog's parts
    included) and the notebooks."""
    return {p.stem: p for p in DOCS.glob("*.md")} | {f"notebooks/{p.stem}": p for p in NOTEBOOKS}


def unlinked_mentions(html: str, titles: set[str], files: set[str]) -> list[str]:
    """Where a page's text names another page (``docs/RESULTS.md``, ``inspect_gates.ipynb``, or a page's title in
    quotes) outside a link: each with the text around it. Code blocks and a code span that holds more than the name
    (a command such as ``git log -- docs/RESULTS.md``) are not mentions."""
    article = html[html.index("<article"):html.index("</article>")]
    article = re.sub(r"<a [^>]*>.*?</a>|<pre.*?</pre>", " ", article, flags=re.S)
    name = r"(?:docs/|notebooks/|\.\./)?(?:%s)" % "|".join(re.escape(f) for f in sorted(files))
    article = re.sub(r'<code class="docutils literal notranslate">(.*?)</code>', lambda m: m.group(0) if re.fullmatch(
        name, re.sub(r"<[^>]+>", "", m.group(1))) else " ", article, flags=re.S)
    text = html_module.unescape(re.sub(r"<[^>]+>", "", article))
    short = {re.split(r"[:,]", t)[0] for t in titles}  # "Looking at the gates" for "Looking at the gates, and ..."
    found = [m for m in re.finditer(r"\b" + name + r"\b", text)]
    found += [m for m in re.finditer(r"[\"\u201c]([^\"\u201d]{3,90})[\"\u201d]", text) if m.group(1) in titles | short]
    return [text[max(0, m.start() - 50):m.end() + 20] for m in found]


@pytest.mark.slow  # reads the whole site, whose build takes 25 s; .ci/run also builds it with -W
def test_the_pages_mention_other_pages_only_as_links(site):
    """A page that names another (``docs/RESULTS.md``, a notebook, a page's title in quotes) links it, so that the
    site resolves it (the build fails on a link to no page); the README's links are repository paths that work on
    GitHub and that the site's pages rewrite (``:relative-docs:``). The API pages are the docstrings', read in a
    terminal too."""
    pages = _pages()
    titles = {_title(path).replace("`", "") for path in pages.values()}
    files = {path.name for path in pages.values()}
    for page in pages:
        assert not unlinked_mentions((site / f"{page}.html").read_text(), titles, files), page
    # what the check finds: a page's file named in text or as code, a title quoted; not a command, a link or a block
    html = ('<article><p>see docs/RESULTS.md, <code class="docutils literal notranslate"><span class="pre">'
            'inspect_gates.ipynb</span></code> and \u201cLooking at the gates\u201d; <code class="docutils literal '
            'notranslate">git log -- docs/RESULTS.md</code>, <a href="RESULTS.html">docs/RESULTS.md</a></p>'
            "<pre>docs/  METHOD.md</pre></article>")
    assert len(unlinked_mentions(html, titles, files)) == 3


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (as MyST's ``myst_heading_anchors`` does): lower case, punctuation
    dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_the_readmes_links_work_on_github(name):
    """The README and the changelog are read on GitHub as well as on the site: each relative link names a file of the
    repository from its root, and its anchor a heading of that file."""
    text = re.sub(r"```.*?```", "", (ROOT / name).read_text(), flags=re.S)
    links = [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", link)]
    assert len(links) >= 5
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / (path or name)
        assert target.exists(), link
        if anchor:
            assert anchor in {_github_anchor(h) for h in re.findall(r"^#+ (.*)$", target.read_text(), re.M)}, link


# -- in a browser ----------------------------------------------------------------------------------------------


def _open(tab, page: Path):
    tab.page.goto(page.resolve().as_uri())
    tab.page.wait_for_load_state("load")


@pytest.mark.slow  # reads the whole site, whose build takes 25 s; .ci/run also builds it with -W
def test_in_chromium_the_index_shows_the_navigation(site, tab):
    _open(tab, site / "index.html")
    nav = tab.page.locator(".sidebar-drawer .sidebar-tree")
    assert nav.is_visible()
    links = {a.inner_text().strip(): a.get_attribute("href") for a in nav.locator("a.reference").all()}
    expected = [_title(p) for p in DOCS.glob("*.md") if p.stem != "index"] + [_title(p) for p in NOTEBOOKS]
    expected += ["API reference"]
    for title in expected:
        title = title.replace("`", "")
        assert any(t.replace("\u2019", "'") == title for t in links), (title, sorted(links))
    assert all((site / href).exists() for href in links.values())
    for caption in ("Guide", "Notebooks", "Reference", "Background"):
        assert tab.page.locator(".sidebar-tree p.caption", has_text=caption).is_visible()
    # the API reference, one click away, lists every public name as a link to its entry in its first table, and in
    # its second ("What they give back") what they return, each a link into its module's page
    tab.page.click(".sidebar-tree a:text-is('API reference')")
    tab.page.wait_for_url("**/api/index.html")
    public, returned = (tab.page.locator(f"article section#{s} > .table-wrapper a.reference") for s in ("api-reference",
                                                                                             "what-they-give-back"))
    names = public.locator("code").all_inner_texts()
    assert sorted(n.removeprefix("bayesncl_pyro.") for n in names) == bayesncl_pyro.__all__
    assert "bayesncl_pyro.evaluate.run.TrainedRun" in returned.locator("code").all_inner_texts()
    for link in public.all() + returned.all():
        page, _, anchor = link.get_attribute("href").partition("#")
        target = (site / "api" / page).resolve()
        assert target.is_file() and (not anchor or f'id="{anchor}"' in target.read_text()), link.get_attribute("href")
    assert tab.errors == [] and all(url.startswith("file://") for url in tab.requests)  # nothing from the network


@pytest.mark.slow
def test_in_chromium_a_notebook_page_shows_its_figures_and_maths(executed_notebook, tmp_path, tab):
    """inspect_gates.ipynb, as its test ran it: its five figures drawn, its report inline, its maths typeset by the
    MathJax the site ships."""
    html = build_site(tmp_path, [INSPECT], executed_notebook)
    _open(tab, html / "notebooks" / "inspect_gates.html")
    figures = tab.page.locator("article .cell_output img")
    assert figures.count() == 5
    for i in range(5):
        figures.nth(i).scroll_into_view_if_needed()
        assert figures.nth(i).is_visible()
        assert figures.nth(i).evaluate("img => img.complete && img.naturalWidth > 100 && img.naturalHeight > 100")
    assert tab.page.locator("article .cell_output iframe").count() == 2
    tab.page.wait_for_selector("mjx-container")
    assert tab.errors == [] and all(url.startswith(("file://", "about:", "data:")) for url in tab.requests)
