"""Labs from the command line, for learners working in plain files and for workshop instructors.

::

    python -m shardlab.course.labs check lab1 my_lab1.py     # one line per task; exit 0 if all pass
    python -m shardlab.course.labs grade lab1 submissions/   # every .py / .ipynb -> CSV + summary
    python -m shardlab.course.labs generate                  # labs/solutions/*.ipynb -> labs/*.ipynb

``check`` imports the task functions (named as in the lab) from the file and runs the lab's
checks on fresh local ranks, on 4 ranks and then on 3 (padding; code that hard-codes 4 ranks
fails there). A notebook submission is read for its imports, definitions and the top-level
assignments they may use (cells that start ranks, run on them or call ``check`` are skipped). ``grade`` runs each submission in its
own process group with a time limit, so one that hangs, crashes or deadlocks gets "timed out"
rows and the others are graded anyway.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab.course.labs.generate import generate
from shardlab.course.labs.judge import CELL_MARK
from shardlab.course.labs.runners import run_on_fresh_ranks
from shardlab.course.labs.tasks import WORLD_SIZES, lab_tasks
from shardlab.course.labs.verdicts import Result

#: Seconds a submission may spend starting ranks and importing torch, on top of its tasks' limits.
STARTUP = 90.0


#: What a kept top-level assignment may not call: these start ranks, run on them, or check.
RANK_CALLS = frozenset({"start_cluster", "check", "run", "run_on_cluster", "stop"})


def _names(node: ast.AST, ctx) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _calls(node: ast.AST):
    """The calls an expression makes when it is evaluated: a lambda's body runs later, so it is not walked."""
    todo = [] if isinstance(node, ast.Lambda) else [node]
    while todo:
        sub = todo.pop()
        if isinstance(sub, ast.Call):
            yield sub
        todo.extend(child for child in ast.iter_child_nodes(sub) if not isinstance(child, ast.Lambda))


def _kept_assignment(node: ast.stmt, defined: set[str], own: frozenset[str] = frozenset()) -> bool:
    """A top-level assignment that needs only what the script already defines and starts nothing:
    ``pad = torch.nn.functional.pad`` or ``left = [0]`` are kept (a function may use them);
    ``cluster = shardlab.start_cluster(4)`` or ``runs = cluster.run(...)`` are not, nor a call of
    the notebook's own functions or classes (``own``: a self-test such as
    ``shards = pad_and_split(x, 4)`` would run on every rank at import, and its error would fail
    every task), nor ``count += 1`` where ``count`` is not defined."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or node.value is None:
        return False
    for call in _calls(node.value):
        if (getattr(call.func, "attr", None) or getattr(call.func, "id", None)) in RANK_CALLS:
            return False
        root = call.func  # f in f(...), cluster in cluster.run(...)
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in own:
            return False
    if isinstance(node, ast.AugAssign) and not _names(node.target, ast.Store) <= defined:
        return False
    bound = _names(node.value, ast.Store) | {a.arg for n in ast.walk(node.value) if isinstance(n, ast.Lambda)
                                              for a in ast.walk(n.args) if isinstance(a, ast.arg)}
    return _names(node, ast.Load) <= defined | bound | set(dir(builtins))


def _cells(nb: dict):
    """(number, lines, tree) of each code cell that runs here: cell magics (``%%ranks``) are left
    out, line magics and shell lines are blanked, so that line numbers stay the notebook's."""
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for number, cell in enumerate(code_cells, 1):
        source = "".join(cell["source"])
        if source.lstrip().startswith("%%"):
            continue  # runs on the ranks (%%ranks) or is another cell magic
        lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
        try:
            yield number, lines, ast.parse("\n".join(lines))
        except SyntaxError:
            continue


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def notebook_to_script(path: Path, folder: Path) -> Path:
    """A notebook's code cells as a plain .py file: its imports, functions and classes, and the
    top-level assignments they may use (:func:`_kept_assignment`). Cells that start ranks, run on
    them (``%%ranks``) or call ``check`` are left out. Each piece is preceded by :data:`CELL_MARK`,
    so that a hint can name the notebook's cell and line (``judge._where``).

    A definition owns its lines (at top level it starts at column 0), so it is cut by lines, from
    its first decorator. An import or an assignment is cut as the statement alone: in
    ``import torch; cluster = start_cluster(4)`` the import is kept and the cluster is not."""
    nb = json.loads(path.read_text())
    cells = list(_cells(nb))
    own = frozenset(node.name for _, _, tree in cells for node in tree.body if isinstance(node, DEFINITIONS))
    kept, defined = [], set()
    for number, lines, tree in cells:
        source = "\n".join(lines)
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, DEFINITIONS):
                defined.add(node.name)
            elif _kept_assignment(node, defined, own):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            else:
                continue
            if isinstance(node, DEFINITIONS):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                piece = "\n".join(lines[start - 1:node.end_lineno])
            else:
                start, piece = node.lineno, ast.get_source_segment(source, node)
            kept.append(CELL_MARK.format(cell=number, line=start) + "\n" + piece)
    script = folder / f"{path.stem}.py"
    script.write_text("\n\n".join(kept) + "\n")
    return script


def _check(args) -> int:
    tasks = lab_tasks(args.lab)
    path = Path(args.file).resolve()
    if not path.exists():
        print(f"no such file: {path}", file=sys.stderr)
        return 2
    out = open(args.jsonl, "a") if args.jsonl else None  # noqa: SIM115 - closed below

    def report(result: Result) -> None:
        print(result.line(), flush=True)
        if out:
            out.write(json.dumps(result.__dict__) + "\n")
            out.flush()

    with tempfile.TemporaryDirectory() as tmp:
        script = notebook_to_script(path, Path(tmp)) if path.suffix == ".ipynb" else path
        results = run_on_fresh_ranks([(t.id, str(script)) for t in tasks], scale=args.scale,
                                     timeout=args.timeout, report=report)
    if out:
        out.close()
    return 0 if all(r.passed for r in results) else 1


def _grade(args) -> int:
    tasks = lab_tasks(args.lab)
    folder = Path(args.dir)
    files = sorted(p for p in folder.iterdir() if p.suffix in (".py", ".ipynb"))
    limit = len(WORLD_SIZES) * (STARTUP + 1.5 * sum(args.timeout or t.timeout for t in tasks)) * args.scale
    rows = []
    for path in files:
        t0 = time.monotonic()
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as log:
            cmd = [sys.executable, "-m", "shardlab.course.labs", "check", args.lab, str(path),
                   "--jsonl", log.name, "--scale", str(args.scale)]
            cmd += ["--timeout", str(args.timeout)] if args.timeout else []
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)  # its own group: killed as a whole
            try:
                proc.wait(timeout=limit)
                hung = False
            except subprocess.TimeoutExpired:
                hung = True
            _kill_group(proc)
            done = {r["task"]: r for r in map(json.loads, log.read().splitlines())}
        for t in tasks:
            r = done.get(t.id) or {"status": "timed out", "message":
                                   f"the submission ran past {limit:.0f} s and was stopped"
                                   if hung else "no result: the submission crashed"}
            rows.append({"file": path.name, "task": t.id, "result": r["status"],
                         "hint": "" if r["status"] == "pass" else r["message"]})
        passed = sum(1 for row in rows[-len(tasks):] if row["result"] == "pass")
        print(f"{path.name}: {passed}/{len(tasks)} tasks pass ({time.monotonic() - t0:.0f} s)", flush=True)
    out = Path(args.out or folder / f"grades_{args.lab.split('_')[0]}.csv")
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["file", "task", "result", "hint"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{len(files)} submissions, {args.lab}: wrote {out}")
    for t in tasks:
        ok = sum(1 for row in rows if row["task"] == t.id and row["result"] == "pass")
        print(f"  {t.id:32} {ok}/{len(files)} pass")
    return 0


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the submission's whole process group (its ranks too), then reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _generate(args) -> int:
    root = Path(args.root)
    solutions = sorted((root / "solutions").glob("lab*.ipynb"))
    stale = [p for p in solutions if not generate(p, check_only=args.check)]
    for p in stale:
        print(f"{'stale' if args.check else 'wrote'}: {p.parent.parent / p.name}")
    return 1 if (args.check and stale) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.course.labs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="check one file's task functions on fresh local ranks")
    c.add_argument("lab", help="lab1 ... lab6")
    c.add_argument("file", help="a .py (or .ipynb) file defining the lab's functions")
    c.add_argument("--jsonl", help=argparse.SUPPRESS)  # the grader reads results from here
    g = sub.add_parser("grade", help="check every .py / .ipynb in a folder; write a CSV")
    g.add_argument("lab")
    g.add_argument("dir")
    g.add_argument("--out", help="the CSV to write (default DIR/grades_LAB.csv)")
    for p in (c, g):
        p.add_argument("--scale", type=float, default=float(os.environ.get("SHARDLAB_TEST_SLOWDOWN", 1)),
                       help="multiply every time limit (a loaded machine)")
        p.add_argument("--timeout", type=float, help="seconds per task (default: each task's own)")
    n = sub.add_parser("generate", help="write labs/*.ipynb from labs/solutions/*.ipynb")
    n.add_argument("--root", default="labs")
    n.add_argument("--check", action="store_true", help="only report stale student notebooks")
    args = parser.parse_args(argv)
    return {"check": _check, "grade": _grade, "generate": _generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
