"""The website's pages: which repository files become pages, their links, and the boxes they get.

Every page says which file of the repository it is and how to run the course (the README's two
commands). Links between files that are on the site stay links between pages; a link to a file
that is not on the site (a script, a folder) points at the repository when its address is known
(SHARDLAB_REPO_URL, or GitHub Actions' own variables), and is plain text otherwise, so that no
link on the site is broken.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
from pathlib import Path

#: Markdown pages besides docs/*.md, in the order of the sidebar.
EXTRA_PAGES = ("BENCHMARKS.md", "workshop/README.md", "workshop/AGENDA.md")
#: A repository file on the site under another name.
RENAMED = {"README.md": "about.md"}
#: The built site's entry page, as the README links it: on the site, the landing page.
ENTRY = "_build/html/index.html"
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
RUN = ("`make lab` opens the course in JupyterLab, and `make test` runs the test suite and every "
       "notebook under nbval (the README's two commands, from a clone of ShardLab).")


def site_paths(root: Path) -> dict[str, str]:
    """{repository path: page path} for every file that is a page of the site."""
    paths = [f"notebooks/{p.name}" for p in sorted((root / "notebooks").glob("*.ipynb"))]
    paths += [f"labs/{p.name}" for p in sorted((root / "labs").glob("*.ipynb"))]  # never solutions/
    docs = sorted((root / "docs").glob("*.md"), key=lambda p: (p.stem != "cheatsheet", p.name))
    paths += [f"docs/{p.name}" for p in docs]
    paths += [p for p in EXTRA_PAGES if (root / p).exists()] + ["README.md"]
    return {p: RENAMED.get(p, p) for p in paths} | {ENTRY: "index.md"}


def repo_url() -> str | None:
    """The repository's web address for links to files not on the site, if it can be known."""
    if os.environ.get("SHARDLAB_REPO_URL"):
        return os.environ["SHARDLAB_REPO_URL"].rstrip("/") + "/blob/main"
    if os.environ.get("GITHUB_REPOSITORY"):
        server = os.environ.get("GITHUB_SERVER_URL", "https://github.com")
        return f"{server}/{os.environ['GITHUB_REPOSITORY']}/blob/{os.environ.get('GITHUB_REF_NAME', 'main')}"
    out = subprocess.run(["git", "remote", "get-url", "origin"], capture_output=True, text=True)
    url = out.stdout.strip()
    if out.returncode or not url:
        return None
    url = re.sub(r"^git@([^:]+):", r"https://\1/", url).removesuffix(".git")
    return url + "/blob/main" if url.startswith("https://") else None


def rewrite_links(text: str, rel: str, on_site: dict[str, str], root: Path, dest_root: Path) -> str:
    """Links of the page at repository path ``rel``, made right for where its page lands."""
    here = posixpath.dirname(on_site.get(rel, rel))
    url = repo_url()

    def fix(m: re.Match) -> str:
        bang, label, target = m.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        full = posixpath.normpath(posixpath.join(posixpath.dirname(rel), path))
        if (root / full).is_dir() and f"{full}/README.md" in on_site:
            full = f"{full}/README.md"
        if full in on_site:
            new = posixpath.relpath(on_site[full], here or ".")
        elif bang and (root / full).is_file():  # an image: copied beside the pages
            (dest_root / full).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / full, dest_root / full)
            new = posixpath.relpath(full, here or ".")
        elif url and (root / full).exists():
            new = f"{url}/{full}"
        else:
            return label or f"`{full}`"  # not on the site, no repository address: plain text
        return f"{bang}[{label}]({new}{'#' + anchor if anchor else ''})"

    return LINK.sub(fix, text)


def source_link(rel: str) -> str:
    url = repo_url()
    return f"[`{rel}`]({url}/{rel})" if url else f"`{rel}`"


def _insert_after_title(text: str, box: str, title: str) -> str:
    lines, fence = text.splitlines(), False
    for i, line in enumerate(lines):
        fence ^= line.lstrip().startswith(("```", "~~~"))
        if not fence and re.match(r"^#{1,6} ", line):
            if line.startswith("# "):
                return "\n".join(lines[: i + 1] + ["", box, ""] + lines[i + 1:]) + "\n"
            break
    return f"# {title}\n\n{box}\n\n{text}"  # no title of its own (it starts at ##): give it one


def write_markdown_page(root: Path, rel: str, dest_root: Path, on_site: dict[str, str], title: str | None = None):
    """A markdown file of the repository as a page: links fixed, a title, the 'run it' box."""
    dest = dest_root / on_site[rel]
    text = rewrite_links((root / rel).read_text(encoding="utf-8"), rel, on_site, root, dest_root)
    box = f":::{{note}}\nThis page is {source_link(rel)} in the ShardLab repository. To run the course: {RUN}\n:::"
    if title:  # replaces the file's own title
        text = re.sub(r"\A# .*\n", "", text)
        text = f"# {title}\n\n{text}"
    default = Path(rel).stem.replace("_", " ").capitalize()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(_insert_after_title(text, box, default), encoding="utf-8")


def notebook_box(rel: str, meta: dict, info: dict) -> str:
    ranks = f"{meta['ranks']} ranks" if meta.get("ranks") else "no ranks"
    return (":::{admonition} Run this notebook yourself\n:class: tip\n"
            f"This page is {source_link(rel)}, executed once when the site was built: {ranks}, "
            f"torch {info['torch']}, {info['backend']}, on {info['cpu']} ({info['cores']} cores), "
            f"{meta['executed_at']} ([build info](../build-info.md)). Your numbers will differ a little: "
            f"process ids and timings change from run to run.\n\n"
            f"To run it on your machine: {RUN} The quizzes and the memory calculator are widgets there; "
            "here they show their plain-text version.\n:::")


def lab_box(rel: str) -> str:
    return (":::{admonition} This lab's checks run on your machine\n:class: important\n"
            f"This page is {source_link(rel)}, the student version, not executed: a lab is code you "
            "write, and its checks run on live ranks in your own JupyterLab, where each says ✓ or "
            f"names the likely mistake. To run it: {RUN} The answers are not on this site.\n:::")


def add_run_box(nb, rel: str, box: str) -> None:
    """The box as a markdown cell right under the notebook's title cell."""
    import nbformat

    first = nb.cells[0] if nb.cells else None
    at = 1 if first is not None and first.cell_type == "markdown" and first.source.lstrip().startswith("# ") else 0
    nb.cells.insert(at, nbformat.v4.new_markdown_cell(box, id="site-run-box"))


def fix_notebook_links(nb, rel: str, on_site: dict[str, str], root: Path, dest_root: Path) -> None:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = rewrite_links(cell.source, rel, on_site, root, dest_root)


def _table_links(section: str, on_site: dict[str, str]) -> tuple[str, set[str]]:
    """The README's tables with each notebook or lab name linked to its page."""
    linked = set()

    def link(m: re.Match) -> str:
        for folder in ("notebooks", "labs"):
            if f"{folder}/{m.group(1)}.ipynb" in on_site:
                linked.add(f"{folder}/{m.group(1)}.ipynb")
                return f"| [`{m.group(1)}`]({folder}/{m.group(1)}.ipynb) |"
        return m.group(0)

    return re.sub(r"^\| `([\w.-]+)` \|", link, section, flags=re.M), linked


def landing(root: Path, on_site: dict[str, str], dest_root: Path) -> str:
    """index.md: the README's opening, its two commands, its course tables; the sidebar's order."""
    readme = (root / "README.md").read_text(encoding="utf-8")
    intro = readme.split("\n## ", 1)[0].split("\n", 1)[1].strip()
    quick = re.search(r"\n## Quick start\n(.*?)(?=\n## |\n- )", readme, re.S).group(1).strip()
    course = re.search(r"\n### The course\n(.*?)(?=\n## )", readme, re.S).group(1).strip()
    course, linked = _table_links(rewrite_links(course, "README.md", on_site, root, dest_root), on_site)
    quick = rewrite_links(quick, "README.md", on_site, root, dest_root)
    rest = [p for p in on_site if p.startswith("notebooks/") and p not in linked]
    more = "\n".join(f"- [`{Path(p).stem}`]({p})" for p in rest)
    tree = []
    for caption, prefix in (("The course", "notebooks/"), ("Labs", "labs/"), ("Reference", "docs/"),
                            ("Reference", "BENCHMARKS"), ("Workshop", "workshop/")):
        entries = [on_site[p].removesuffix(".md").removesuffix(".ipynb") for p in on_site if p.startswith(prefix)]
        if tree and tree[-1][0] == caption:
            tree[-1][1].extend(entries)
        else:
            tree.append((caption, entries))
    tree.append(("About", ["about", "build-info"]))
    trees = "\n".join(f"```{{toctree}}\n:hidden:\n:caption: {c}\n\n" + "\n".join(e) + "\n```\n" for c, e in tree)
    return (f"# ShardLab: ZeRO and FSDP, built and measured\n\n{intro}\n\n"
            "You are reading the course as a website: every notebook below was run once, on CPU "
            "ranks, when this site was built ([build info](build-info.md)), so you see its prints, "
            "figures, traces and tables without installing anything. Then run it yourself.\n\n"
            f"## The course\n\n{course}\n\n## Run it yourself\n\n{quick}\n\n"
            "PyTorch versions, CPU or GPU, conda: [the README's quick start](about.md#quick-start).\n\n"
            + (f"Also on this site:\n\n{more}\n\n" if more else "")
            + "The cheat sheet and the other docs, the [workshop kit](workshop/README.md) and the "
              "[README](about.md) are in the sidebar.\n\n" + trees)


def build_info_page(info: dict) -> str:
    rows = "\n".join(f"| `notebooks/{name}` | {m.get('ranks') or '—'} | {m['seconds']:.1f} s | {m['executed_at']} |"
                     for name, m in info["notebooks"].items())
    ranks = " or ".join(str(r) for r in info["ranks"]) or "no"
    return (f"# Build info: where the outputs came from\n\n"
            "Every output on this site was produced by running the notebooks once, top to bottom, "
            "with `make site` (`website/build.py`); the measurements depend on the machine below.\n\n"
            f"| what | value |\n|---|---|\n| torch | {info['torch']} |\n| ranks per notebook | {ranks} ({info['backend']}) |\n"
            f"| CPU | {info['cpu']}, {info['cores']} cores |\n| Python | {info['python']} |\n"
            f"| ShardLab commit | `{info['commit']}` |\n| built | {info['built_at']} |\n\n"
            f"| notebook | ranks | run time | executed |\n|---|---|---|---|\n{rows}\n\n"
            f"To run the course yourself: {RUN}\n")
