"""Every assert in a notebook or a lab can fail: it compares a measurement with a formula, two
measurements, or a behaviour, never a formula with itself or a constant with its definition.

The check reads each code cell (``ast``; IPython magics dropped) and runs nothing. It flags an
``assert`` when:

1. **its test is a literal** (``assert True``, ``assert 2 == 2``): nothing in it can change;
2. **one comparison has the same expression on both sides** (AST-equal: ``f(x) == f(x)``, the
   same formula called with the same arguments);
3. **both sides of one comparison are formula-only**: built from literals, the formula modules
   (``FORMULA_PATHS``: ``shardlab.instruments.memory_math``, ``shardlab.planner`` and its
   submodules, ``shardlab.course.calculator``...), decided by the module an import names, not
   by the alias it binds (``import ... memory_math as mm``, ``from shardlab.planner import step``
   and ``from ...memory_math import model_state_bytes`` are all formula), builtins, and names the
   notebook assigned from such expressions only (followed through assignments, ``for`` targets,
   comprehensions, whose own loop names are local, and ``x[k] = ...``). Rebinding a name to a
   formula-only value makes it formula again; ``x[k] = ...`` never clears a measured ``x``. ``seven_b = calculator.memory_calculator(7e9, ...)`` then
   ``assert seven_b.stages["ddp"].total == 112e9`` is arithmetic checked against itself; a
   value read off the ranks (``cluster.pull``, ``cluster.run``, an instrument) is never
   formula-only, so ``assert measured == memory_math.comm_elements(key, psi)`` passes.
   An assert that guards the text's claim about a formula at paper scale (where nothing can be
   measured on a laptop) may stay if it says so: a comment on its lines that starts with
   ``# formula`` (``assert fits["13B", False] == "zero2"   # formula: activations push 13B past ZeRO-1``).
   Rules 1 and 2 have no such way out.

Tests of the formulas themselves belong in ``tests/`` (``test_memory_math.py``), where a
hard-coded published number is a regression check, not a claim about live ranks.
"""

import ast
import builtins
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb")) + sorted((ROOT / "labs" / "solutions").glob("*.ipynb"))
#: Modules whose every name is a formula; an import is matched by the path it names.
FORMULA_PATHS = ("math", "shardlab.memory_math", "shardlab.instruments.memory_math",
                 "shardlab.instruments.parallelism_math", "shardlab.instruments.stages",
                 "shardlab.planner", "shardlab.course.calculator")
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
NEUTRAL = set(dir(builtins))


def code_cells(nb: dict) -> list[str]:
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            out.append("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
    return out


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_formula_path(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in FORMULA_PATHS)


def _dotted(node: ast.AST) -> tuple[ast.Name, list[str]] | None:
    """``a.b.c`` as (the Name ``a``, ["b", "c"]); None when the chain does not start at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    return (node, attrs) if isinstance(node, ast.Name) else None


def _rebound(target: ast.AST) -> set[str]:
    """Names a target binds whole (``a``, ``a, b``), not those it updates (``x[k]``, ``x.y``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_rebound(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _rebound(target.value)
    return set()


def _bound(target: ast.AST) -> set[str]:
    """Names a target binds: ``a``, ``a, (b, c)``; and ``x`` of ``x[k] = ...``, ``x.y = ...``."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, (ast.Subscript, ast.Attribute)):
        return _bound(target.value)
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    return set()


class _Reader(ast.NodeVisitor):
    """Walks a notebook's cells in order; knows which names hold formula-only values."""

    def __init__(self):
        self.formula: set[str] = set()
        self.tainted: set[str] = set()  # bound to something measured (until rebound to a formula)
        self.modules: dict[str, str] = {}  # name -> the module path an import bound it to
        self.bad: list[str] = []

    def formula_only(self, node: ast.AST, local: dict | None = None) -> bool:
        """Whether ``node`` is built from literals, formula modules and formula-only names;
        ``local``: names a comprehension binds, each True when its iterable is formula-only.
        A comprehension inside ``node`` binds its own loop names the same way."""
        local = dict(local or {})
        for comp in (n for n in ast.walk(node) if isinstance(n, COMPREHENSIONS)):
            for gen in comp.generators:
                local.update(dict.fromkeys(_bound(gen.target), self.formula_only(gen.iter, local)))
        reached = set()  # ``shardlab.planner.x`` after ``import shardlab``: the root is formula here
        for n in ast.walk(node):
            chain = _dotted(n) if isinstance(n, ast.Attribute) else None
            if chain and chain[0].id in self.modules and chain[0].id not in local:
                if _is_formula_path(".".join([self.modules[chain[0].id], *chain[1]])):
                    reached.add(id(chain[0]))
        return all(id(n) in reached or (local[n.id] if n.id in local else n.id in self.formula
                                         or n.id in NEUTRAL and n.id not in self.tainted)
                   for n in ast.walk(node) if isinstance(n, ast.Name))

    def _bind(self, targets, value) -> None:
        names = set().union(*(_bound(t) for t in targets))
        whole = set().union(*(_rebound(t) for t in targets))
        if value is not None and self.formula_only(value):
            # a whole rebinding clears a name's past; an update (x[k] = ...) keeps a measured x
            self.tainted -= whole
            self.formula |= names - self.tainted
        else:
            self.formula -= names
            self.tainted |= names

    def visit_Assign(self, node):
        self._bind(node.targets, node.value)

    def visit_AugAssign(self, node):
        self._bind([node.target], ast.BinOp(node.target, node.op, node.value) if isinstance(node.target, ast.Name)
                   else node.value)

    def visit_AnnAssign(self, node):
        self._bind([node.target], node.value)

    def visit_For(self, node):
        self._bind([node.target], node.iter)
        self.generic_visit(node)

    def visit_FunctionDef(self, node):  # a function's result depends on what it is called with
        self.formula -= {node.name}
        self.tainted.add(node.name)

    def _import(self, name: str, path: str) -> None:
        self.modules[name] = path
        if _is_formula_path(path):
            self.formula.add(name)
            self.tainted.discard(name)
        else:
            self.formula.discard(name)
            self.tainted.add(name)

    def visit_Import(self, node):
        for alias in node.names:  # ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c`` to a.b
            self._import(alias.asname, alias.name) if alias.asname else self._import(
                alias.name.split(".")[0], alias.name.split(".")[0])

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if alias.name != "*":
                self._import(alias.asname or alias.name, f"{'.' * node.level}{node.module or ''}.{alias.name}")

    def visit_Assert(self, node):
        text = ast.unparse(node.test)
        local: dict = {}
        for gen in (g for n in ast.walk(node.test) for g in getattr(n, "generators", [])):
            local.update(dict.fromkeys(_bound(gen.target), self.formula_only(gen.iter, local)))
        lines = self.source[node.lineno - 1: node.end_lineno]
        labelled = any(re.search(r"#\s*formula", line) for line in lines)
        if not _names(node.test) and not any(isinstance(n, ast.Call) for n in ast.walk(node.test)):
            self.bad.append(f"a literal: assert {text}")
            return
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            for a, b in zip(sides, sides[1:]):
                if ast.dump(a) == ast.dump(b):
                    self.bad.append(f"the same expression on both sides: assert {text}")
                elif self.formula_only(a, local) and self.formula_only(b, local) and not labelled:
                    self.bad.append(f"a formula against a formula or a constant: assert {text}")


def cannot_fail(nb: dict) -> list[str]:
    """The asserts of ``nb`` (a notebook's JSON) that cannot fail, as ``cell n: why``."""
    reader, bad = _Reader(), []
    for i, source in enumerate(code_cells(nb)):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        before = len(reader.bad)
        reader.source = source.splitlines()
        reader.visit(tree)
        bad += [f"code cell {i}: {why}" for why in reader.bad[before:]]
    return bad


@pytest.mark.parametrize("path", BOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_notebook_assert_can_fail(path):
    bad = cannot_fail(json.loads(path.read_text(encoding="utf-8")))
    assert not bad, (f"{path.name}: these asserts cannot fail on the ranks' results; compare a measurement "
                     f"with the formula, two measurements, or a behaviour:\n  " + "\n  ".join(bad))


def test_the_check_has_teeth():
    cells = ["import torch\nfrom shardlab.instruments import memory_math\n",
             "seven_b = memory_math.model_state_bytes(7e9, 8)\nassert seven_b['ddp'] == 112e9",
             "assert 2 == 2\nassert True",
             "psi = cluster.pull('psi')[0]\nassert memory_math.comm_elements('ddp', psi) == memory_math.comm_elements('ddp', psi)",
             "%%ranks\nreport = shardlab.memory_report(model, opt)\nassert report['grads'] == 4 * psi",
             "assert memory_math.comm_elements('ddp', psi) == 2 * psi",
             "assert all(abs(r - 1) < 0.01 for r in seven_b.values())",
             "assert seven_b['ddp'] > 100e9   # formula: a replica is over 100 GB"]
    nb = {"cells": [{"cell_type": "code", "source": [c]} for c in cells]}
    found = cannot_fail(nb)
    assert [re.match(r"code cell (\d+)", f).group(1) for f in found] == ["1", "2", "2", "3", "6"]
    assert "formula against a formula" in found[0] and "literal" in found[1] and "same expression" in found[3]


@pytest.mark.parametrize("cells", [
    # a comprehension's value: its loop name is local, the formula module makes it formula
    ["from shardlab import planner",
     "layer = {c: planner.korthikanti_layer_bytes(1, 1, c) for c in ('none', 'full')}\n"
     "assert layer['none'] == 114 * 2048"],
    # formula-ness follows the module an import names, not the alias it binds
    ["from shardlab.instruments import memory_math as mm\nassert mm.model_state_bytes(7e9, 8)['ddp'] == 112e9"],
    ["from shardlab.planner import anchors\nassert anchors.bytes_per_param(64)[0].recomputed == 10"],
    ["from shardlab.instruments.memory_math import model_state_bytes\nassert model_state_bytes(7e9, 8)['ddp'] > 1"],
    ["import shardlab\nassert shardlab.memory_math.model_state_bytes(7e9, 8)['ddp'] == 112e9"],
    # a name once measured, rebound to a formula, is a formula again
    ["from shardlab.instruments import memory_math\nr = cluster.pull('r')[0]",
     "r = memory_math.model_state_bytes(7e9, 8)\nassert r['ddp'] == 112e9"],
], ids=["comprehension", "alias", "submodule", "from-function", "attribute", "rebound"])
def test_the_check_catches_formulas_however_they_are_named(cells):
    nb = {"cells": [{"cell_type": "code", "source": [c]} for c in cells]}
    found = cannot_fail(nb)
    assert len(found) == 1 and "formula against a formula" in found[0], found


@pytest.mark.parametrize("cells", [
    ["from shardlab.instruments import memory_math as mm",
     "got = {r: cluster.pull('m')[r] for r in range(3)}\nassert got[0] == mm.comm_elements('ddp', 5)"],
    ["from shardlab.instruments import memory_math\nx = cluster.pull('x')",
     "x[0] = memory_math.comm_elements('ddp', 5)\nassert x[1] == memory_math.comm_elements('ddp', 5)"],
    ["import shardlab\nfrom shardlab.instruments import memory_math",
     "rep = shardlab.memory_report(m, o)\nassert rep['grads'] == memory_math.model_state_bytes(5, 1)['ddp']"],
], ids=["measured-comprehension", "update-keeps-measured", "instrument-through-shardlab"])
def test_the_check_passes_what_reads_the_ranks(cells):
    nb = {"cells": [{"cell_type": "code", "source": [c]} for c in cells]}
    assert cannot_fail(nb) == []
