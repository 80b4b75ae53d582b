"""Sphinx settings for the course website (copied beside the pages by website/build.py).

MyST-NB renders the notebooks as they were executed by website/execute.py: it runs nothing
itself. sphinx-book-theme is the Jupyter Book theme; both come from PyPI and need no network.
"""

import json
from pathlib import Path

info = json.loads(Path(__file__).with_name("build_info.json").read_text())

project = "ShardLab"
author = "the ShardLab authors"
copyright = "ShardLab authors, MIT licence"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "build_info.json"]
master_doc = "index"

# The notebooks were run once already (website/execute.py); here they are only rendered.
nb_execution_mode = "off"
nb_merge_streams = True
# A page has no kernel: a widget's view can never draw, so its text is shown instead.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None),
                              ("html", "application/vnd.jupyter.widget-state+json", None)]
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 4  # GitHub-style anchors, so the repository's #section links resolve
suppress_warnings = ["mystnb.unknown_mime_type"]

html_theme = "sphinx_book_theme"
html_title = "ShardLab: ZeRO and FSDP, built and measured"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_last_updated_fmt = None
html_context = {"default_mode": "light"}  # the theme logs an error on a first visit without it
html_show_sourcelink = False
ranks = " or ".join(str(r) for r in info["ranks"]) or "no"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "extra_footer": (f"<p class='shardlab-build'>Outputs executed once with torch {info['torch']}, "
                     f"{ranks} ranks ({info['backend']}), on {info['cpu']} ({info['cores']} cores), "
                     f"{info['built_at']}, ShardLab {info['commit']}. "
                     "Run it yourself: <code>make lab</code>, <code>make test</code>.</p>"),
}
