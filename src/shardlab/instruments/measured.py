"""Values that say where they came from: measured on live ranks, given by a formula, or published.

Rule one of the course is that a number it calls *measured* was measured on live ranks. These
three tags make that checkable, so that ``side_by_side`` and ``predict.compare`` can refuse a
formula passed where a measurement belongs::

    Measured(16_640, by="memory_report")        # an instrument counted it on a rank
    Formula(4 * psi, formula="4Ψ")              # the ZeRO paper's arithmetic gave it
    Published(144, source="Narayanan et al. 2021, Table 2")   # someone else measured it

Each is a number (an ``int`` or a ``float`` subclass; a ``list`` or ``str`` for a measured
event order or a formula's chosen stage), so arithmetic, comparisons, f-strings and JSON work as
before, and ``repr`` prints the bare number. The tag is ``.by``, ``.formula`` or ``.source``.

What arithmetic does to the tag (``+ - * / // % **``, ``abs``, ``-x``, ``round``):

* tagged times or over a plain number (``* / // % **``): the tag stays. ``report["total"] / psi``
  is still measured (a plain number scales it: a unit, a count of the model's own elements),
  ``4 * psi`` labelled ``Formula`` stays a formula after ``/ 1e6``;
* tagged plus or minus a plain number other than 0: a plain number. ``report["total"] + 2 * psi``
  mixes a measurement with a number written by hand, so it is no longer the measurement (tag the
  added part if it is one). ``0 + x`` keeps the tag, so ``sum()`` of measurements is measured;
* two values of the same kind: that kind, the tags joined (``Measured - Measured`` is measured);
* two different kinds (``Measured / Formula``, a ratio of a measurement to its formula): a
  plain number. A comparison of a measurement with a formula is neither.

Instruments tag what they return; notebooks tag only what they read straight off a rank
(``Measured(shard.tolist(), by="rank 2's tensor")``). A value with no tag is plain, and a plain
value is never taken for a measurement. ``statistics.mean`` rebuilds its result's type without
a tag, so it returns a plain number: use ``statistics.median`` (which keeps it) or tag the mean.
"""

from __future__ import annotations

import copy
import fractions
import functools
import math
import numbers
import operator

__all__ = ["Measured", "Formula", "Published", "kind_of", "tag_like", "describe", "require_measured",
           "returns_formula"]


class _Tagged:
    """What the three kinds share: a tag, arithmetic that keeps it, pickling (ranks send them)."""

    _field = ""  # the tag's attribute: "by", "formula" or "source"
    _kind = ""  # "measured", "formula", "published"

    def __new__(cls, value, tag=None, **kwargs):
        tag = kwargs.pop(cls._field, tag)
        if kwargs:
            raise TypeError(f"{cls.__name__}() got unexpected arguments {sorted(kwargs)}; "
                            f"pass {cls._field}=...")
        if tag is None and isinstance(value, _Tagged) and value._kind == cls._kind:
            tag = value.tag
        if tag is None and cls not in KINDS.values():  # a library rebuilding the type (statistics.mean)
            return _base_of(value)(value)
        if tag is None:
            raise TypeError(f"{cls.__name__}({value!r}) needs {cls._field}=...: say what produced it")
        base = _PLAIN.get(type(value)) or _base_of(value)
        sub = cls._variants[base]
        obj = base.__new__(sub, value)
        obj.__dict__["tag"] = str(tag)
        return obj

    def __init__(self, *args, **kwargs):  # list's __init__ would otherwise take the arguments
        if isinstance(self, list):
            list.__init__(self, args[0])

    def __getattr__(self, name):
        if name == type(self)._field:
            return self.__dict__["tag"]
        raise AttributeError(name)

    def plain(self):
        """The bare value (``int``, ``float``, ``list`` or ``str``), no tag."""
        return _base_of(self)(self)

    def __reduce__(self):
        return (_rebuild, (self._kind, self.plain(), self.tag))

    def __reduce_ex__(self, protocol):
        return self.__reduce__()

    def __copy__(self):  # numbers and text are immutable; a tagged list is copied, as a list is
        return type(self)(list(self), self.tag) if isinstance(self, list) else self

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(list(self), memo), self.tag) if isinstance(self, list) else self


_PLAIN = {int: int, float: float, list: list, str: str}  # the common case, without the checks below


def _base_of(value) -> type:
    for base in (bool, int, float, list, str):
        if isinstance(value, base):
            if base is bool:
                raise TypeError("a True/False is not tagged: tag the number it was computed from")
            return base
    if isinstance(value, tuple):
        return list
    if isinstance(value, numbers.Integral):
        return int
    if isinstance(value, numbers.Real):
        return float
    raise TypeError(f"only numbers, lists and text carry a tag, not {type(value).__name__}")


def _rebuild(kind: str, value, tag: str):
    return KINDS[kind](value, tag)


def _plain(x):
    return x.plain() if isinstance(x, _Tagged) else x


def _result_tag(a, b):
    """The class and tag of ``a op b``, or None for a plain result (see the module doc)."""
    ta, tb = isinstance(a, _Tagged), isinstance(b, _Tagged)
    if ta and tb:
        if a._kind != b._kind:
            return None
        joined = a.tag if a.tag == b.tag else f"{a.tag}; {b.tag}"
        return KINDS[a._kind], joined
    t = a if ta else b
    return KINDS[t._kind], t.tag


def _wrap(result, cls_tag):
    if cls_tag is None or isinstance(result, bool) or not isinstance(result, (int, float)):
        return result
    cls, tag = cls_tag
    return cls(result, tag)


def _number(x) -> bool:
    return isinstance(x, numbers.Real)


def _binary(op):
    shifts = op in (operator.add, operator.sub)

    def tag(a, b, other):
        if shifts and not isinstance(other, _Tagged) and other != 0:  # x + 1234: no longer what was measured
            return None
        return _result_tag(a, b)

    def forward(self, other):
        if not _number(other) or isinstance(self, (list, str)):
            return NotImplemented
        return _wrap(op(_plain(self), _plain(other)), tag(self, other, other))

    def backward(self, other):
        if not _number(other) or isinstance(self, (list, str)):
            return NotImplemented
        return _wrap(op(_plain(other), _plain(self)), tag(other, self, other))

    return forward, backward


def _unary(op):
    def method(self):
        return _wrap(op(_plain(self)), _result_tag(self, 0))

    return method


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow)):
    _f, _b = _binary(_op)
    setattr(_Tagged, f"__{_name}__", _f)
    setattr(_Tagged, f"__r{_name}__", _b)
for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs)):
    setattr(_Tagged, f"__{_name}__", _unary(_op))


def _round(self, ndigits=None):
    return _wrap(round(_plain(self), ndigits), _result_tag(self, 0))


_Tagged.__round__ = _round


def _floor(self):
    return _wrap(math.floor(_plain(self)), _result_tag(self, 0))


_Tagged.__floor__ = _floor


def _make(name: str, kind: str, field: str, doc: str):
    root = type(name, (_Tagged,), {"_kind": kind, "_field": field, "__doc__": doc, "__module__": __name__})
    root._variants = {}
    for base in (int, float, list, str):
        sub = type(f"{name}{base.__name__.capitalize()}", (root, base),
                   {"__module__": __name__, "__doc__": f"{doc.splitlines()[0]} ({base.__name__})",
                    "__repr__": base.__repr__, "__str__": base.__str__, "__hash__": base.__hash__,
                    "__format__": base.__format__})
        if base in (list, str):  # a measured order or stage: equality only, no arithmetic
            for op in ("add", "mul", "mod", "radd", "rmul", "rmod"):
                setattr(sub, f"__{op}__", getattr(base, f"__{op}__", None) or _no_arithmetic)
        root._variants[base] = sub
        globals()[sub.__name__] = sub
    return root


def _no_arithmetic(self, other):
    return NotImplemented


Measured = _make("Measured", "measured", "by",
                 "A value an instrument measured on live ranks; ``.by`` names the instrument.")
Formula = _make("Formula", "formula", "formula",
                "A value a formula gave; ``.formula`` is the formula (text or the function's name).")
Published = _make("Published", "published", "source",
                  "A figure someone else measured and published; ``.source`` is the citation.")
KINDS = {"measured": Measured, "formula": Formula, "published": Published}


def kind_of(value) -> str:
    """``"measured"``, ``"formula"``, ``"published"``, or ``"plain"`` for an untagged value.

    A list counts as measured when it is tagged, or when every element is measured.
    """
    if isinstance(value, _Tagged):
        return value._kind
    if isinstance(value, (list, tuple)) and value:
        kinds = {kind_of(v) for v in value}
        if len(kinds) == 1:
            return kinds.pop()
    return "plain"


def tag_like(value, kind: str, tag: str):
    """``value`` tagged as ``kind`` (``"measured"``, ``"formula"``, ``"published"``) with ``tag``;
    dicts, lists and tuples tag each number inside (an instrument's report, a row of a table)."""
    if isinstance(value, dict):
        return type(value)({k: tag_like(v, kind, tag) for k, v in value.items()}) \
            if type(value) is dict else _retag_dict(value, kind, tag)
    if isinstance(value, (list, tuple)):
        items = [tag_like(v, kind, tag) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple too
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, fractions.Fraction)):  # numpy too;
        return KINDS[kind](value, tag)                                                       # a Fraction kept exact
    return value


def returns_formula(text: str):
    """Decorator for a formula module's function: its numbers come back as ``Formula(..., formula=text)``."""
    def wrap(fn):
        @functools.wraps(fn)
        def tagged(*args, **kwargs):
            return tag_like(fn(*args, **kwargs), "formula", text)
        return tagged
    return wrap


def _retag_dict(value: dict, kind: str, tag: str) -> dict:
    for k, v in value.items():
        value[k] = tag_like(v, kind, tag)
    return value


def describe(value) -> str:
    """How a value is labelled in a printout: "measured (memory_report)", "formula (4Ψ)", ..."""
    kind = kind_of(value)
    if kind == "plain":
        return "plain number"
    tag = value.tag if isinstance(value, _Tagged) else "; ".join(sorted({v.tag for v in value}))
    return f"{kind} ({tag})"


def require_measured(value, where: str) -> None:
    """Raise a TypeError naming the fix unless ``value`` was measured by an instrument."""
    kind = kind_of(value)
    if kind == "measured":
        return
    fix = {"formula": "this value is a formula, not a measurement: pass it as formula=... "
                      "(predict.compare) or in the formula column (side_by_side)",
           "published": "this value is a published figure, not a measurement here: pass it as "
                        "published=..., source=... (predict.compare)"}.get(
        kind, "this is a plain number, not a measurement: take it from an instrument (memory_report, "
              "track_memory, saved_activations, count_comm, trace, time_steps, stage_memory), or, "
              "if a formula gave it, pass it as formula=...")
    raise TypeError(f"{where}: {fix} (got {describe(value)}: {value!r})")
