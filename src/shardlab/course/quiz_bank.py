"""The quiz banks and their checks: which answer is right, and why, without any widget.

The answers live in data files (``quizzes/<NN>_<name>.json``), not in notebook cells, so the
answer is not one scroll away. A question is ``single`` (one key), ``multiple`` (a list of
keys) or ``numeric`` (a number with an absolute ``tolerance`` and a ``unit``). Every wrong
choice has its own feedback; the ``explanation`` is shown when right, and after a wrong
answer's feedback. A numeric answer may name its ``source``, the
:mod:`shardlab.instruments.memory_math` call it comes from, so a test recomputes it (see
:func:`recompute`)::

    "source": {"fn": "model_state_bytes", "args": [7e9, 8], "key": "zero3", "divide": 1e9}

``kwargs`` (a dict) may follow ``args``; ``key`` indexes a dict result (a list of keys for a
nested one); ``divide`` defaults to the unit's size (GB 1e9, GiB 2^30, MB 1e6, bytes 1). A source
may name ``"module": "parallelism_math"`` instead, with a ``shape`` (the fields of its
``Shape``, passed first) and an ``attr`` of the result to read before ``key``.

A bank lists its choices in any order: on loading, each question's choices are relabelled a, b,
c, ... in a shuffled order that is the same in every process, with the keys' positions balanced
across the bank (:mod:`shardlab.course.quiz_order` says how). Everything after loading, the
checks included, sees the letters a learner sees.

What a learner calls is in :mod:`shardlab.course.quiz` (plain text) and
:mod:`shardlab.course.quiz_widgets` (widgets); both build on this module, which imports neither.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from shardlab.course import quiz_draw, quiz_order

BANKS = Path(__file__).with_name("quizzes")
KINDS = ("single", "multiple", "numeric")
UNIT_SCALE = {"GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20, "KB": 10**3, "bytes": 1, "B": 1}


@dataclass(frozen=True)
class Question:
    id: str
    kind: str
    question: str
    answer: object
    bank: str
    choices: dict = field(default_factory=dict)
    feedback: dict = field(default_factory=dict)
    explanation: str = ""
    tolerance: float = 0.0
    unit: str = ""
    check_yourself: bool = False  # one of the course's two check-yourself questions, word for word
    prediction: bool = False  # asks for a number or a trend before the learner has computed it
    source: dict | None = None
    vary: dict | None = None  # a learner's own inputs for a numeric question (quiz_draw)

    def right_keys(self) -> set:
        return {self.answer} if self.kind == "single" else set(self.answer)


@dataclass(frozen=True)
class Feedback:
    correct: bool
    text: str


def problems(q: Question) -> list[str]:
    """What is wrong with a question (empty when it is sound): the rules every bank obeys."""
    out = []
    if q.kind not in KINDS:
        return [f"{q.id}: kind must be one of {KINDS}, got {q.kind!r}"]
    if not q.question.strip() or not q.explanation.strip():
        out.append(f"{q.id}: needs a question and an explanation")
    if q.kind == "numeric":
        if not isinstance(q.answer, (int, float)) or isinstance(q.answer, bool):
            out.append(f"{q.id}: a numeric answer must be a number, got {q.answer!r}")
        if not isinstance(q.tolerance, (int, float)) or q.tolerance < 0 or not q.unit:
            out.append(f"{q.id}: a numeric question needs a tolerance >= 0 and a unit")
        if q.vary is not None and not any(len(v) > 1 for v in q.vary.get("inputs", {}).values()):
            out.append(f"{q.id}: vary.inputs needs at least one input with two or more values "
                       "(a learner's numbers must differ from the written ones)")
        return out
    keys = q.answer if q.kind == "multiple" else [q.answer]
    if len(q.choices) < 2:
        out.append(f"{q.id}: needs at least two choices")
    if q.kind == "multiple" and (not isinstance(q.answer, list) or not q.answer or len(set(q.answer)) != len(q.answer)):
        out.append(f"{q.id}: a multiple-choice answer is a non-empty list of distinct keys")
    if q.kind == "single" and not isinstance(q.answer, str):
        out.append(f"{q.id}: a single-choice answer is one key, got {q.answer!r}")
    missing = [k for k in keys if k not in q.choices]
    if missing:
        out.append(f"{q.id}: answer key(s) {missing} are not among the choices {sorted(q.choices)}")
    wrong = set(q.choices) - set(keys)
    if set(q.feedback) != wrong:
        out.append(f"{q.id}: feedback must cover exactly the wrong choices {sorted(wrong)}, has {sorted(q.feedback)}")
    return out


def bank_files() -> dict[str, Path]:
    """Every bank in the package by name: ``{"03_zero1_zero2": path, ..., "final": path}``."""
    return {p.stem: p for p in sorted(BANKS.glob("*.json"))}


def _bank_name(bank: str) -> str:
    files = bank_files()
    matches = [name for name in files if name == bank or name.split("_")[0] == bank]
    if len(matches) != 1:
        raise ValueError(f"no single quiz bank called {bank!r}; the banks are {sorted(files)} "
                         f"(name one by its number, e.g. quiz.show('03'))")
    return matches[0]


def _load(name: str) -> tuple[tuple[Question, ...], tuple[str, ...]]:
    return _parse(bank_files()[name])


@cache
def _parse(path: Path) -> tuple[tuple[Question, ...], tuple[str, ...]]:
    name = path.stem
    data = json.loads(path.read_text(encoding="utf-8"))
    known = set(Question.__dataclass_fields__) - {"bank"}
    out = []
    for raw in data.get("questions", []):
        extra = set(raw) - known
        if extra:
            raise ValueError(f"{name}.json: question {raw.get('id')!r} has unknown fields {sorted(extra)}")
        q = Question(bank=name, **raw)
        bad = problems(q)
        if bad:
            raise ValueError(f"{name}.json: " + "; ".join(bad))
        out.append(q)
    return tuple(shown(out)), tuple(data.get("draw", ()))


def shown(qs: list[Question]) -> list[Question]:
    """A bank's questions with their choices relabelled in the order a learner sees them:
    shuffled, the same in every process, the keys' positions balanced (:mod:`quiz_order`)."""
    asked = [q for q in qs if q.kind != "numeric"]
    maps = iter(quiz_order.relabel([(q.id, list(q.choices), q.right_keys()) for q in asked]))
    out = []
    for q in qs:
        if q.kind == "numeric":
            out.append(q)
            continue
        new = next(maps)
        choices = dict(sorted((new[k], v) for k, v in q.choices.items()))
        answer = new[q.answer] if q.kind == "single" else sorted(new[k] for k in q.answer)
        out.append(replace(q, choices=choices, answer=answer, feedback={new[k]: v for k, v in sorted(q.feedback.items(), key=lambda kv: new[kv[0]])}))
    return out


def all_questions() -> dict[str, Question]:
    """Every question of every bank by id (ids are unique across banks)."""
    out: dict[str, Question] = {}
    for name in bank_files():
        for q in _load(name)[0]:
            if q.id in out:
                raise ValueError(f"question id {q.id!r} is in both {out[q.id].bank} and {name}")
            out[q.id] = q
    return out


def questions(bank: str) -> list[Question]:
    """The questions of one bank, in order (a bank's ``draw`` ids first, from other banks)."""
    own, draw = _load(_bank_name(bank))
    every = all_questions() if draw else {}
    unknown = [i for i in draw if i not in every]
    if unknown:
        raise ValueError(f"bank {bank!r} draws unknown question ids {unknown}")
    return [every[i] for i in draw] + list(own)


def handle(bank: str, n: int) -> str:
    """How question ``n`` (1-based) of ``bank`` is shown and answered: "05 Q3", never by its id,
    since an id such as ``05.deepspeed_stage2`` names the answer."""
    return f"{_bank_name(bank).split('_')[0]} Q{n}"


_HANDLE = re.compile(r"\s*(\w+)\s+Q(\d+)\s*", re.IGNORECASE)


def get(question_id: str) -> Question:
    """A question by its id, or by the handle a learner sees (:func:`handle`, e.g. "05 Q3")."""
    shown_as = _HANDLE.fullmatch(question_id)
    if shown_as:
        qs, n = questions(shown_as[1]), int(shown_as[2])
        if not 1 <= n <= len(qs):
            raise KeyError(f"no question {question_id!r}: quiz {shown_as[1]!r} has questions 1 to {len(qs)}")
        return qs[n - 1]
    every = all_questions()
    if question_id not in every:
        raise KeyError(f"no question {question_id!r}; answer by the name shown above each question, "
                       f"e.g. quiz.answer('03 Q2', 'b') (quiz.show('03') lists them)")
    return every[question_id]


def _keys(choice) -> list[str]:
    if isinstance(choice, str):
        choice = choice.replace(",", " ").split() if ("," in choice or " " in choice) else list(choice) if len(choice) > 1 else [choice]
    return [str(c).strip().lower() for c in choice]


_learner: list[str] = []  # the name quiz.learner(...) set, if any


def set_learner(name: str | None) -> None:
    """Give the numeric questions this learner's own numbers from now on (None: the written ones)."""
    _learner[:] = [str(name).strip()] if name and str(name).strip() else []


def learner() -> str | None:
    """The name numeric questions draw their inputs for: quiz.learner(...), else $SHARDLAB_LEARNER."""
    return _learner[0] if _learner else (os.environ.get("SHARDLAB_LEARNER", "").strip() or None)


def for_learner(q: Question, name: str | None = None) -> Question:
    """``q`` with the numbers of learner ``name`` (default: :func:`learner`); as written without one."""
    return quiz_draw.for_learner(q, name if name is not None else learner(), recompute)


def check(question_id: str, choice, learner_name: str | None = None) -> Feedback:
    """Is ``choice`` right? Returns the feedback without printing (``answer`` prints it)."""
    q = for_learner(get(question_id), learner_name)
    shown_as = question_id if _HANDLE.fullmatch(question_id) else "the question"
    if q.kind == "numeric":
        try:
            value = float(str(choice).replace(q.unit, "").strip()) if isinstance(choice, str) else float(choice)
        except (TypeError, ValueError):
            raise ValueError(f"{shown_as} wants a number in {q.unit}, e.g. 14; got {choice!r}") from None
        right = abs(value - q.answer) <= q.tolerance * (1 + 1e-9) + 1e-12  # "at the edge" counts, floats aside
        side = "" if right else q.feedback.get("low" if value < q.answer else "high", "")
        detail = " ".join(filter(None, [side, q.explanation]))
        return Feedback(right, f"{'Right' if right else 'Not quite'}: {value:g} {q.unit}. {detail}")
    picked = _keys(choice)
    unknown = [k for k in picked if k not in q.choices]
    if unknown or not picked or (q.kind == "single" and len(picked) != 1):
        how = "one key" if q.kind == "single" else "a list of keys, e.g. ['a', 'c']"
        raise ValueError(f"{shown_as} wants {how} among {sorted(q.choices)}; got {choice!r}")
    right = set(picked) == q.right_keys()
    if right:
        return Feedback(True, f"Right. {q.explanation}")
    notes = [f"({k}) {q.feedback[k]}" for k in picked if k in q.feedback]
    if q.kind == "multiple" and q.right_keys() - set(picked):
        notes.append("Some right choices are not ticked.")
    return Feedback(False, "Not quite. " + " ".join(notes + [q.explanation]))


_results: dict[str, bool] = {}  # question id -> answered right (at least once)
_final_ids: list[str] = []  # the final quiz's questions, once quiz.final() ran


def record(q: Question, fb: Feedback) -> None:
    """Remember that ``q`` was answered, and whether right (right once stays right)."""
    _results[q.id] = _results.get(q.id, False) or fb.correct


def start_final() -> list[Question]:
    """The final quiz's questions, with its score started afresh (this attempt counts alone)."""
    qs = questions("final")
    _final_ids[:] = [q.id for q in qs]
    for i in _final_ids:
        _results.pop(i, None)
    return qs


def in_final(question_id: str) -> bool:
    """Whether ``question_id`` (an id or a shown handle) counts towards the final quiz's score."""
    return get(question_id).id in _final_ids


def score() -> tuple[int, int]:
    """(right, total) for the final quiz so far."""
    return sum(_results.get(i, False) for i in _final_ids), len(_final_ids)


def recompute(source: dict, unit: str = "") -> float:
    """The number a ``source`` names, from memory_math (or parallelism_math), in the question's unit."""
    from shardlab.instruments import memory_math, parallelism_math

    modules = {"memory_math": memory_math, "parallelism_math": parallelism_math}
    name = source.get("module", "memory_math")
    if name not in modules:
        raise ValueError(f"source names module {name!r}; use one of {sorted(modules)}")
    fn = getattr(modules[name], source["fn"], None)
    if not callable(fn):
        raise ValueError(f"source names {source['fn']!r}, which {name} does not have")
    args = list(source.get("args", []))
    if "shape" in source:
        args.insert(0, parallelism_math.Shape(**source["shape"]))
    value = fn(*args, **source.get("kwargs", {}))
    if "attr" in source:
        value = getattr(value, source["attr"])
    keys = source.get("key", [])
    for k in [keys] if isinstance(keys, str) else keys:
        value = value[k]
    return value / source.get("divide", UNIT_SCALE.get(unit, 1))
