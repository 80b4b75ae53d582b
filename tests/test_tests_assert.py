"""Every test can fail: each test function asserts something, or calls a helper that does.

A test passes when it raises nothing, so a test that only runs code (``timeline(events)``)
checks no more than "it did not crash", whatever its name promises. A test function (``test_*``
in ``tests/test_*.py``, at module level or in a ``Test*`` class) must contain, at any depth:

* an ``assert`` statement, or ``pytest.raises`` / ``pytest.warns`` / ``pytest.fail``;
* a call to an ``assert_*`` function (``torch.testing.assert_close``, ``np.testing.assert_*``);
* or a call to a function defined in ``tests/`` that itself meets this rule (a plain-name call,
  ``check_case(...)``, to any depth; a helper that only computes does not). A method call
  (``future.result()``) earns no credit, even if some helper in ``tests/`` is named ``result``.

The check reads the source (``ast``); it runs nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RAISING = {"raises", "warns", "fail", "deprecated_call"}  # pytest.<name>: the block must raise, warn or fails


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _asserts_itself(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = _called_name(node)
            f = node.func
            if name and name.startswith("assert_"):
                return True
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "pytest" \
                    and f.attr in RAISING:
                return True
    return False


def _calls(fn: ast.AST) -> set[str]:
    """Names of the plain-name calls in ``fn``: the only calls that can reach a helper by its name."""
    return {node.func.id for node in ast.walk(fn) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def _functions(folder: Path) -> dict[str, list[ast.AST]]:
    """Every function defined anywhere in ``folder``'s modules (nested ones too), by name."""
    out: dict[str, list] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, []).append(node)
    return out


def asserting_helpers(functions: dict[str, list[ast.AST]]) -> set[str]:
    """Names of the functions in tests/ that assert, directly or through another such function."""
    good = {name for name, defs in functions.items() if any(_asserts_itself(d) for d in defs)}
    while True:
        more = {name for name, defs in functions.items() if name not in good
                and any(_calls(d) & good for d in defs)}
        if not more:
            return good
        good |= more


def functions_under_test(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            yield from (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node


def unasserted_tests(folder: Path = TESTS) -> list[str]:
    """``file::test (line n)`` for each test function in ``folder`` that cannot fail on a result."""
    good = asserting_helpers(_functions(folder))
    bad = []
    for path in sorted(folder.glob("test_*.py")):
        for fn in functions_under_test(path):
            if not (_asserts_itself(fn) or _calls(fn) & good):
                bad.append(f"{path.name}::{fn.name} (line {fn.lineno})")
    return bad


def test_every_test_asserts_something():
    bad = unasserted_tests()
    assert not bad, ("these tests assert nothing (no assert, no pytest.raises/warns, no asserting "
                     "helper), so they cannot fail on a wrong result:\n  " + "\n  ".join(bad))


def test_the_rule_has_teeth(tmp_path):
    (tmp_path / "helpers.py").write_text(
        "def check_case(x):\n    assert x\n\n"
        "def run_and_check(x):\n    return check_case(x)\n\n"
        "def compute(x):\n    return x + 1\n", encoding="utf-8")
    (tmp_path / "test_probe.py").write_text(
        "import pytest, torch\n"
        "def test_only_draws():\n    timeline([1])\n"
        "def test_only_computes():\n    verdict = compute(1)\n"
        "def test_asserts():\n    assert compute(1) == 2\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_close():\n    torch.testing.assert_close(1.0, 1.0)\n"
        "def test_through_helpers():\n    run_and_check(1)\n"
        "def test_through_a_method():\n    future = compute(1)\n    future.check_case()\n"
        "class TestGroup:\n    def test_in_class(self):\n        compute(2)\n", encoding="utf-8")
    assert unasserted_tests(tmp_path) == [
        "test_probe.py::test_only_draws (line 2)", "test_probe.py::test_only_computes (line 4)",
        "test_probe.py::test_through_a_method (line 15)", "test_probe.py::test_in_class (line 19)"]

