"""The quiz banks obey the rules, and the quiz says right and wrong correctly.

The rules are checked over every bank present in the package (banks are written on several
branches): exactly the right answers marked, every distractor with its feedback, unique ids,
numeric answers recomputed from their source, the course's two check-yourself questions word
for word in the notebook that teaches each, enough prediction and scaling questions, and no word
meant for the course's authors ("seed", "reference notes") in any learner-facing text.
"""

import json
import re

import pytest

from shardlab.course import quiz, quiz_bank, quiz_draw

BANKS = sorted(quiz_bank.bank_files())
EVERY = [q for name in BANKS for q in quiz_bank._load(name)[0]]
CHECK_YOURSELF = {  # the course's two check-yourself questions, word for word, with their answers
    "Which state does ZeRO-1 shard?": ("03", "Only the optimizer state."),
    "Why does FSDP use more communication than DDP?": (
        "04", "It gathers the full weights for each unit during forward and backward, instead of "
              "keeping a full copy on every GPU."),
}
MEMORY_UNITS = {"GB", "GiB", "MB", "MiB", "KB", "bytes", "B"}


def test_the_course_banks_are_there():
    assert {"01_memory_math", "02_data_parallel"} <= set(BANKS)
    for name in BANKS:
        data = json.loads(quiz_bank.bank_files()[name].read_text())
        if name != "final":
            assert data["notebook"] == name, f"{name}.json names notebook {data['notebook']!r}"


@pytest.mark.parametrize("q", EVERY, ids=lambda q: q.id)
def test_exactly_the_right_answers_are_marked(q):
    assert quiz_bank.problems(q) == []
    if q.kind == "numeric":
        return
    right = q.right_keys()
    assert right and right <= set(q.choices)
    assert set(q.feedback) == set(q.choices) - right, "every distractor, and only they, has feedback"
    assert all(text.strip() for text in q.feedback.values())
    if q.kind == "single":
        assert isinstance(q.answer, str)


@pytest.mark.parametrize("q", EVERY, ids=lambda q: q.id)
def test_check_agrees_with_the_key(q):
    if q.kind == "numeric":
        assert quiz_bank.check(q.id, q.answer).correct and quiz_bank.check(q.id, q.answer + q.tolerance).correct
        high = quiz_bank.check(q.id, q.answer + q.tolerance + max(1, abs(q.answer)))
        low = quiz_bank.check(q.id, q.answer - q.tolerance - max(1, abs(q.answer)))
        assert not high.correct and not low.correct
        assert q.feedback.get("high", "") in high.text and q.feedback.get("low", "") in low.text
        return
    right = sorted(q.right_keys())
    ok = quiz_bank.check(q.id, right[0] if q.kind == "single" else right)
    assert ok.correct and q.explanation in ok.text
    for wrong in sorted(set(q.choices) - set(right)):
        fb = quiz_bank.check(q.id, wrong if q.kind == "single" else right + [wrong])
        assert not fb.correct and q.feedback[wrong] in fb.text, f"{q.id}: choice {wrong}"
    if q.kind == "multiple" and len(right) > 1:
        assert not quiz_bank.check(q.id, right[:-1]).correct  # a right choice left unticked


def test_ids_are_unique_and_named_after_their_bank():
    every = quiz_bank.all_questions()  # raises on a duplicate id
    assert len(every) == len(EVERY)
    for q in EVERY:
        if q.bank != "final":
            assert q.id.startswith(q.bank.split("_")[0] + "."), q.id


@pytest.mark.parametrize("name", [b for b in BANKS if b != "final"])
def test_each_notebook_has_three_questions_beyond_check_yourself(name):
    qs = quiz_bank.questions(name)
    assert sum(not q.check_yourself for q in qs) >= 3


def test_banks_01_to_04_cover_the_course():
    present = {b.split("_")[0] for b in BANKS}
    assert {"01", "02", "03", "04", "05", "06", "07", "final"} <= present, sorted(present)
    assert sum(len(quiz_bank.questions(b)) for b in ("01", "02", "03", "04")) >= 16


@pytest.mark.parametrize("text", sorted(CHECK_YOURSELF))
def test_check_yourself_question_word_for_word_in_its_notebook(text):
    home, answer = CHECK_YOURSELF[text]
    marked = [q for q in EVERY if q.check_yourself]
    assert all(q.question in CHECK_YOURSELF for q in marked), "a check_yourself question must quote it exactly"
    found = [q for q in quiz_bank.questions(home) if q.question == text]
    assert len(found) == 1 and found[0].check_yourself, f"{text!r} must be in bank {home}, marked check_yourself"
    assert answer in found[0].explanation, "the answer is the explanation"


def test_banks_ask_for_predictions_and_scaling():
    predictions = [q.id for q in EVERY if q.prediction]
    assert len(predictions) >= 4, predictions


@pytest.mark.parametrize("name", BANKS)
def test_no_authors_words_in_a_bank(name):
    raw = quiz_bank.bank_files()[name].read_text(encoding="utf-8")
    assert not re.search(r"\bseed\b", raw, re.I), f"{name}.json says 'seed': cite docs/cheatsheet.md, a paper or an issue"
    assert "reference notes" not in raw.lower(), f"{name}.json says 'reference notes'"


@pytest.mark.parametrize("q", [q for q in EVERY if q.kind == "numeric"], ids=lambda q: q.id)
def test_numeric_answers_agree_with_memory_math(q):
    if q.unit in MEMORY_UNITS:
        assert q.source, f"{q.id}: a memory number must name its memory_math source"
    if q.source is None:
        pytest.skip("no memory_math source")
    source = quiz_draw.fill(q.source, quiz_draw.inputs(q, None)) if q.vary else q.source  # the written inputs
    assert abs(quiz_bank.recompute(source, q.unit) - q.answer) <= q.tolerance


def test_recompute_reads_a_parallelism_math_source():
    src = {"module": "parallelism_math", "fn": "pipeline_parallel", "args": [8, 32], "attr": "extra", "key": "bubble",
           "shape": {"params": 7e9, "layers": 32, "hidden": 4096, "seq": 4096, "batch": 64}}
    assert quiz_bank.recompute(src) == 7 / 39
    with pytest.raises(ValueError, match="use one of"):
        quiz_bank.recompute({"module": "os", "fn": "getcwd"})


def test_recompute_reads_a_source():
    assert quiz_bank.recompute({"fn": "model_state_bytes", "args": [7e9, 8], "key": "zero3"}, "GB") == 14
    src = {"fn": "model_state_breakdown", "args": [7e9, 8], "key": ["zero1", "optimizer"], "divide": 1e9}
    assert quiz_bank.recompute(src) == 10.5
    with pytest.raises(ValueError, match="memory_math does not have"):
        quiz_bank.recompute({"fn": "no_such_fn"})


def test_text_fallback_prints_and_answer_returns_the_verdict(monkeypatch, capsys):
    monkeypatch.setenv("SHARDLAB_NO_WIDGETS", "1")
    assert not quiz.use_widgets()
    quiz.show("01")
    out = capsys.readouterr().out
    for n, q in enumerate(quiz_bank.questions("01"), 1):
        assert q.question in out and f"quiz.answer('01 Q{n}'" in out   # the shown handle, not the id
        for choice in q.choices.values():
            assert choice in out
    n, q = next((n, q) for n, q in enumerate(quiz_bank.questions("01"), 1) if q.kind == "single")
    wrong = sorted(set(q.choices) - {q.answer})[0]
    assert quiz.answer(f"01 Q{n}", q.answer) is True
    assert "✓" in capsys.readouterr().out
    assert quiz.answer(f"01 q{n}", wrong.upper()) is False  # keys and handles are read case-insensitively
    assert q.feedback[wrong] in capsys.readouterr().out
    assert quiz.answer(q.id, q.answer) is True   # an id still answers (old notebooks, the tests)
    with pytest.raises(KeyError, match="questions 1 to"):
        quiz.answer("01 Q99", "a")


def test_bad_answers_get_a_clear_error():
    with pytest.raises(KeyError, match="no question"):
        quiz_bank.check("01.nope", "a")
    with pytest.raises(ValueError, match="among"):
        quiz_bank.check("01.bytes_per_param", "z")
    with pytest.raises(ValueError, match="wants a number"):
        quiz_bank.check("01.zero3_gb_per_gpu", "fourteen")
    with pytest.raises(ValueError, match="no single quiz bank"):
        quiz_bank.questions("99")


def test_the_rules_have_teeth():
    good = quiz_bank.questions("01")[0]
    fields = {k: getattr(good, k) for k in good.__dataclass_fields__}
    no_feedback = quiz_bank.Question(**{**fields, "feedback": {}})
    bad_key = quiz_bank.Question(**{**fields, "answer": "z"})
    assert quiz_bank.problems(good) == []
    assert any("feedback" in p for p in quiz_bank.problems(no_feedback))
    assert any("not among the choices" in p for p in quiz_bank.problems(bad_key))


def test_a_varied_question_needs_an_input_that_can_vary():
    """Every input with one value: no learner's numbers could differ from the written ones."""
    varied = next(q for b in quiz_bank.bank_files() for q in quiz_bank.questions(b) if q.vary)
    assert quiz_bank.problems(varied) == []
    fixed = {k: v[:1] for k, v in varied.vary["inputs"].items()}
    stuck = quiz_bank.Question(**{**{k: getattr(varied, k) for k in varied.__dataclass_fields__},
                                  "vary": {**varied.vary, "inputs": fixed}})
    assert any("two or more values" in p for p in quiz_bank.problems(stuck))


def _bank(tmp_path, name, questions, **extra):
    (tmp_path / f"{name}.json").write_text(json.dumps({"notebook": name, "questions": questions, **extra}))


def test_final_quiz_draws_from_banks_and_keeps_score(tmp_path, monkeypatch, capsys):
    q = {"id": "01.x", "kind": "single", "question": "Pick a.", "choices": {"a": "A", "b": "B"},
         "answer": "a", "feedback": {"b": "not b"}, "explanation": "a it is"}
    _bank(tmp_path, "01_memory_math", [q])
    _bank(tmp_path, "final", [{**q, "id": "final.y"}], draw=["01.x"])
    monkeypatch.setattr(quiz_bank, "BANKS", tmp_path)
    quiz.final(widgets=False)
    assert "Pick a." in capsys.readouterr().out
    assert quiz.answer("01.x", "b") is False and "Score: 0 / 2" in capsys.readouterr().out
    assert quiz.answer("01.x", "a") is True and "Score: 1 / 2" in capsys.readouterr().out
    assert quiz.answer("final.y", "a") is True and "Score: 2 / 2" in capsys.readouterr().out


def test_a_broken_bank_names_the_problem(tmp_path, monkeypatch):
    bad = {"id": "01.x", "kind": "single", "question": "?", "choices": {"a": "A", "b": "B"},
           "answer": "c", "feedback": {"b": "no"}, "explanation": "e"}
    _bank(tmp_path, "01_memory_math", [bad])
    monkeypatch.setattr(quiz_bank, "BANKS", tmp_path)
    with pytest.raises(ValueError, match="01_memory_math.json: 01.x: answer key"):
        quiz_bank.questions("01")


def test_widget_check_button_fills_the_feedback():
    W = pytest.importorskip("ipywidgets")
    from shardlab.course import quiz_widgets

    qs = [q for q in quiz_bank.questions("01") if q.kind == "single"][:1]
    seen = []
    box = quiz_widgets.build(qs, on_check=lambda q, fb: seen.append(fb.correct))
    title, picker, button, feedback = box.children[0].children
    assert isinstance(button, W.Button) and button.description == "Check"
    assert "shardlab-quiz-feedback" in feedback._dom_classes
    button.click()
    assert "Pick an answer first" in feedback.value and seen == []
    picker.value = sorted(set(qs[0].choices) - {qs[0].answer})[0]
    button.click()
    assert "✗" in feedback.value and seen == [False]
    picker.value = qs[0].answer
    button.click()
    assert "✓" in feedback.value and seen == [False, True]



@pytest.mark.parametrize("bank", sorted(quiz_bank.bank_files()))
def test_every_question_builds_as_the_widget_a_learner_clicks(bank):
    """nbval runs the notebooks with the plain-text quizzes the website shows (Makefile); here
    every question of every bank is built as its widget, and its Check button answers."""
    W = pytest.importorskip("ipywidgets")
    from shardlab.course import quiz_widgets

    qs = quiz_bank.questions(bank)
    box = quiz_widgets.build(qs, on_check=lambda q, fb: None)
    items = [c for c in box.children if isinstance(c, W.VBox) and len(c.children) == 4]
    assert len(items) == len(qs), f"{bank}: {len(items)} question widgets for {len(qs)} questions"
    for q, item in zip(qs, items):
        title, _, button, feedback = item.children
        assert isinstance(button, W.Button) and button.description == "Check", q.id
        button.click()  # no answer picked yet: the feedback says so, it does not raise
        assert feedback.value, f"{q.id}: Check gave no feedback"
