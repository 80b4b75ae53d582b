"""The quiz as ipywidgets: per question the choices, a Check button and a feedback area.

Built on :mod:`shardlab.course.quiz_bank` (the checks), which never imports this module, so the
text fallback (:mod:`shardlab.course.quiz`) never imports ipywidgets.
The feedback widget carries the CSS class ``shardlab-quiz-feedback`` (a browser test finds it).
"""

from __future__ import annotations

import html

import ipywidgets as W

from shardlab.course.quiz_bank import check

FEEDBACK_CLASS = "shardlab-quiz-feedback"


def _picker(q):
    """The input for one question and a function that reads the learner's choice from it."""
    if q.kind == "single":
        pick = W.RadioButtons(options=[(f"{k}) {v}", k) for k, v in q.choices.items()], value=None,
                              layout=W.Layout(width="auto"))
        return pick, lambda: pick.value
    if q.kind == "multiple":
        boxes = {k: W.Checkbox(description=f"{k}) {v}", value=False, indent=False,
                               layout=W.Layout(width="auto")) for k, v in q.choices.items()}
        return W.VBox(list(boxes.values())), lambda: [k for k, b in boxes.items() if b.value]
    box = W.Text(placeholder=f"a number in {q.unit}", layout=W.Layout(width="12em"))
    return W.HBox([box, W.Label(q.unit)]), lambda: box.value.strip()


def question_widget(q, on_check, after=None, label: str = "") -> W.VBox:
    """One question: its text, the choices, Check, and the feedback (right or wrong, and why).
    ``label`` ("Question 3 of 8") stands where an id would: an id can name the answer."""
    picker, chosen = _picker(q)
    button = W.Button(description="Check", button_style="primary")
    feedback = W.HTML(value="")
    feedback.add_class(FEEDBACK_CLASS)

    def on_click(_):
        choice = chosen()
        if choice in (None, "", []):
            feedback.value = "<i>Pick an answer first.</i>"
            return
        try:
            fb = check(q.id, choice)
        except ValueError as e:
            feedback.value = f"<span style='color:#b35900'>{html.escape(str(e))}</span>"
            return
        on_check(q, fb)
        color = "#1a7f37" if fb.correct else "#c62828"
        mark = "✓" if fb.correct else "✗"
        feedback.value = f"<div style='color:{color}'>{mark} {html.escape(fb.text)}</div>"
        if after is not None:
            after()

    button.on_click(on_click)
    title = W.HTML(f"<small style='color:#777'>{html.escape(label)}</small><br><b>{html.escape(q.question)}</b>")
    return W.VBox([title, picker, button, feedback], layout=W.Layout(margin="0 0 1em 0"))


def build(questions, on_check, scored: bool = False, score=None) -> W.VBox:
    """Every question's widget in one column; ``scored`` adds a running score at the bottom."""
    tally = W.HTML()

    def update():
        right, total = score()
        tally.value = f"<b>Score: {right} / {total}</b>"

    items = [question_widget(q, on_check, update if scored else None, f"Question {n} of {len(questions)}")
             for n, q in enumerate(questions, 1)]
    if scored:
        update()
        items.append(tally)
    return W.VBox(items)


def display_questions(questions, on_check, scored: bool = False, score=None) -> None:
    from IPython.display import display

    display(build(questions, on_check, scored, score))
