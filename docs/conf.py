"""Sphinx configuration: `make docs` builds docs/_build/html, warnings as errors.

The guide pages include sections of README.md (between <!-- docs:NAME -->
markers), so the README and the docs never disagree; the API page is
autodoc over the package's docstrings (napoleon reads their sections)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "python")))
from mpidp._version import __version__  # noqa: E402

project = "mpidp"
author = "the mpidp developers"
copyright = "2026, the mpidp developers"
release = version = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "gpu-runs"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True     # `comm=MPI.COMM_WORLD`, not the object's repr
autodoc_inherit_docstrings = False   # torch.nn.Module's forward() text is not ours
html_theme = "alabaster"
html_theme_options = {"description": "data-parallel PyTorch over MPI", "fixed_sidebar": True,
                      "page_width": "1240px", "sidebar_width": "230px"}  # code lines of 90+ columns
