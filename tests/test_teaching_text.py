"""What the course says to a learner, read as text: no authors' words, no answer given away,
and a prediction asked for before each measurement it is about.

- No "seed" and no "reference notes" in a notebook's markdown: the course cites its own
  docs/cheatsheet.md, a paper or a PyTorch issue (the quiz banks are checked in test_quiz.py).
- No notebook tells a quiz's correct answer: no ``quiz.answer(id, right_key)`` in any cell, and no
  right choice's text (long enough to be an answer, not a word) in any markdown cell.
- A recap ("What you saw", "Key takeaways") states the quiz's answers, so it comes after the
  notebook's last quiz cell, never above it.
- Notebooks 00-05, 07, 08 and 09 each ask for at least two predictions before the cell that measures them.
"""

import json
import re
from pathlib import Path

import pytest

from shardlab.course import quiz_bank

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PREDICTING = ["00", "01", "02", "03", "04", "05", "07", "08", "09"]
ANSWER_CALL = re.compile(r"""quiz\.answer\(\s*["']([\w.]+(?:\s+Q\d+)?)["']\s*,\s*(\[[^\]]*\]|["'][^"']*["']|[-\d.e]+)""")


def cells(path: Path, kind: str | None = None) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if kind is None or c["cell_type"] == kind]


def plain(text: str) -> str:
    """Lower case, markdown emphasis and line breaks gone, one space between words."""
    return " ".join(re.sub(r"[*_`>]", "", text).lower().split()).rstrip(".")


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 8


LABS = sorted((ROOT / "labs").glob("*.ipynb")) + sorted((ROOT / "labs" / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_authors_words_in_markdown(path):
    for text in cells(path, "markdown"):
        assert not re.search(r"\bseed\b", text, re.I), f"{path.name} says 'seed': {text[:120]!r}"
        assert "reference notes" not in text.lower(), f"{path.name} says 'reference notes'"


def right_answer(call_id: str, given: str):
    """Whether ``quiz.answer(call_id, given)`` as written in a cell would be marked right."""
    try:
        q = quiz_bank.get(call_id)   # an id, or the handle a learner sees ("05 Q3")
    except (KeyError, ValueError):
        return False
    if q.kind == "numeric":
        try:
            return abs(float(given) - q.answer) <= q.tolerance
        except ValueError:
            return False
    keys = re.findall(r"\w+", given.lower())
    return set(keys) == q.right_keys() if q.kind == "multiple" else keys == [q.answer]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_notebook_tells_a_quiz_answer(path):
    texts = cells(path)
    for text in texts:
        for call_id, given in ANSWER_CALL.findall(text):
            assert not right_answer(call_id, given), f"{path.name} tells the answer: quiz.answer({call_id!r}, {given})"
    markdown = plain(" ".join(cells(path, "markdown")))
    for q in quiz_bank.all_questions().values():
        if q.kind == "numeric":
            continue
        for key in q.right_keys():
            answer = plain(q.choices[key])
            if len(answer) >= 40:  # an answer, not a word like "ZeRO-2" that the text must use
                assert answer not in markdown, f"{path.name} tells {q.id}'s answer: {q.choices[key]!r}"


def test_the_check_has_teeth(tmp_path):
    q = quiz_bank.get("04.more_comm")
    told = tmp_path / "told.ipynb"
    told.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": [f"In short: {q.choices[q.answer]}."]},
        {"cell_type": "markdown", "source": [f'Answer with `quiz.answer("{q.id}", "{q.answer}")`.']}]}))
    with pytest.raises(AssertionError, match="tells"):
        test_no_notebook_tells_a_quiz_answer(told)
    assert right_answer(q.id, f'"{q.answer}"') and not right_answer(q.id, '"zz"')
    n = [p.id for p in quiz_bank.questions("04")].index(q.id) + 1   # the handle a learner sees
    assert ANSWER_CALL.findall(f'quiz.answer("04 Q{n}", "{q.answer}")') == [(f"04 Q{n}", f'"{q.answer}"')]
    assert right_answer(f"04 Q{n}", f'"{q.answer}"')


@pytest.mark.parametrize("number", PREDICTING)
def test_two_predictions_before_the_measurement(number):
    (path,) = [p for p in NOTEBOOKS if p.name.startswith(number + "_")]
    code = cells(path, "code")
    asked = [i for i, text in enumerate(code) if re.match(r"predicted_\w+ = ", text.strip())]
    assert len(asked) >= 2, f"{path.name} asks for {len(asked)} predictions"
    for i in asked:
        name = code[i].split("=")[0].strip()
        compared = [j for j, text in enumerate(code) if f"predict.compare({name}" in text]
        assert compared and compared[0] > i, f"{path.name}: {name} is never compared with a measurement after it"


RECAP = re.compile(r"^#+\s*(what you saw|key takeaways|in short|recap)\b", re.I | re.M)
QUIZ_CALL = re.compile(r"quiz\.(show|final)\(")


def recap_before_quiz(path: Path) -> str | None:
    """The first recap heading that sits above the notebook's last quiz cell, if any."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    kinds = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    quizzes = [i for i, (kind, text) in enumerate(kinds) if kind == "code" and QUIZ_CALL.search(text)]
    for kind, text in kinds[:quizzes[-1]] if quizzes else []:
        found = RECAP.search(text) if kind == "markdown" else None
        if found:
            return found.group(0)
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_recap_comes_after_the_quiz(path):
    """A "What you saw" recap states the quiz's answers, so it follows the quiz, never precedes it."""
    assert recap_before_quiz(path) is None, f"{path.name}: {recap_before_quiz(path)!r} comes before the quiz"


def test_the_recap_check_has_teeth(tmp_path):
    nb = tmp_path / "early.ipynb"
    nb.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["## What you saw\n", "\n", "- ZeRO-1 shards the optimizer state."]},
        {"cell_type": "code", "source": ['quiz.show("03")']}]}))
    assert recap_before_quiz(nb) == "## What you saw"
