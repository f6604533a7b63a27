"""Sphinx configuration of blockflow's documentation site.

Built by the test command with warnings as errors (``sphinx-build -W -b html docs
docs/_build/html``) and offline: no intersphinx inventory is fetched. The configuration
reference and the benchmark pages are generated at build time by ``_ext/blockflow_docs.py``
from ``blockflow/blockflow-schema.yaml``, ``blockflow/blockflow.yaml`` and
``benchmarks/results/``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # blockflow from this checkout, installed or not

project = "blockflow"
author = "the blockflow developers"
copyright = "the blockflow developers"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
    "blockflow_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated"]  # _generated: included by pages
templates_path = ["_templates"]

# API reference: one generated page per public name (docs/api/generated/, not committed).
autosummary_generate = True  # set to the API pages by _ext/blockflow_docs.py
autosummary_imported_members = True
autodoc_default_options = {"members": False}
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types

# numpydoc renders the sections; the class pages list members through autosummary instead.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks: set[str] = set()
numpydoc_xref_param_type = False

# MyST: the user guide is Markdown, moved from the README; headings get anchors for links.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "pydata_sphinx_theme"
html_title = "blockflow"
html_show_sourcelink = False
html_static_path = ["_static"]
html_css_files = ["blockflow.css"]  # code blocks wrap, sidebars narrower (1280 px screens)
# One sidebar, at the left: a section's pages (the guide's, the API modules, the benchmarks)
# and this page's headings under them, so the text column keeps the width code needs at
# 1280 px. A page that is a section of its own has its headings at the right instead.
html_sidebars = {"**": ["sidebar-nav-bs", "page-toc"], "index": [], "configuration": []}
html_theme_options = {
    "navbar_align": "left",
    "header_links_before_dropdown": 4,  # the four sections: one row of the top bar
    "navbar_persistent": ["search-button"],  # an icon, not a field
    "navbar_end": ["theme-switcher"],
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "show_prev_next": True,
    "secondary_sidebar_items": {"**": [], "index": ["page-toc"],
                                "configuration": ["page-toc"]},
    "primary_sidebar_end": [],
    "footer_start": ["copyright"],
    "footer_end": [],
}
