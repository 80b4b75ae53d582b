"""The stage contract in ``engine/base.py``'s docstring is the exact list of what each stage
file defines (issue 22 §1): read the table, compare it with the classes, so it cannot drift."""

from __future__ import annotations

import importlib
import inspect
import re

from shardlab.engine import base
from shardlab.engine.base import Engine


def contract() -> dict[str, set[str]]:
    """``{"zero3.py": {"shard", ...}, ...}`` from the indented table in base.py's docstring."""
    text = base.__doc__
    table = text[text.index("The stage contract."):].split("::", 1)[1].split("\n\n")[1]
    rows: dict[str, set[str]] = {}
    current = None
    for line in table.splitlines():
        match = re.match(r"\s+(\w+\.py)\s+(.*)", line)
        if match:
            current, names = match.group(1), match.group(2)
            rows[current] = set()
        else:
            names = line
        if current and "(none" not in names:
            rows[current] |= {n.strip() for n in names.split(",") if n.strip()}
    return rows


def defined_methods(cls) -> set[str]:
    """Public methods and properties the class itself defines (``__init__`` included)."""
    return {name for name, value in vars(cls).items()
            if (not name.startswith("_") or name == "__init__")
            and (inspect.isfunction(value) or isinstance(value, property))}


def stage_class(filename: str):
    module = importlib.import_module(f"shardlab.engine.{filename.removesuffix('.py')}")
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and issubclass(c, Engine) and c.__module__ == module.__name__]
    assert len(classes) == 1, (filename, classes)
    return classes[0]


def test_the_table_names_every_stage_file():
    assert set(contract()) == {"ddp.py", "zero1.py", "zero2.py", "zero3.py"}


def test_each_stage_defines_exactly_what_the_contract_lists():
    for filename, listed in contract().items():
        defined = defined_methods(stage_class(filename))
        assert defined == listed, (f"{filename}: defined but not in base.py's contract: {sorted(defined - listed)}; "
                                   f"listed but not defined: {sorted(listed - defined)}")


def test_every_overridden_hook_exists_in_the_base():
    """A listed override of a base method must really override one (a typo would add a method)."""
    own = {"pre_backward", "prefetch_next", "count_accumulators", "holding", "held_backward"}
    for filename, listed in contract().items():
        for name in listed - own:
            assert hasattr(Engine, name), f"{filename} lists {name}, which Engine does not have"


def test_the_check_can_fail():
    class Drifted(Engine):
        def shard(self, unit):
            return unit.full

        def pre_backward(self, unit):  # not in any row of the table
            pass

    assert defined_methods(Drifted) == {"shard", "pre_backward"} != contract()["ddp.py"]
