"""Run each notebook once, as a learner would, and keep the executed copy for the website.

Every notebook under ``notebooks/`` runs top to bottom in its own kernel, in its own folder,
with the settings a static page needs:

- ``SHARDLAB_NO_WIDGETS=1``: the quizzes and the memory calculator print their plain-text
  fallback (a page has no kernel to drive a widget, and a quiz's text never holds its answer);
- no ``SHARDLAB_LEARNER``: the numeric questions show their numbers as written, the same on
  every build, whoever runs it;
- progress bars as text: ``tqdm.auto`` is pointed at ``tqdm.std`` in the kernel before the
  first cell, so the page shows the bar's last state, not a widget frozen at 0 %.

A cell that raises fails the build, except cells tagged ``raises-exception`` (as under
``nbval --nbval-lax``). The executed copies go to ``_build/executed/notebooks/``, each with
``metadata.shardlab_site``: the key of what it ran (the notebook, the package's source, torch's
version), its time, and the ranks its outputs came from. A copy whose key still matches is
reused, so a second ``make site`` executes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
#: Run silently in each kernel before the first cell (not a cell: the page shows none of it).
KERNEL_SETUP = "import tqdm.auto, tqdm.std\ntqdm.auto.tqdm, tqdm.auto.trange = tqdm.std.tqdm, tqdm.std.trange\n"
CELL_TIMEOUT_S = 120  # nbval's --nbval-cell-timeout in `make test`, scaled the same way
BUDGET_S = 90


def slowdown() -> float:
    """The test suite's slow-down factor (tests/conftest.py): SHARDLAB_TEST_SLOWDOWN, 2 under CI."""
    raw = os.environ.get("SHARDLAB_TEST_SLOWDOWN", "").strip()
    if raw:
        return max(1.0, float(raw))
    return 2.0 if os.environ.get("CI", "").lower() == "true" else 1.0


class _SiteClient(NotebookClient):
    """nbclient's executor, with the kernel set up for a static page before the first cell."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        reply = await kc.execute_interactive(KERNEL_SETUP, silent=True, store_history=False, timeout=60)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the site's kernel set-up failed: {reply['content']}")
        return kc


def key_of(notebook: Path) -> str:
    """What an executed copy depends on: the notebook, the package's source, torch, the set-up."""
    import torch

    h = hashlib.sha256(notebook.read_bytes())
    for f in sorted((ROOT / "src" / "shardlab").rglob("*")):
        if f.suffix in (".py", ".json") and "__pycache__" not in f.parts:
            h.update(f.relative_to(ROOT).as_posix().encode() + f.read_bytes())
    h.update(torch.__version__.encode() + KERNEL_SETUP.encode())
    return h.hexdigest()[:16]


def ranks_of(nb) -> int | None:
    """The ranks the outputs came from: the cluster's repr, else the highest ``[rank k]`` label."""
    sizes, labels = [], [-1]
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            sizes += [int(n) for n in re.findall(r"Cluster\(world_size=(\d+)", text)]
            labels += [int(n) for n in re.findall(r"^\[rank (\d+)\]", text, flags=re.M)]
    return max(sizes) if sizes else (max(labels) + 1 if max(labels) >= 0 else None)


@contextlib.contextmanager
def site_environment():
    """The site's settings while a kernel starts (it and its ranks inherit them): plain-text
    widgets, and no SHARDLAB_LEARNER, so the page shows the numbers as written."""
    saved = {name: os.environ.get(name) for name in ("SHARDLAB_NO_WIDGETS", "SHARDLAB_LEARNER")}
    os.environ["SHARDLAB_NO_WIDGETS"] = "1"
    os.environ.pop("SHARDLAB_LEARNER", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def execute(notebook: Path, out_dir: Path, force: bool = False) -> tuple[Path, dict, bool]:
    """The executed copy of ``notebook`` in ``out_dir``: (path, its site metadata, was it reused)."""
    target = out_dir / notebook.name
    key = key_of(notebook)
    if target.exists() and not force:
        old = nbformat.read(target, as_version=4).metadata.get("shardlab_site", {})
        if old.get("key") == key:
            return target, old, True
    nb = nbformat.read(notebook, as_version=4)
    t0 = time.perf_counter()
    with site_environment():
        _SiteClient(nb, timeout=int(CELL_TIMEOUT_S * slowdown()), kernel_name="python3",
                    coalesce_streams=True, record_timing=False,
                    extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no start-up chatter
                    resources={"metadata": {"path": str(notebook.parent)}}).execute()
    target, meta = save_copy(notebook, nb, out_dir, key, time.perf_counter() - t0, by="nbclient")
    return target, meta, False


def save_copy(notebook: Path, nb, out_dir: Path, key: str, seconds: float, by: str) -> tuple[Path, dict]:
    """Keep ``nb``, ``notebook`` executed with the settings above, as the site's copy.

    ``key`` is :func:`key_of` taken before the run began (what ran, not what is there now).
    ``by`` names what ran it: ``nbclient`` (``make site``) or ``nbval`` (``make test``, whose run
    of notebooks/ uses the same settings: website/nbval_copies.py's ``--site-copies``). The copy is
    written to a temporary name and renamed, so a run stopped half-way leaves no half a notebook.
    """
    meta = {"key": key, "seconds": round(seconds, 1), "ranks": ranks_of(nb), "by": by,
            "executed_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    nb.metadata["shardlab_site"] = meta
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / notebook.name
    partial = target.with_suffix(".partial")
    nbformat.write(nb, partial)
    partial.replace(target)
    return target, meta


def execute_all(out_dir: Path, force: bool = False) -> dict[str, dict]:
    """Every notebook under notebooks/, in order; prints each one's time beside nbval's budget."""
    done = {}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        print(f"  {notebook.relative_to(ROOT)} ...", end="", flush=True)
        try:
            _, meta, reused = execute(notebook, out_dir, force)
        except Exception as e:  # name the notebook; nbclient's message names the cell
            print(" failed")
            raise SystemExit(f"make site: {notebook.relative_to(ROOT)} failed to run:\n{e}") from None
        how = "reused (unchanged since it ran)" if reused else f"{meta['seconds']:.1f} s of {BUDGET_S} s"
        print(f" {how}, {meta['ranks'] or 'no'} ranks")
        done[notebook.name] = meta
    return done
