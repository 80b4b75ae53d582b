"""`make site`: the course as a static website in _build/html, executed once, readable without running.

Steps (docs/site.md says why this way):

1. run every notebook once (website/execute.py), or reuse its executed copy if nothing changed;
2. lay out the pages in _build/site-src/: the landing page from the README's course tables, the
   executed notebooks, the labs' student versions (never labs/solutions/), docs/*.md (the cheat
   sheet among them), BENCHMARKS.md, the workshop's README and agenda, the README, build info;
   each page gets a box saying which file it is and the two commands that run it;
3. Sphinx with MyST-NB renders them (the outputs as they were stored; nothing runs again).

    python website/build.py            # what `make site` runs
    python website/build.py --force    # execute every notebook again
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).parent))
import execute  # noqa: E402
import pages  # noqa: E402

ROOT = execute.ROOT
BUILD = ROOT / "_build"
SRC = BUILD / "site-src"
HTML = BUILD / "html"
EXECUTED = BUILD / "executed" / "notebooks"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_info(executed: dict[str, dict]) -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    ranks = sorted({m["ranks"] for m in executed.values() if m.get("ranks")})
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model(),
            "cores": os.cpu_count(), "backend": "gloo on CPU", "ranks": ranks,
            "commit": commit.stdout.strip() or "unknown", "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "notebooks": executed}


def stage(executed: dict[str, dict], info: dict) -> None:
    """Lay out every page of the site in SRC."""
    if SRC.exists():
        shutil.rmtree(SRC)
    SRC.mkdir(parents=True)
    for name in ("conf.py", "_static"):
        src = Path(__file__).with_name(name)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, SRC / name)
    (SRC / "build_info.json").write_text(json.dumps(info, indent=2))
    on_site = pages.site_paths(ROOT)
    for rel in on_site:
        if rel.endswith(".md"):
            title = "About ShardLab: the README" if rel == "README.md" else None
            pages.write_markdown_page(ROOT, rel, SRC, on_site, title=title)
    (SRC / "notebooks").mkdir()
    for name, meta in executed.items():
        nb = nbformat.read(EXECUTED / name, as_version=4)
        pages.add_run_box(nb, f"notebooks/{name}", pages.notebook_box(f"notebooks/{name}", meta, info))
        pages.fix_notebook_links(nb, f"notebooks/{name}", on_site, ROOT, SRC)
        nbformat.write(nb, SRC / "notebooks" / name)
    (SRC / "labs").mkdir()
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):  # the student versions: labs/solutions/ is not read
        nb = nbformat.read(lab, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        pages.add_run_box(nb, f"labs/{lab.name}", pages.lab_box(f"labs/{lab.name}"))
        pages.fix_notebook_links(nb, f"labs/{lab.name}", on_site, ROOT, SRC)
        nbformat.write(nb, SRC / "labs" / lab.name)
    (SRC / "index.md").write_text(pages.landing(ROOT, on_site, SRC))
    (SRC / "build-info.md").write_text(pages.build_info_page(info))


def sphinx() -> None:
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going", "-j", "1",
           "-d", str(BUILD / "site-doctrees"), str(SRC), str(HTML)]
    run = subprocess.run(cmd, cwd=ROOT)
    if run.returncode:
        raise SystemExit(f"make site: sphinx-build failed (exit {run.returncode}); the warnings above say where")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="execute every notebook again")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    print("make site: running the notebooks (each once; unchanged ones are reused)")
    executed = execute.execute_all(EXECUTED, force=args.force)
    for stale in set(p.name for p in EXECUTED.glob("*.ipynb")) - set(executed):
        (EXECUTED / stale).unlink()  # a notebook that was renamed or removed
    t1 = time.perf_counter()
    info = build_info(executed)
    stage(executed, info)
    if HTML.exists():
        shutil.rmtree(HTML)
    sphinx()
    (HTML / ".nojekyll").touch()  # GitHub Pages: serve _static/ as it is
    n_pages = len([p for p in HTML.rglob("*.html") if not p.relative_to(HTML).parts[0].startswith("_")
                   and p.name not in ("genindex.html", "search.html")])
    print(f"make site: {n_pages} pages in {HTML.relative_to(ROOT)}/ (open index.html) in "
          f"{time.perf_counter() - t0:.0f} s: notebooks {t1 - t0:.0f} s, pages {time.perf_counter() - t1:.0f} s")


if __name__ == "__main__":
    main()
