"""Sphinx configuration of the API reference (docs/api.md says how to build it and why Sphinx)."""

project = "tiered_emb"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# the docstrings are numpydoc (STYLE.md); napoleon reads that format and nothing else
napoleon_numpy_docstring = True
napoleon_google_docstring = False
# members that have a docstring, in source order, with their bases (an error's builtin shows)
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True, "no-value": True}
autodoc_typehints = "description"
html_theme = "alabaster"
html_static_path: list[str] = []
exclude_patterns = ["_build"]
