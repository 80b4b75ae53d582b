"""A pytest plugin: the nbval run of notebooks/ is the website's run (``--site-copies DIR``).

``make test`` loads it (``-p website.nbval_copies``) for its first step, so that the notebooks run
once and the site is built from that run. Each notebook under ``notebooks/`` (or under
``--site-notebooks``) then runs as the website shows it, with website/execute.py's settings:
the widgets' plain-text fallback, no ``SHARDLAB_LEARNER``, text progress bars (``KERNEL_SETUP``,
run before the first cell; a set-up that fails fails that cell). Every notebook whose cells all
ran and passed is kept in DIR, as ``make site`` would have executed it; a failed or partly run
one (a cell deselected or skipped) is not kept, and ``make site`` runs it again.

Each cell runs with ``store_history=True``, as nbclient runs it for ``make site``: nbval's own
``store_history=False`` leaves IPython's count at 1, so every traceback on the page would read
``Cell In[1]`` beside a cell labelled ``[13]``. The widgets themselves are run in a real browser
by tests/test_browser.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def pytest_addoption(parser):
    parser.addoption("--site-copies", metavar="DIR", default=None,
                     help="run notebooks/ with the website's settings and keep each executed copy in DIR")
    parser.addoption("--site-notebooks", metavar="DIR", default=str(ROOT / "notebooks"),
                     help="the folder whose notebooks --site-copies keeps (default: notebooks/)")


def _site():
    """website/execute.py, which owns the site's settings and the copies' format."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import execute

    return execute


class _Copy:
    """One notebook's run: its key before the first cell, each cell's outputs, pass or fail."""

    def __init__(self, path: Path):
        self.path, self.key, self.outputs, self.failed = path, _site().key_of(path), {}, False
        self.started = time.perf_counter()


_copies: dict[Path, _Copy] = {}


def _site_notebook(item) -> Path | None:
    """The notebook this nbval cell belongs to, when --site-copies is on and it is one the site shows."""
    if not item.config.getoption("site_copies", None) or not hasattr(item, "cell_num"):
        return None
    path = Path(str(item.fspath)).resolve()
    return path if path.parent == Path(item.config.getoption("site_notebooks")).resolve() else None


def _numbered(kernel) -> None:
    """Run each cell as nbclient does, ``store_history=True``: IPython counts the cells, and a
    traceback names the cell ``Cell In[n]`` as the page labels it."""
    def execute_cell_input(cell_input, allow_stdin=None):
        return kernel.kc.execute(cell_input, store_history=True, allow_stdin=allow_stdin, stop_on_error=False)

    kernel.execute_cell_input = execute_cell_input


def _set_up(kernel, code: str, timeout: float = 60) -> None:
    """Run ``code`` before the first cell, taking no number; raise if it failed."""
    msg_id = kernel.kc.execute(code, store_history=False, allow_stdin=False, stop_on_error=False)
    while True:
        reply = kernel.get_message(stream="shell", timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    kernel.await_idle(msg_id, timeout)
    content = reply["content"]
    if content.get("status") != "ok":
        raise RuntimeError(f"the site's kernel set-up failed: {content.get('ename')}: {content.get('evalue')}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    path = _site_notebook(item)
    if path is None or item.parent.kernel is not None:
        return (yield)
    site = _site()
    _copies[path] = _Copy(path)
    with site.site_environment():  # the kernel starts in this setup, and keeps what it inherits
        result = yield
    kernel = item.parent.kernel
    if kernel is not None and kernel.is_alive():  # text progress bars, before the first cell
        _set_up(kernel, site.KERNEL_SETUP)
        _numbered(kernel)
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    copy = _copies.get(_site_notebook(item))
    if copy is not None:
        copy.failed |= report.failed
        if call.when == "call" and report.passed:  # a skipped cell did not run: no whole run
            copy.outputs[item.cell_num] = list(getattr(item, "test_outputs", None) or [])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    path = _site_notebook(item)
    if path is None or path not in _copies or (nextitem is not None and nextitem.parent is item.parent):
        return
    copy = _copies.pop(path)
    if copy.failed:
        return  # make site runs it again, or fails where it fails
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    if set(copy.outputs) != set(range(len(code))):
        return  # some cell did not run (deselected, skipped): not a whole run
    for n, cell in enumerate(code):  # the n-th code cell ran n-th: IPython's In[n + 1]
        cell.outputs, cell.execution_count = copy.outputs[n], n + 1
        for out in cell.outputs:
            if out.get("output_type") == "execute_result":
                out["execution_count"] = n + 1
    out_dir = Path(item.config.getoption("site_copies"))
    _site().save_copy(path, nb, out_dir if out_dir.is_absolute() else ROOT / out_dir, copy.key,
                      time.perf_counter() - copy.started, by="nbval")
