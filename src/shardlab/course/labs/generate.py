"""One source per lab: the student notebook is generated from the solution notebook.

In ``labs/solutions/labN_<topic>.ipynb`` a task's answer sits between nbgrader's markers::

    def pad_and_split(flat, world_size):
        \"\"\"...\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

:func:`student_notebook` replaces each marked block by ``raise NotImplementedError("your code
here")`` at the marker's indentation, and strips every output, so that ``labs/labN_<topic>.ipynb``
cannot drift from its solution (a test compares the committed file with a fresh generation).
A dozen lines of JSON do what nbgrader's or jupytext's machinery would, without the dependency.
"""

from __future__ import annotations

import json
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'


def strip_solution(source: str) -> str:
    """``source`` with every BEGIN/END SOLUTION block replaced by a stub at the same indentation."""
    out, inside = [], False
    for line in source.splitlines(keepends=True):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{BEGIN} inside another solution block")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}\n")
        elif marker == END:
            if not inside:
                raise ValueError(f"{END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN} without {END}")
    return "".join(out)


def clean(nb: dict) -> dict:
    """No outputs, no execution counts: what the repository keeps."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def student_notebook(solution: dict) -> dict:
    nb = json.loads(json.dumps(solution))  # a deep copy
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["source"] = _lines(strip_solution("".join(cell["source"])))
    return clean(nb)


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def dumps(nb: dict) -> str:
    """The notebook as Jupyter writes it (one-space indent, unicode kept, final newline)."""
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def student_path(solution_path: Path) -> Path:
    """labs/solutions/lab1_x.ipynb -> labs/lab1_x.ipynb"""
    return solution_path.parent.parent / solution_path.name


def generate(solution_path: Path, *, check_only: bool = False) -> bool:
    """Write the student notebook of ``solution_path``; True if it was already up to date."""
    solution = json.loads(Path(solution_path).read_text())
    text = dumps(student_notebook(solution))
    target = student_path(Path(solution_path))
    fresh = target.exists() and target.read_text() == text
    if not fresh and not check_only:
        target.write_text(text)
    return fresh
