"""Sphinx configuration of the documentation site (``sphinx-build -W docs docs/_build/html``).

The API pages and the notebook pages are generated when the build starts (``_ext/bayesncl_docs.py``); the
notebooks are taken executed from the tests' copies where those have the same cells, and executed here otherwise
(``-D nb_execution_mode=off`` renders them without outputs instead), in a temporary folder: their runs leave nothing
in docs/. Nothing is fetched from the network, and the theme's assets are in its package. So there is no intersphinx:
torch, Pyro and ArviZ publish their ``objects.inv`` only on their sites, and no installed package ships one (none in
the environment the site is built in), so their names are not links.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

from bayesncl_pyro import __version__  # noqa: E402 -- the package is installed (pip install -e '.[docs]')

project = "bayesncl-pyro"
author = "the bayesncl-pyro developers"
copyright = "2026, " + author  # noqa: A001 -- Sphinx's name
release = version = __version__

# viewcode: a [source] link beside every documented name, to the code as the site holds it (no network)
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "sphinx-mathjax-offline",
              "sphinx.ext.viewcode", "sphinx_copybutton", "myst_nb", "bayesncl_docs"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
# docs/results/ and docs/gpu/ hold the records the pages cite (comparison tables of runs), not pages
exclude_patterns = ["_build", "_ext", "_static", "results", "gpu", "**/.ipynb_checkpoints"]

# the Google-style docstrings that ruff enforces ([tool.ruff.lint.pydocstyle]), type hints in the descriptions
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
add_module_names = False

# MyST: $...$ maths as in the notebooks, headings get anchors for links between pages
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 4
suppress_warnings = ["myst.header"]  # the Markdown files start at "#" and may skip levels, as GitHub renders them

# myst-nb: a notebook copy that came executed is marked execution_mode "off" in its metadata; the others run here
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_merge_streams = True
nb_execution_in_temp = True  # a notebook works from the folder it runs in (its runs/): a temporary one here

# a block without a language (sample output, the layout list) is shown as it is
highlight_language = "none"

html_theme = "furo"
html_title = f"bayesncl-pyro {release}"
html_static_path = ["_static"]
html_css_files = ["bayesncl.css"]  # code wrapped, not scrolled sideways; long outputs in a box of their own
# the copy button copies a command without its prompt or its output
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = False
