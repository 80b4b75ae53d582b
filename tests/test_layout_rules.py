"""The package's written layout rules, kept true by reading the code (no module is imported).

Two rules from the folder READMEs and the layout notes:

* **What each part may import.** Each ``src/shardlab/<part>/README.md`` has a paragraph that
  starts ``May import:``; the names in backticks there, with the standard library and the
  part's own folder, are everything its modules may import. Every import statement counts,
  inside functions and ``if TYPE_CHECKING`` too, and so does ``importlib.import_module`` or
  ``__import__`` of a literal name. A listed name no module imports fails too: the README says
  what the part uses, not what it once did.
* **One door to the network.** No module outside ``engine/comm.py`` touches a
  ``torch.distributed`` collective: no call, no reference passed along (``sync=dist.barrier``),
  no ``from torch.distributed import all_reduce``. Queries (``get_rank``, ``is_initialized``)
  and process-group set-up are not collectives and stay allowed.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

import shardlab

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC.parent
PKG = SRC / "shardlab"
PARTS = sorted(p.parent.name for p in PKG.glob("*/README.md"))

# A collective is a torch.distributed function (in any of its submodules) whose name starts
# with one of these: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast,
# barrier, send/recv/isend/irecv, gather/scatter(_object), all_to_all_single, ...
_COLLECTIVE = re.compile(
    r"_?(all_|reduce|broadcast|gather|scatter|barrier|monitored_barrier|send|recv|isend|irecv|batch_isend_irecv)"
)


def modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _resolve_from(base: str, name: str) -> str:
    """What ``from base import name`` imports: the submodule if there is one, else base itself.

    ``from shardlab import trace`` goes through shardlab's lazy table to the module that defines it.
    """
    if _is_package_module(f"{base}.{name}"):
        return f"{base}.{name}"
    if base == "shardlab":
        table = {**shardlab._EXPORTS, **shardlab._MODULES}
        if name in table:
            return table[name]
    return base


def imports_of(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """(line, fully qualified module) for every import in ``path``, at any depth.

    ``package``: the package relative imports start from (by default, the one holding ``path``).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    if package is None:
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            found += [(node.lineno, _resolve_from(base, alias.name)) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def allowed_by_readme(part: str) -> list[str]:
    """The backticked names of the README's ``May import:`` paragraph."""
    text = (PKG / part / "README.md").read_text(encoding="utf-8")
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.lstrip().startswith("May import:")]
    assert len(paragraphs) == 1, f"{part}/README.md needs one paragraph starting 'May import:'"
    names = re.findall(r"`([A-Za-z_][\w.]*)`", paragraphs[0])
    assert names, f"{part}/README.md's 'May import:' names no module in backticks"
    return names


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("part", PARTS)
def test_each_part_imports_only_what_its_readme_allows(part):
    allowed = allowed_by_readme(part)
    own = f"shardlab.{part}"
    broken, used = [], set()
    for path in sorted((PKG / part).rglob("*.py")):
        for line, name in imports_of(path):
            if name.split(".")[0] in sys.stdlib_module_names or _under(name, own):
                continue
            hits = [a for a in allowed if _under(name, a)]
            used.update(hits)
            if not hits:
                broken.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    broken = list(dict.fromkeys(broken))  # one line per import, not per imported name
    assert not broken, (f"{part}/README.md allows only {allowed} (and the standard library, and "
                        f"{own}); import through a part it may use, or change the rule:\n  " + "\n  ".join(broken))
    unused = [a for a in allowed if a not in used]
    assert not unused, f"{part}/README.md lists {unused}, which no module of {own} imports: drop it"


def test_the_rule_reader_sees_every_kind_of_import(tmp_path):
    """A function-level import, a relative one and ``from shardlab import <public name>`` all count."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .. import trace\n    import matplotlib.pyplot\n"
                     "    from shardlab import models\n    __import__('ipywidgets')\n", encoding="utf-8")
    got = [name for _, name in imports_of(probe, package="shardlab.engine")]
    assert got == ["shardlab.instruments.timeline", "matplotlib.pyplot", "shardlab.models", "ipywidgets"]


# -- the one door ------------------------------------------------------------------------------
def _dist_names(tree: ast.AST) -> tuple[dict, list]:
    """Names bound to torch / torch.distributed modules, and collectives imported by name."""
    bound, imported = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _under(a.name, "torch"):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and _under(node.module, "torch"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _under(node.module, "torch.distributed") and _COLLECTIVE.match(a.name):
                    imported.append((node.lineno, full))
                else:
                    bound[a.asname or a.name] = full
    return bound, imported


def _dotted(node: ast.AST, bound: dict) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(parts)])
    return None


def collective_uses(path: Path) -> list[str]:
    """``line: torch.distributed.<collective>`` for each collective this module touches."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound, imported = _dist_names(tree)
    refs, patched = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            full = _dotted(node, bound)
            if full and _under(full, "torch.distributed") and _COLLECTIVE.match(node.attr):
                if isinstance(node.ctx, ast.Store):
                    patched.add(full)
                else:
                    refs.append((node.lineno, full))
    # A module that swaps ``dist.X`` for a counting wrapper (lab 3 counts a learner's direct
    # all_reduce) reads ``dist.X`` only to keep and restore the original: it issues nothing.
    refs = [(line, full) for line, full in refs if full not in patched]
    return [f"{line}: {full}" for line, full in sorted(imported + refs)]


def test_the_door_finder_sees_calls_aliases_and_references(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"
        "from torch import distributed\nfrom torch.distributed import get_rank, ReduceOp\n"
        "dist.barrier()\nrun(sync=dist.barrier)\ntorch.distributed.all_gather_into_tensor(a, b)\n"
        "distributed.reduce_scatter_tensor(a, b)\ndist.distributed_c10d.broadcast(t, 0)\n"
        "dist.get_rank(); dist.is_initialized(); dist.ReduceOp.MAX; get_rank()\n", encoding="utf-8")
    assert collective_uses(probe) == [
        "3: torch.distributed.all_reduce", "6: torch.distributed.barrier", "7: torch.distributed.barrier",
        "8: torch.distributed.all_gather_into_tensor", "9: torch.distributed.reduce_scatter_tensor",
        "10: torch.distributed.distributed_c10d.broadcast",
    ]
    wrapper = tmp_path / "wrapper.py"  # counting a learner's calls: keep, swap, restore dist.all_reduce
    wrapper.write_text("import torch.distributed as dist\nkept = dist.all_reduce\n"
                       "dist.all_reduce = lambda *a: kept(*a)\ndist.all_reduce = kept\n", encoding="utf-8")
    assert collective_uses(wrapper) == []


def test_every_collective_goes_through_engine_comm():
    offenders = []
    for path in modules():
        rel = path.relative_to(SRC).as_posix()
        if rel != "shardlab/engine/comm.py":
            offenders += [f"{rel}:{u}" for u in collective_uses(path)]
    assert not offenders, ("call collectives through shardlab.engine.comm (all_gather, reduce_scatter, "
                           "all_reduce, broadcast, barrier, all_reduce_max, gather_lists):\n  " + "\n  ".join(offenders))


# -- no import cycles -----------------------------------------------------------------------------
def import_cycles(package: str) -> list[list[str]]:
    """Cycles among the modules of ``package`` (every import counts, at any depth).

    A module's parent packages are imported first by Python itself; only written imports are
    edges. A logic module and its widget module must not appear together in a cycle: the
    widget builds on the logic, never the reverse.
    """
    graph = {}
    for path in modules():
        name = module_name(path)
        if _under(name, package):
            graph[name] = {m for _, m in imports_of(path) if _under(m, package) and m != name}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycle_anywhere_in_shardlab():
    """Deferred imports and ``if TYPE_CHECKING`` count too: a cycle hidden in a function is still one."""
    cycles = import_cycles("shardlab")
    assert not cycles, "import cycles in shardlab:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_the_planner_sits_between_the_instruments_and_the_course():
    """Its floor: it may use the instruments (formulas, links); the course and the bench may use it."""
    assert allowed_by_readme("planner") == ["shardlab.instruments"]
    assert "shardlab.planner" in allowed_by_readme("course") and "shardlab.planner" in allowed_by_readme("bench")
    assert "shardlab.planner" not in allowed_by_readme("instruments")


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    """The check above has teeth: the quiz's old shape (logic and widgets importing each other) fails."""
    real = imports_of

    def with_old_edge(path, package=None):
        found = real(path, package)
        if path.name == "quiz_bank.py":
            found.append((1, "shardlab.course.quiz_widgets"))
        return found

    monkeypatch.setattr(sys.modules[__name__], "imports_of", with_old_edge)
    assert ["shardlab.course.quiz_bank", "shardlab.course.quiz_widgets", "shardlab.course.quiz_bank"] in \
        import_cycles("shardlab.course")


# -- no pyplot ------------------------------------------------------------------------------------

def test_no_module_draws_through_pyplot():
    """``instruments/plots.py``'s rule, for the whole package: figures come from
    ``plots.new_figure`` (an Agg canvas), so nothing switches a notebook's backend."""
    found = [f"{path.relative_to(SRC)}:{line}" for path in modules() for line, name in imports_of(path)
             if name == "matplotlib.pyplot" or name.startswith("matplotlib.pyplot.")]
    assert not found, "these modules import matplotlib.pyplot; draw on plots.new_figure() instead:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "labs").glob("*.ipynb")),
                         ids=lambda p: p.name)
def test_notebooks_are_committed_stripped_and_every_cell_has_an_id(path):
    """Committed with outputs stripped (a learner's first run is their own), and every cell has
    the id nbformat 4.5 requires: a cell added by hand without one warns today and fails in a
    later nbformat."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code), f"{path.name} has outputs"
    missing = [i + 1 for i, c in enumerate(nb["cells"]) if not c.get("id")]
    assert not missing, f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"
