"""Shipping notebook-defined code to the ranks: a function, and what it uses from the notebook.

ipyparallel sends a function's code, but runs it against the rank's namespace, where the
notebook's own helpers and ``import numpy as np`` do not exist. :func:`references` finds
what a notebook function uses (modules, notebook functions, notebook classes, recursively);
modules travel by name, functions by value, classes as a :class:`ClassSpec`. Data never
travels: a rank's variables are its own.
"""

from __future__ import annotations

import types


class ClassSpec:
    """A class defined in the notebook, sent by value and rebuilt on each rank.

    ipyparallel's own pickling recurses forever on a method that calls ``super()`` (its
    ``__class__`` cell points back at the class), so we carry the pieces (bases, functions
    as code, other attributes) and rebuild the class in the rank's namespace.
    """

    def __init__(self, cls: type):
        self.name = cls.__name__
        self.bases = tuple(ClassSpec(b) if b.__module__ == cls.__module__ else b for b in cls.__bases__)
        attrs = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        self.attrs = {k: _pack(v) for k, v in attrs.items()}
        # Kept here only, to find the imports and helpers the methods use (not sent).
        self.methods = [f for v in attrs.values() for f in _functions_in(v)]

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "methods"}

    def build(self, ns: dict) -> type:
        """The class again, on a rank; its methods' globals are the rank's namespace ``ns``."""
        bases = tuple(b.build(ns) if isinstance(b, ClassSpec) else b for b in self.bases)
        holes: list = []  # __class__ cells, filled once the class exists
        attrs = {k: _unpack(v, ns, holes) for k, v in self.attrs.items()}
        cls = types.new_class(self.name, bases, exec_body=lambda body: body.update(attrs))
        for cell in holes:
            cell.cell_contents = cls
        return cls


def _pack(value):
    """A class attribute as picklable pieces: functions become their code, cells and names."""
    if isinstance(value, types.FunctionType):
        cells = tuple(None if name == "__class__" else c.cell_contents
                      for name, c in zip(value.__code__.co_freevars, value.__closure__ or ()))
        return ("fn", value.__code__, value.__defaults__, value.__kwdefaults__, value.__name__,
                value.__qualname__, value.__code__.co_freevars, cells)
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, _pack(value.__func__))
    if isinstance(value, property):
        return ("property", *(_pack(f) if f else None for f in (value.fget, value.fset, value.fdel)), value.__doc__)
    return ("value", value)


def _functions_in(value) -> list:
    """The plain functions inside a class attribute (a method, static/class method, property)."""
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f]
    return []


def _unpack(packed, ns, holes):
    """Undo :func:`_pack` on a rank; ``__class__`` cells are left empty and listed in ``holes``."""
    kind = packed[0]
    if kind == "fn":
        _, code, defaults, kwdefaults, name, qualname, freevars, values = packed
        cells = []
        for var, value in zip(freevars, values):
            cells.append(types.CellType() if var == "__class__" else types.CellType(value))
            if var == "__class__":
                holes.append(cells[-1])
        fn = types.FunctionType(code, ns, name, defaults, tuple(cells) or None)
        fn.__kwdefaults__, fn.__qualname__ = kwdefaults, qualname
        return fn
    if kind in ("staticmethod", "classmethod"):
        return {"staticmethod": staticmethod, "classmethod": classmethod}[kind](_unpack(packed[1], ns, holes))
    if kind == "property":
        fget, fset, fdel = (_unpack(f, ns, holes) if f else None for f in packed[1:4])
        return property(fget, fset, fdel, packed[4])
    return packed[1]


def references(fn) -> tuple[dict, dict]:
    """Imports and notebook-defined functions/classes that ``fn`` uses, to send along with it.

    Returns ``(imports, defs)``: alias -> module name, and name -> function or
    :class:`ClassSpec`. Only functions defined in the notebook (module ``__main__`` or another
    dunder name) are searched; a function from an importable module finds its own globals.
    """
    imports: dict[str, str] = {}
    defs: dict[str, object] = {}
    home = getattr(fn, "__module__", None)
    seen: set[int] = set()

    def names(code):
        yield from code.co_names
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from names(const)

    def visit(f):
        if id(f) in seen or not isinstance(f, types.FunctionType):
            return
        seen.add(id(f))
        for name in set(names(f.__code__)):
            if name not in f.__globals__:
                continue
            value = f.__globals__[name]
            if isinstance(value, types.ModuleType):
                imports[name] = value.__name__
            elif isinstance(value, types.FunctionType) and value.__module__ == home:
                defs[name] = value
                visit(value)
            elif isinstance(value, type) and value.__module__ == home and name not in defs:
                defs[name] = spec = ClassSpec(value)
                for method in spec.methods:
                    visit(method)

    if home == "__main__" or (isinstance(home, str) and home.startswith("__")):
        visit(fn)
    return imports, defs
