"""Check-yourself quizzes, as a learner meets them: a widget per question, or plain text.

In a notebook::

    from shardlab.course import quiz
    quiz.show("03")                        # one widget per question: choices, Check, feedback
    quiz.answer("03 Q2", "d")              # the text fallback: prints feedback, returns True/False
    quiz.final()                           # the final quiz, with a running score
    quiz.learner("alice")                  # numeric questions get alice's own numbers from now on

A room can't share one answer sheet: after ``quiz.learner(name)`` (or with ``SHARDLAB_LEARNER``
set) each numeric question draws its inputs (parameters, GPUs, bytes, link...) for that name, and
checks the answer against the formula (:mod:`shardlab.course.quiz_draw`). Without a name, every
question is exactly as written, as on the website.

The questions, answers and checks are in :mod:`shardlab.course.quiz_bank`; the widgets in
:mod:`shardlab.course.quiz_widgets`, which builds on the bank too. This module picks between
them: widgets when ipywidgets and a Jupyter kernel are both there; ``SHARDLAB_NO_WIDGETS=1``
(or ``quiz.show(..., widgets=False)``) forces plain text.
"""

from __future__ import annotations

import os

from shardlab.course import quiz_bank as bank


def learner(name: str | None) -> None:
    """Your own numbers in the numeric questions, drawn for ``name`` (None: back to the written ones)."""
    bank.set_learner(name)
    who = bank.learner()
    print(f"Numeric questions now use the numbers drawn for {who!r}." if who else
          "Numeric questions use the numbers as written.")


def answer(question_id: str, choice) -> bool:
    """The text fallback: print the feedback for ``choice`` and return whether it is right.

    ``question_id`` is the name printed above the question ("03 Q2"); a question's id works too."""
    q = bank.for_learner(bank.get(question_id))
    fb = bank.check(q.id, choice)
    bank.record(q, fb)
    print(("✓ " if fb.correct else "✗ ") + fb.text)
    if bank.in_final(q.id):
        print("Score: {} / {}".format(*bank.score()))
    return fb.correct


def text(q: bank.Question, shown_as: str, n: int, total: int) -> str:
    """A question as plain text, with its choices and how to answer it by ``shown_as`` ("05 Q3").
    Its id is never shown: an id can name the answer."""
    who = bank.learner() if q.vary else None
    lines = [f"Question {n} of {total}{f', numbers for {who}' if who else ''}: {q.question}"]
    lines += [f"   {k}) {v}" for k, v in q.choices.items()]
    how = {"single": '"x"), x: your letter', "multiple": '["x", "y"]), every letter you pick',
           "numeric": f"n), n: your number in {q.unit}"}[q.kind]
    lines.append(f"   answer with: quiz.answer({shown_as!r}, {how}")
    return "\n".join(lines)


def _texts(name: str, qs) -> str:
    return "\n\n".join(text(q, bank.handle(name, n), n, len(qs)) for n, q in enumerate(qs, 1))


def use_widgets() -> bool:
    """ipywidgets and a live Jupyter kernel, unless SHARDLAB_NO_WIDGETS=1 says plain text."""
    if os.environ.get("SHARDLAB_NO_WIDGETS", "").strip() not in ("", "0"):
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _own_numbers_hint(qs) -> None:
    """Tell a learner, once per quiz, how to get their own numbers (when a question has them)."""
    if any(q.vary for q in qs) and not bank.learner():
        print('Working in a group? quiz.learner("your name") gives you your own numbers in the '
              "numeric questions, so that answers cannot be copied.\n")


def show(name: str, widgets: bool | None = None):
    """Show every question of the bank ``name`` ("03" or "03_zero1_zero2"): widgets when possible, else plain text."""
    qs = [bank.for_learner(q) for q in bank.questions(name)]
    _own_numbers_hint(qs)
    if widgets if widgets is not None else use_widgets():
        from shardlab.course.quiz_widgets import display_questions
        return display_questions(qs, on_check=bank.record)
    print(_texts(name, qs))


def final(widgets: bool | None = None):
    """The final quiz (the ``final`` bank), with a running score."""
    qs = [bank.for_learner(q) for q in bank.start_final()]
    _own_numbers_hint(qs)
    if widgets if widgets is not None else use_widgets():
        from shardlab.course.quiz_widgets import display_questions
        return display_questions(qs, on_check=bank.record, scored=True, score=bank.score)
    print(_texts("final", qs))
    print(f"\nEach quiz.answer(...) prints your running score, out of {len(qs)}.")
