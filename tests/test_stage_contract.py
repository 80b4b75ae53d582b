"""The stage contract in ``engine/base.py``'s docstring is the exact list of what each stage
file, and each of stage 3's helper parts, defines: read the table, compare it with the classes,
so it cannot drift. Private methods count too, so a stage cannot grow a hidden mechanism."""

from __future__ import annotations

import importlib
import inspect
import re

from shardlab.engine import base
from shardlab.engine.base import Engine

STAGE_FILES = {"ddp.py", "zero1.py", "zero2.py", "zero3.py"}


def contract() -> dict[str, dict]:
    """``{"zero3.py": {"cls": None, "overrides": {...}, "own": {...}}, "lockstep.py": {"cls": "UnitWalk", ...}}``
    from the indented table in base.py's docstring."""
    text = base.__doc__
    table = text[text.index("The stage contract."):].split("::", 1)[1].split("\n\n")[1]
    rows: dict[str, str] = {}
    current = None
    for line in table.splitlines():
        match = re.match(r"\s+(\w+\.py)\s+(.*)", line)
        if match:
            current = match.group(1)
            rows[current] = match.group(2)
        elif current:
            rows[current] += " " + line.strip()
    parsed = {}
    for filename, text in rows.items():
        cls = None
        if (named := re.match(r"(\w+):\s*(.*)", text)) and not text.startswith("its own"):
            cls, text = named.groups()
        overrides, _, own = text.partition("; its own:")
        names = lambda part: {n.strip() for n in part.split(",") if n.strip()} if "(none" not in part else set()  # noqa: E731
        parsed[filename] = {"cls": cls, "overrides": names(overrides), "own": names(own)}
    return parsed


def defined_methods(cls) -> set[str]:
    """Methods and properties the class itself defines, private ones and ``__init__`` included."""
    return {name for name, value in vars(cls).items()
            if (not name.startswith("__") or name == "__init__")
            and (inspect.isfunction(value) or isinstance(value, property))}


def class_of(filename: str, name: str | None):
    """The row's class: the one named, or the file's only ``Engine`` subclass."""
    module = importlib.import_module(f"shardlab.engine.{filename.removesuffix('.py')}")
    if name is not None:
        return getattr(module, name)
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and issubclass(c, Engine) and c.__module__ == module.__name__]
    assert len(classes) == 1, (filename, classes)
    return classes[0]


def violations(filename: str, row: dict, cls) -> list[str]:
    """What ``cls`` does against its row: names defined but not listed, listed but not defined,
    listed overrides the base lacks (a typo adds a method), "own" names the base already has."""
    listed = row["overrides"] | row["own"]
    defined = defined_methods(cls)
    found = []
    if defined - listed:
        found.append(f"{filename}: defined but not in base.py's contract: {sorted(defined - listed)}")
    if listed - defined:
        found.append(f"{filename}: listed but not defined: {sorted(listed - defined)}")
    if row["cls"] is None:  # a stage class: overrides must exist in Engine, its own names must not
        found += [f"{filename} lists {n}, which Engine does not have" for n in sorted(row["overrides"] - {"__init__"})
                  if not hasattr(Engine, n)]
        found += [f"{filename} calls {n} its own, but Engine has it" for n in sorted(row["own"]) if hasattr(Engine, n)]
    return found


def test_the_table_names_every_stage_file_and_stage_3s_helpers():
    table = contract()
    assert set(table) == STAGE_FILES | {"lockstep.py", "graph_window.py"}
    assert {f: r["cls"] for f, r in table.items() if r["cls"]} == {"lockstep.py": "UnitWalk", "graph_window.py": "GraphWindow"}


def test_each_part_defines_exactly_what_the_contract_lists():
    for filename, row in contract().items():
        assert not violations(filename, row, class_of(filename, row["cls"])), violations(
            filename, row, class_of(filename, row["cls"]))


def test_stages_set_only_the_switches_the_base_declares():
    """A stage differs by class attributes the base gives a default (P_os, P_g, P_p), never by a new one."""
    for filename in STAGE_FILES:
        cls = class_of(filename, None)
        settings = {n for n, v in vars(cls).items() if not n.startswith("__") and not callable(v)
                    and not isinstance(v, property)}
        assert settings <= {"stage", *vars(Engine)}, (filename, settings - set(vars(Engine)))


def test_the_check_can_fail():
    class Drifted(Engine):
        def make_master(self, unit):
            return unit.full

        def pre_backward(self, unit):  # not in ddp.py's row
            pass

        def _hidden_walk(self):  # private, and still not in the row
            pass

    found = violations("ddp.py", contract()["ddp.py"], Drifted)
    assert any("['_hidden_walk', 'pre_backward']" in v for v in found), found
    assert any("['after_step', 'keep_grads', 'reduce_grads']" in v for v in found), found
    typo = dict(contract()["zero3.py"], overrides={"pre_forwrd"}, own={"reduce_grads"})
    found = violations("zero3.py", typo, Drifted)
    assert "zero3.py lists pre_forwrd, which Engine does not have" in found
    assert "zero3.py calls reduce_grads its own, but Engine has it" in found
