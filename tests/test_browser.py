"""The course in a real browser: JupyterLab, chromium, Run All, and what a learner would see.

JupyterLab starts on loopback (a free port, no token) with the course's own settings
(jupyter/), chromium (Debian's, driven by playwright) opens each notebook that shows widgets,
runs all cells, and checks that every code cell finished, that no output says "Error
displaying widget" or holds a traceback the notebook did not expect (cells tagged
``raises-exception`` fail on purpose), and that the browser's console has no errors. Where a
notebook has them, the memory calculator's slider must change its numbers and a quiz's Check
button must give feedback. Full-page screenshots go to test-artifacts/. At the end JupyterLab,
its kernels and their ranks are stopped, and no process of theirs is left.

Locally these tests skip, with the reason, without chromium or playwright; under CI=true
(.ci/run installs both) a missing browser fails them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from support import slowdown

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("SHARDLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
#: Widget kinds and the words that give them away in a notebook's source.
WIDGETS = {
    "calculator": ("memory_calculator", "calculator_widget"),
    "quiz": ("quiz.show", "display_questions", "course import quiz"),
    "ipywidgets": ("ipywidgets",),
}
#: Notebook 00 always: its start-up bar is a widget, and it is the course's model notebook.
ALWAYS = ("00_start_here.ipynb",)


def widget_notebooks(every: bool | None = None) -> list[Path]:
    """The notebooks to open: 00, and the first notebook showing each kind of widget.

    One notebook per kind keeps the browser tests within 3 minutes on 2 cores (every notebook
    also runs under nbval); ``SHARDLAB_BROWSER_ALL=1`` opens every notebook with widgets.
    """
    if every is None:
        every = os.environ.get("SHARDLAB_BROWSER_ALL", "") not in ("", "0")
    chosen, seen = [], set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        source = nb.read_text()
        kinds = {k for k, words in WIDGETS.items() if any(w in source for w in words)}
        if nb.name in ALWAYS or (kinds - seen) or (every and kinds):
            chosen.append(nb)
        seen |= kinds
    return chosen


def _browser_or_skip():
    ci = os.environ.get("CI", "").lower() == "true"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "playwright is not installed (pip install playwright)"
        pytest.fail(why) if ci else pytest.skip(why)
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        why = f"no chromium at {CHROMIUM} (apt-get install chromium)"
        pytest.fail(why) if ci else pytest.skip(why)
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on loopback, no token, the course's settings; stopped with all it started."""
    sync_playwright = _browser_or_skip()
    home = tmp_path_factory.mktemp("lab")
    # JupyterLab saves what it runs: serve a copy of the course, never the checkout's notebooks
    course = home / "course"
    shutil.copytree(ROOT / "notebooks", course / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_PATH=str(ROOT / "jupyter" / "etc" / "jupyter"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--IdentityProvider.token=", "--ServerApp.password=", "--allow-root",
           f"--ServerApp.root_dir={course}", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.app_settings_dir={ROOT / 'jupyter' / 'share' / 'jupyter' / 'lab' / 'settings'}",
           f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'ws'}"]
    log = open(home / "jupyter.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started: set[int] = set()
    try:
        deadline = time.monotonic() + slowdown(60)
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (home / "jupyter.log").read_text()[-3000:]) from None
                time.sleep(0.3)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield {"url": url, "browser": browser, "started": started, "log": home / "jupyter.log"}
            finally:
                browser.close()
    finally:
        started |= _family(server.pid)
        server.send_signal(signal.SIGTERM)  # JupyterLab shuts its kernels down; they stop their ranks
        try:
            server.wait(slowdown(30))
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()
    deadline = time.monotonic() + slowdown(15)
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(started)
    assert not left, f"processes left after JupyterLab stopped: {[_describe(p) for p in left]}"


def _family(pid: int) -> set[int]:
    try:
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _describe(pid: int) -> str:
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}"
    except psutil.NoSuchProcess:
        return str(pid)


# What the notebook looks like to JupyterLab: per code cell, its prompt, error outputs and tags.
_CELLS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  return panel.content.widgets.filter(c => c.model.type === 'code').map(c => ({
    prompt: c.node.querySelector('.jp-InputPrompt')?.textContent ?? '',
    count: c.model.executionCount,
    tags: c.model.getMetadata('tags') ?? [],
    errors: c.model.outputs.toJSON().filter(o => o.output_type === 'error')
              .map(o => o.ename + ': ' + o.evalue),
    text: c.node.querySelector('.jp-Cell-outputWrapper')?.innerText ?? '',
  }));
}"""


def _run_all(page, notebook: Path, budget: float) -> list[dict]:
    page.goto(f"{page.lab_url}/lab/tree/notebooks/{notebook.name}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel",
                           timeout=slowdown(60) * 1000)
    page.evaluate("async () => { const w = window.jupyterapp.shell.currentWidget;"
                  " await w.sessionContext.ready; await w.context.ready; }")
    _start_run_all(page)
    deadline, again = time.monotonic() + budget, time.monotonic() + slowdown(10)
    while True:
        cells = page.evaluate(_CELLS_JS)
        if again and time.monotonic() > again:  # the command came before the notebook was current
            again = None
            if all(c["count"] is None and "*" not in c["prompt"] for c in cells):
                _start_run_all(page)
        if cells and all(c["count"] is not None and "*" not in c["prompt"] for c in cells):
            return cells
        if time.monotonic() > deadline:
            waiting = [i for i, c in enumerate(cells) if c["count"] is None or "*" in c["prompt"]]
            log = Path(page.lab_log).read_text(errors="replace")[-3000:]  # a log still being written
            try:
                kernel = page.evaluate(_KERNEL_JS)
            except Exception as exc:  # noqa: BLE001 - the message above must still be told
                kernel = f"unknown ({exc})"
            pytest.fail(f"{notebook.name}: code cells {waiting} did not finish within {budget:.0f} s;"
                        f" kernel {kernel}\nJupyterLab's log ends:\n{log}")
        page.wait_for_timeout(250)


def _start_run_all(page) -> None:
    """Start Run All and return at once.

    The command's promise settles only when the last cell has run, and ``page.evaluate`` waits for
    a returned promise: returning it would leave a stalled cell to pytest-timeout's limit,
    with no word of which cell. The polling loop above owns the deadline and says which.
    """
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells')"
                  ".catch(e => console.error('run-all-cells: ' + e)); }")


# The notebook's kernel as JupyterLab sees it, for a failure message.
_KERNEL_JS = """() => {
  const k = window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel;
  return k ? {status: k.status, connection: k.connectionStatus} : 'none';
}"""


def _check_slider(page, notebook: Path) -> None:
    """Moving the calculator's model-size slider changes the numbers it shows."""
    calc = page.locator(".widget-vbox:has(.widget-slider)").last
    before = calc.inner_text()
    handle = calc.locator(".widget-slider .noUi-handle, .widget-slider [role=slider]").first
    handle.focus()
    for _ in range(5):
        handle.press("ArrowRight")
    page.wait_for_function(
        "([el, before]) => el.innerText !== before", arg=[calc.element_handle(), before],
        timeout=slowdown(15) * 1000)
    numbers = lambda s: re.findall(r"\d+(?:\.\d+)?", s)  # noqa: E731
    assert numbers(calc.inner_text()) != numbers(before), f"{notebook.name}: the slider changed no number"


def _check_quiz(page, notebook: Path) -> None:
    """Picking an answer and pressing Check shows feedback."""
    check = page.locator(".jupyter-widgets button", has_text=re.compile(r"^\s*Check\s*$")).first
    question = page.locator(".widget-vbox", has=check).last
    before = question.inner_text()
    choice = question.locator(".widget-radio-box input, .widget-checkbox input").first
    choice.check()
    check.click()
    page.wait_for_function(
        "([el, before]) => el.innerText.trim().length > before.trim().length",
        arg=[question.element_handle(), before], timeout=slowdown(15) * 1000)


@pytest.mark.parametrize("notebook", widget_notebooks(), ids=lambda nb: nb.name)
def test_a_notebook_runs_in_the_browser_with_working_widgets(lab, notebook):
    t0 = time.perf_counter()
    page = lab["browser"].new_page(viewport={"width": 1400, "height": 1000})
    page.lab_url, page.lab_log = lab["url"], lab["log"]
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    try:
        cells = _run_all(page, notebook, budget=slowdown(120))
        ARTIFACTS.mkdir(exist_ok=True)
        if page.locator(".widget-slider").count():
            _check_slider(page, notebook)
        if page.locator(".jupyter-widgets button", has_text=re.compile(r"^\s*Check\s*$")).count():
            _check_quiz(page, notebook)
        page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}.png"), full_page=True)
        # bounded, as Run All is: the fixture's end checks that no kernel or rank is left
        page.evaluate("ms => Promise.race([window.jupyterapp.commands.execute('kernelmenu:shutdown'),"
                      " new Promise(done => setTimeout(done, ms))])", slowdown(30) * 1000)
    finally:
        page.close()
    for i, cell in enumerate(cells):
        assert "Error displaying widget" not in cell["text"], f"{notebook.name} code cell {i}: {cell['text'][:500]}"
        if "raises-exception" not in cell["tags"]:
            assert not cell["errors"], f"{notebook.name} code cell {i} raised: {cell['errors']}"
    assert not console, f"{notebook.name}: browser console errors: {console}"
    print(f"\n{notebook.name} in the browser: {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def test_the_browser_list_follows_the_notebooks():
    """The list is found, not written down: 00, plus a notebook for every kind of widget."""
    names = [nb.name for nb in widget_notebooks(every=False)]
    assert names[0] == "00_start_here.ipynb"
    everything = [nb.name for nb in widget_notebooks(every=True)]
    assert set(names) <= set(everything)
    for kind, words in WIDGETS.items():
        having = [nb.name for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
                  if any(w in "".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"])
                         for w in words)]
        if having:
            assert having[0] in names, (kind, having)
            assert set(having) <= set(everything), kind


def test_chromium_is_present_under_ci():
    """Under CI=true the browser tests must run, not skip."""
    if os.environ.get("CI", "").lower() != "true":
        pytest.skip("only checked under CI=true")
    assert shutil.which("chromium") or os.path.exists(CHROMIUM), "CI must install chromium (.ci/run)"
