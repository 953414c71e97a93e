"""Sphinx configuration: the API pages come from the docstrings (autodoc + napoleon, Google style); pages are
Markdown (myst-parser). Built in CI with warnings as errors: `python -m sphinx -W --keep-going -b html docs
docs/_build/html` (needs the `docs` extra)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # importing the ops defines Triton kernels; no GPU needed

from dtkv import __version__  # noqa: E402

project = "dtkv"
author = "the dtkv authors"
copyright = "2026, the dtkv authors"
version = release = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
nitpicky = False
suppress_warnings = ["myst.header"]

html_theme = "alabaster"
html_title = f"dtkv {__version__}"
html_theme_options = {"description": "Page-ownership-sharded KV caches on torch.distributed", "page_width": "1180px"}
