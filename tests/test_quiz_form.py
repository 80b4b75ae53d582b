"""The quiz as a room meets it: the key can't be guessed by its letter or its length, and each
learner can get their own numbers in the numeric questions.

- Choices are shown in a stable shuffled order with balanced key positions (``quiz_order``):
  no letter holds more than 40% of a bank's keys, nor of all banks' keys.
- The key is the longest choice in at most 40% of a bank's single-choice questions, and across
  all banks it is not the shortest in more than 40% either (so "avoid the longest" wins nothing).
- ``quiz.learner(name)`` (or ``SHARDLAB_LEARNER``) draws a numeric question's inputs for that
  name; the answer is checked against the formula; without a name the question is as written.
"""

import json

import pytest
from support import slowdown

from shardlab.course import quiz, quiz_bank, quiz_draw, quiz_order

BANKS = sorted(quiz_bank.bank_files())
EVERY = [q for name in BANKS for q in quiz_bank._load(name)[0]]
LIMIT = 0.40  # no letter, and no "pick the longest", may win more than 40% of a bank's keys


def shown_banks() -> dict[str, list]:
    """Each bank's choice questions as a learner sees them (choices relabelled by quiz_order)."""
    return {name: [q for q in quiz_bank.questions(name) if q.kind != "numeric"] for name in BANKS}


def longest_share(qs) -> tuple[int, int]:
    """(single-choice questions whose key is strictly longer than every other choice, all of them)."""
    singles = [q for q in qs if q.kind == "single"]
    longest = [q for q in singles if len(q.choices[q.answer]) > max(len(v) for k, v in q.choices.items() if k != q.answer)]
    return len(longest), len(singles)


def shortest_share(qs) -> tuple[int, int]:
    singles = [q for q in qs if q.kind == "single"]
    shortest = [q for q in singles if len(q.choices[q.answer]) < min(len(v) for k, v in q.choices.items() if k != q.answer)]
    return len(shortest), len(singles)


def position_problem(qs, where: str) -> str | None:
    counts = quiz_order.position_counts([sorted(q.right_keys()) for q in qs])
    total = sum(counts.values())
    letter, most = counts.most_common(1)[0]
    if most > LIMIT * total:
        return f"{where}: {most} of {total} keys are '{letter}' ({dict(sorted(counts.items()))})"
    return None


def length_problem(qs, where: str) -> str | None:
    longest, singles = longest_share(qs)
    if longest > LIMIT * singles:
        return f"{where}: the key is the longest choice in {longest} of {singles} questions"
    return None


@pytest.mark.parametrize("name", BANKS)
def test_no_letter_holds_more_than_40_percent_of_a_banks_keys(name):
    assert position_problem(shown_banks()[name], name) is None


@pytest.mark.parametrize("name", BANKS)
def test_the_key_is_the_longest_choice_in_at_most_40_percent_of_a_bank(name):
    assert length_problem(shown_banks()[name], name) is None


def test_across_all_banks_neither_letter_nor_length_gives_the_key_away():
    every = [q for qs in shown_banks().values() for q in qs]
    assert position_problem(every, "all banks") is None
    assert length_problem(every, "all banks") is None
    shortest, singles = shortest_share(every)  # "never the longest" must not become "the shortest"
    assert shortest <= LIMIT * singles, f"the key is the shortest choice in {shortest} of {singles} questions"


def test_the_form_checks_have_teeth():
    """Five questions with every key on one letter fail the position check; keys padded to be
    the longest fail the length check."""
    q = next(q for q in EVERY if q.kind == "single")
    fields = {k: getattr(q, k) for k in q.__dataclass_fields__}
    assert position_problem([q] * 5, "one letter") is not None
    padded = quiz_bank.Question(**{**fields, "choices": {**q.choices, q.answer: q.choices[q.answer] + " " + "x" * 200}})
    assert length_problem([padded] * 3, "padded") is not None


def _raw_questions(path):
    return [quiz_bank.Question(bank=path.stem, **raw) for raw in json.loads(path.read_text(encoding="utf-8"))["questions"]]


def test_the_order_is_the_same_in_every_process_and_balanced():
    """Relabelling is a pure function of the bank: a fresh process sees the same letters, and
    twelve three-choice questions get four keys on each letter, whatever order they are written in."""
    import subprocess
    import sys

    code = "from shardlab.course import quiz_bank as b; print(sorted((q.id, str(q.answer), list(q.choices.values())) for q in b.all_questions().values()))"
    here = sorted((q.id, str(q.answer), list(q.choices.values())) for q in quiz_bank.all_questions().values())
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=slowdown(60),
                           env={**__import__("os").environ, "PYTHONHASHSEED": "123"}).stdout
    assert other.strip() == str(here)
    maps = quiz_order.relabel([(f"x.{i}", ["a", "b", "c"], {"a"}) for i in range(12)])
    assert sorted(quiz_order.position_counts([[m["a"]] for m in maps]).values()) == [4, 4, 4]
    assert all(sorted(m.values()) == ["a", "b", "c"] for m in maps)
    assert len({tuple(m.items()) for m in maps}) > 1, "the distractors are shuffled too"


def test_a_shown_question_keeps_its_feedback_with_its_choice():
    for path in quiz_bank.bank_files().values():
        for raw in _raw_questions(path):
            if raw.kind == "numeric":
                continue
            shown = quiz_bank.get(raw.id)
            assert sorted(shown.choices.values()) == sorted(raw.choices.values())
            assert {shown.choices[k] for k in shown.right_keys()} == {raw.choices[k] for k in raw.right_keys()}
            assert {shown.choices[k]: v for k, v in shown.feedback.items()} == {raw.choices[k]: v for k, v in raw.feedback.items()}
            assert list(shown.choices) == sorted(shown.choices)


# --- Numeric questions with a learner's own numbers ----------------------------------------

VARIED = [q for q in EVERY if q.vary]


def test_some_numeric_questions_give_each_learner_their_own_numbers():
    assert len(VARIED) >= 5 and {q.bank for q in VARIED} >= {"01_memory_math", "02_data_parallel", "03_zero1_zero2"}


@pytest.mark.parametrize("q", VARIED, ids=lambda q: q.id)
def test_without_a_name_the_question_is_as_written(q, monkeypatch):
    monkeypatch.delenv("SHARDLAB_LEARNER", raising=False)
    quiz_bank.set_learner(None)
    assert quiz_bank.for_learner(q) is q
    written = quiz_draw.fill(q.source, quiz_draw.inputs(q, None))
    assert abs(quiz_bank.recompute(written, q.unit) - q.answer) <= q.tolerance, "the first inputs are the written ones"
    assert q.vary["question"].format(**quiz_draw.inputs(q, None), answer=q.answer) == q.question


@pytest.mark.parametrize("q", VARIED, ids=lambda q: q.id)
def test_two_learners_get_different_numbers_each_checked_against_the_formula(q):
    alice, bob = quiz_bank.for_learner(q, "alice"), quiz_bank.for_learner(q, "bob")
    drawn = [quiz_draw.inputs(q, name) for name in ("alice", "bob", "carol", "dan")]
    assert all(d != quiz_draw.inputs(q, None) for d in drawn), "a learner never gets the written numbers"
    assert len({tuple(sorted(d.items())) for d in drawn}) > 1
    assert quiz_bank.for_learner(q, "alice") == alice, "the same name gets the same numbers"
    for name, shown in (("alice", alice), ("bob", bob)):
        v = quiz_draw.inputs(q, name)
        if q.id == "07.pp_bubble":  # the formula, written out here rather than read from the source
            expect = 100 * (v["stages"] - 1) / (v["micro"] + v["stages"] - 1)
        elif q.id == "02.ring_bytes":
            expect = 2 * (v["gpus"] - 1) / v["gpus"] * v["gb"]
        elif q.id == "05.bandwidth_needed":
            expect = 3 * v["billions"] * 1e9 * (v["gpus"] - 1) / v["gpus"] * 2 * 8 / v["seconds"] / 1e9
        else:
            per_gpu = {"01.replica_gb": 16, "03.zero1_gb": 4 + 12 / v.get("gpus", 1)}.get(q.id, 16 / v.get("gpus", 1))
            expect = v["billions"] * per_gpu
        assert abs(shown.answer - expect) <= 1e-6 * abs(expect), (name, v)
        assert quiz_bank.check(q.id, expect, name).correct
        assert not quiz_bank.check(q.id, expect * 1.3 + 1, name).correct
        assert str(v[next(iter(v))]).rstrip("0").rstrip(".") in shown.question or f"{v[next(iter(v))]:g}" in shown.question


def test_quiz_learner_sets_the_numbers_for_show_and_answer(monkeypatch, capsys):
    monkeypatch.setenv("SHARDLAB_NO_WIDGETS", "1")
    monkeypatch.delenv("SHARDLAB_LEARNER", raising=False)
    q = quiz_bank.get("01.zero3_gb_per_gpu")
    try:
        quiz.learner("alice")
        mine = quiz_bank.for_learner(q, "alice")
        quiz.show("01")
        out = capsys.readouterr().out
        assert mine.question in out and "numbers for alice" in out and q.question not in out
        assert quiz.answer(q.id, mine.answer) is True
        assert (quiz.answer(q.id, q.answer) is False) == (abs(mine.answer - q.answer) > mine.tolerance)
    finally:
        quiz.learner(None)
    monkeypatch.setenv("SHARDLAB_LEARNER", "bob")
    assert quiz_bank.learner() == "bob" and quiz_bank.check(q.id, quiz_bank.for_learner(q, "bob").answer).correct
    monkeypatch.delenv("SHARDLAB_LEARNER")
    assert quiz_bank.check(q.id, q.answer).correct


@pytest.mark.parametrize("name", BANKS)
def test_a_shown_question_never_carries_its_id(name, monkeypatch, capsys):
    """An id like 05.deepspeed_stage2 names the answer: the text fallback and the widget show a
    neutral "Question n of N", and the handle the fallback prints answers the right question."""
    monkeypatch.setenv("SHARDLAB_NO_WIDGETS", "1")
    monkeypatch.delenv("SHARDLAB_LEARNER", raising=False)
    quiz.final() if name == "final" else quiz.show(name)
    out = capsys.readouterr().out
    qs = quiz_bank.questions(name)
    for n, q in enumerate(qs, 1):
        slug = q.id.split(".", 1)[1]   # a one-word slug ("activations") may be in the text itself
        assert q.id not in out and ("_" not in slug or slug not in out), f"{name} shows {q.id}"
        assert f"Question {n} of {len(qs)}" in out
        assert quiz_bank.get(quiz_bank.handle(name, n)).id == q.id
    assert out.count("answer with: quiz.answer(") == len(qs)
    quiz_widgets = pytest.importorskip("shardlab.course.quiz_widgets")
    box = quiz_widgets.build(qs, on_check=lambda q, fb: None)
    titles = [item.children[0].value for item in box.children]
    assert all(q.id not in t and f"Question {n} of {len(qs)}" in t for n, (q, t) in enumerate(zip(qs, titles), 1))
