"""The course website (`make site`, _build/html) in a real browser, as a learner reads it.

For every notebook under notebooks/ its page must load and show what the notebook printed when
`make site` ran it (_build/executed/): one output block per code cell that had output, at least
its figures, the traceback only where a cell is tagged ``raises-exception``, no broken widget,
no quiz answer, and a box naming the file and the two commands that run it. Every lab is there
in its student version (nothing from labs/solutions/), every docs/*.md and the workshop's
README and agenda are pages, every internal link and anchor resolves, and the build info names
torch, the ranks and the CPU. A missing or empty page fails.

The site is served on loopback; requests that leave the machine (fonts, MathJax) are refused,
as they would fail here anyway. Screenshots go to test-artifacts/site-*.png. Without a built
site these tests skip locally (run `make site`) and fail under CI=true, where `make test` builds it.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _browser_or_skip

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SHARDLAB_SITE_DIR", ROOT / "_build" / "html"))
EXECUTED = SITE.parent / "executed" / "notebooks"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
MARKDOWN_PAGES = [*(f"docs/{p.stem}.html" for p in sorted((ROOT / "docs").glob("*.md"))),
                  "workshop/README.html", "workshop/AGENDA.html", "index.html", "about.html", "build-info.html"]
#: What a widget shows on a page without a kernel when it did not fall back to text.
BROKEN_WIDGET = ("Error displaying widget", "model not found", "Loading widget", "Box(children=")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury pytest's report
        pass


def _site_or_skip() -> Path:
    if not (SITE / "index.html").exists():
        why = f"no built site at {SITE} (run `make site` first)"
        pytest.fail(why) if os.environ.get("CI", "").lower() == "true" else pytest.skip(why)
    return SITE


@pytest.fixture(scope="module")
def browser():
    """Chromium on the built site, served on loopback; everything off the machine refused."""
    site = _site_or_skip()
    sync_playwright = _browser_or_skip()
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}/"
    try:
        with sync_playwright() as p:
            chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield base, chromium
            finally:
                chromium.close()
    finally:
        server.shutdown()
        server.server_close()


def open_page(browser, path: str, shot: str | None = None):
    """(page, console errors) for one page of the site; fails if it is missing or empty."""
    base, chromium = browser
    assert (SITE / path).is_file(), f"{path} is missing from the built site"
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
    response = page.goto(base + path)
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    text = page.inner_text("article")
    assert len(text.split()) > 30, f"{path} is empty ({len(text.split())} words)"
    if shot:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / shot))
    # a refused request off the machine logs a net error: not the page's fault
    return page, [e for e in errors if "net::ERR_FAILED" not in e]


def quiz_texts() -> list[str]:
    """What a quiz shows only after an answer: the explanations, from the package's banks."""
    from shardlab.course import quiz_bank

    return [q.explanation for q in quiz_bank.all_questions().values()]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_page_shows_every_output(browser, notebook):
    page_path = f"notebooks/{notebook.stem}.html"
    page, errors = open_page(browser, page_path, shot=f"site-{notebook.stem}.png")
    try:
        source = [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
        ran_path = EXECUTED / notebook.name
        assert ran_path.exists(), f"no executed copy of {notebook.name} in {EXECUTED}"
        ran = [c for c in nbformat.read(ran_path, as_version=4).cells if c.cell_type == "code"]
        assert [c.source for c in ran] == [c.source for c in source], \
            f"the site shows an older {notebook.name}: run `make site` again"
        cells = page.locator("article div.cell")
        assert cells.count() == len(source), f"{page_path}: {cells.count()} code cells, the notebook has {len(source)}"
        with_output = sum(bool(c.outputs) for c in ran)
        assert with_output > 0, f"{notebook.name} printed nothing when the site ran it"
        shown = page.locator("article div.cell div.cell_output")
        assert shown.count() == with_output, f"{page_path}: {shown.count()} outputs shown, {with_output} expected"
        figures = sum("image/png" in o.get("data", {}) for c in ran for o in c.outputs)
        drawn = page.locator("article div.cell_output img")
        assert drawn.count() >= figures, f"{page_path}: {drawn.count()} figures shown, {figures} expected"
        for i in range(drawn.count()):  # each figure really loaded
            assert drawn.nth(i).evaluate("img => img.complete && img.naturalWidth > 0"), f"{page_path}: figure {i} did not load"

        for i, src in enumerate(source):
            expected = "raises-exception" in src.metadata.get("tags", [])
            out = cells.nth(i).locator("div.cell_output")
            shown_text = out.inner_text() if out.count() else ""
            has_error = out.locator(".traceback").count() > 0 or "Traceback (most recent call last)" in shown_text
            assert has_error == expected, (f"{page_path}, code cell {i}: " + (
                "the error this cell shows on purpose is missing" if expected else f"an error: {shown_text[-600:]}"))
            if expected:  # named as the page labels the cell (nbval alone numbers every cell In[1])
                assert f"Cell In[{i + 1}]" in shown_text, f"{page_path}, code cell {i}: its traceback names another cell"
        text = page.inner_text("article")
        for words in BROKEN_WIDGET:
            assert words not in text, f"{page_path}: a widget did not fall back to text ({words!r})"
        assert "✓ Right" not in text, f"{page_path}: a quiz printed its answer"
        if re.search(r"quiz\.(show|final)\(", "".join(c.source for c in source)):
            assert "answer with: quiz.answer(" in text, f"{page_path}: the quiz's plain-text version is missing"
            assert ", numbers for " not in text, f"{page_path}: a quiz shows one learner's numbers, not the written ones"
        for explanation in quiz_texts():
            assert explanation not in text, f"{page_path}: a quiz's explanation (its answer) is on the page"
        for words in (f"notebooks/{notebook.name}", "make lab", "make test", "torch "):
            assert words in text, f"{page_path}: the 'run it yourself' box lacks {words!r}"
        assert not errors, f"{page_path}: console errors {errors}"
    finally:
        page.close()


def test_each_page_is_the_nbval_run_of_todays_notebook():
    """`make test` runs each notebook once: nbval's run, with the site's settings, is what the
    page shows (website/nbval_copies.py's --site-copies), and a copy's key names the notebook and package
    that are here now."""
    _site_or_skip()
    import importlib.util

    spec = importlib.util.spec_from_file_location("site_execute", ROOT / "website" / "execute.py")
    execute = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(execute)
    for notebook in NOTEBOOKS:
        meta = nbformat.read(EXECUTED / notebook.name, as_version=4).metadata.get("shardlab_site", {})
        assert meta.get("key") == execute.key_of(notebook), f"{notebook.name}: the site shows another version's run"
        if os.environ.get("CI", "").lower() == "true":
            assert meta.get("by") == "nbval", f"{notebook.name}: ran by {meta.get('by')!r}, not by make test's nbval run"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_page_is_the_student_version(browser, lab):
    page_path = f"labs/{lab.stem}.html"
    page, errors = open_page(browser, page_path)
    try:
        text = page.inner_text("article")
        student = [c for c in nbformat.read(lab, as_version=4).cells if c.cell_type == "code"]
        assert page.locator("article div.cell").count() == len(student)
        assert page.locator("article div.cell_output").count() == 0, f"{page_path}: a lab page shows outputs"
        for words in (f"labs/{lab.name}", "checks run on your machine", "make lab", "make test"):
            assert words in text, f"{page_path} lacks {words!r}"
        solution = ROOT / "labs" / "solutions" / lab.name
        if solution.exists():
            mine = {line.strip() for c in student for line in c.source.splitlines()}
            answer_lines = {line.strip() for c in nbformat.read(solution, as_version=4).cells if c.cell_type == "code"
                            for line in c.source.splitlines() if len(line.strip()) > 25} - mine
            code = page.locator("article div.cell_input").all_inner_texts()
            leaked = [line for line in answer_lines if any(line in block for block in code)]
            assert not leaked, f"{page_path} shows solution lines: {leaked[:3]}"
        assert not errors, f"{page_path}: console errors {errors}"
    finally:
        page.close()


def test_no_solution_is_on_the_site():
    site = _site_or_skip()
    assert not [p for p in site.rglob("*") if "solutions" in p.relative_to(site).parts]


@pytest.mark.parametrize("path", MARKDOWN_PAGES)
def test_markdown_page_is_there_and_says_how_to_run(browser, path):
    page, errors = open_page(browser, path, shot="site-index.png" if path == "index.html" else None)
    try:
        text = page.inner_text("article")
        assert "make lab" in text and "make test" in text, f"{path}: no 'run it' commands"
        assert not errors, f"{path}: console errors {errors}"
    finally:
        page.close()


def test_build_info_names_torch_ranks_and_cpu(browser):
    import torch

    page, _ = open_page(browser, "build-info.html")
    try:
        text = page.inner_text("article")
        assert re.search(rf"torch\s+{re.escape(torch.__version__)}", text), "build info lacks torch's version"
        assert "ranks per notebook" in text and "CPU" in text and "cores" in text
        footer = " ".join(page.locator("footer").all_inner_texts())
        assert "torch" in footer and "ranks" in footer and "cores" in footer, f"footer: {footer!r}"
        for notebook in NOTEBOOKS:
            assert f"notebooks/{notebook.name}" in text, f"build info lacks {notebook.name}"
    finally:
        page.close()


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for name in ("href", "src"):
            if a.get(name) and tag in ("a", "img", "link", "script"):
                self.links.append(a[name])


@functools.cache
def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def test_internal_links_resolve():
    """Every relative link, image, stylesheet and script of every page points at a file that
    exists, and every #anchor at an element of that page."""
    site = _site_or_skip()
    broken = []
    pages = [p for p in site.rglob("*.html") if "_static" not in p.parts]
    assert len(pages) >= len(NOTEBOOKS) + len(LABS) + len(MARKDOWN_PAGES)
    for page in pages:
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file() or not target.resolve().is_relative_to(site.resolve()):
                broken.append(f"{page.relative_to(site)} -> {link}")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in _parse(target).ids:
                broken.append(f"{page.relative_to(site)} -> {link} (no such anchor)")
    assert not broken, f"{len(broken)} broken internal links: {broken[:10]}"


def test_every_markdown_link_in_the_sources_became_a_link_or_text():
    """No page shows raw markdown of a link the builder could not resolve."""
    site = _site_or_skip()
    leftovers = [str(p.relative_to(site)) for p in site.rglob("*.html") if "_static" not in p.parts
                 and re.search(r"\]\((?!http)[^)\s]+\.(md|ipynb)\)", p.read_text(encoding="utf-8"))]
    assert not leftovers, f"unrendered markdown links in {leftovers}"


def test_no_page_shows_raw_table_markup():
    """A Markdown table the renderer did not turn into a table shows as a paragraph of pipes.

    MyST-NB renders a cell's ``text/markdown`` output as CommonMark, which has no tables, so such
    output must be HTML (as :func:`shardlab.course.stacks.show` gives). Code blocks may show pipes.
    """
    site = _site_or_skip()
    raw = re.compile(r"\|\s*:?-{3,}:?\s*\|")
    broken = []
    for page in site.rglob("*.html"):
        if "_static" in page.parts:
            continue
        html = re.sub(r"<pre.*?</pre>", "", page.read_text(encoding="utf-8"), flags=re.S)
        if raw.search(html):
            broken.append(str(page.relative_to(site)))
    assert not broken, f"raw Markdown table markup on {broken}"
