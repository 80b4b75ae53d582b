"""workshop/AGENDA.md against the repository: every notebook and lab it names exists, every
slot is at least the part's recorded nbval time, quoted times match workshop/timings.json,
the clock adds up, and the full day with its add-ons covers every notebook and lab there is."""

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGENDA = (ROOT / "workshop" / "AGENDA.md").read_text()
TIMINGS = json.loads((ROOT / "workshop" / "timings.json").read_text())["runs"]
LABS = ["lab1_shard_and_gather", "lab2_zero1", "lab3_zero2", "lab4_fsdp_unit", "lab5_prefetch", "lab6_diagnose"]
ROW = re.compile(r"^\| (\d\d):(\d\d) \| (.*?) \|\s*(?:(\d+) min)?\s*\|\s*(.*?)\s*\|", re.M)


def plans() -> dict[str, list[dict]]:
    """Each '## ' section's table rows: start (minutes), part, slot (minutes), ci text."""
    out = {}
    for section in AGENDA.split("\n## ")[1:]:
        title = section.splitlines()[0]
        rows = [dict(start=int(h) * 60 + int(m), part=part, slot=int(slot) if slot else None, ci=ci.strip())
                for h, m, part, slot, ci in ROW.findall(section)]
        if rows:
            out[title] = rows
    return out


def path_of(part: str) -> str | None:
    found = re.search(r"`((?:notebooks|labs)/[\w./-]+)`", part)
    return found.group(1) if found else None


def exists(path: str) -> bool:
    if path.startswith("notebooks/"):
        return (ROOT / path).is_file()
    name = path.removeprefix("labs/")  # a lab is a notebook, a folder or a script named after it
    return any(p.name.split(".")[0] == name for p in (ROOT / "labs").glob(f"{name}*")) if (ROOT / "labs").is_dir() else False


def test_two_plans_half_and_full_day_then_add_ons():
    titles = [t.split(" (")[0] for t in plans()]
    assert titles[:2] == ["Half day", "Full day"] and all(t.startswith("Add-on") for t in titles[2:]), titles


@pytest.mark.parametrize("path", sorted({path_of(r["part"]) for rows in plans().values() for r in rows} - {None}))
def test_every_named_notebook_and_lab_exists(path):
    assert exists(path), f"AGENDA.md names {path}, which is not in the repository"


def test_slots_cover_the_recorded_times_and_quote_them_exactly():
    for title, rows in plans().items():
        for r in rows:
            path = path_of(r["part"])
            if path is None:
                continue
            path = path if path in TIMINGS or path.endswith(".ipynb") else f"{path}.ipynb"  # a lab's notebook
            if path in TIMINGS:
                seconds = TIMINGS[path]["seconds"]
                assert r["slot"] * 60 >= seconds, f"{title}: {path} gets {r['slot']} min, runs {seconds} s"
                assert r["ci"] == f"{math.ceil(seconds)} s", f"{title}: {path} quotes {r['ci']!r}, timings.json says {seconds} s"
            else:
                assert r["ci"] == "—", f"{title}: {path} quotes {r['ci']!r} but timings.json has no time for it"


def test_the_clock_adds_up():
    for title, rows in plans().items():
        for here, nxt in zip(rows, rows[1:]):
            assert here["start"] + here["slot"] == nxt["start"], f"{title}: {here['part']} does not end when the next starts"
        assert rows[-1]["part"] == "end"
    half, full = list(plans().values())[:2]
    assert half[-1]["start"] - half[0]["start"] <= 4 * 60 and full[-1]["start"] - full[0]["start"] <= 8 * 60


def test_the_full_day_and_its_add_ons_cover_every_notebook_and_lab():
    named = {path_of(r["part"]) for rows in list(plans().values())[1:] for r in rows}
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks <= named, f"not in the full day: {sorted(notebooks - named)}"
    assert {f"labs/{lab}" for lab in LABS} <= named


def test_timings_say_when_and_where():
    for path, row in TIMINGS.items():
        assert (ROOT / path).exists(), f"timings.json has {path}, which is gone"
        assert row["seconds"] > 0 and row["date"] and "core" in row["machine"] and "nbval" in row["command"]


def test_every_notebook_has_instructor_notes():
    notes = ROOT / "workshop" / "notes"
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert (notes / f"{nb.stem}.md").is_file(), f"workshop/notes/{nb.stem}.md is missing"
    assert (notes / "labs.md").is_file()
    index = (notes / "README.md").read_text()
    for note in notes.glob("*.md"):
        if note.name != "README.md":
            assert f"({note.name})" in index, f"notes/README.md does not link {note.name}"


WORD = re.compile(r"\w+(?:['’-]\w+)*")
COUNTS = re.compile(r"^\| (\d\d_\w+) \| (\d+) \| (\d+) \| (\d+) \| (\d+)[^|]* \| *\| (\d+) min \|", re.M)


def prose_words(markdown: str) -> int:
    """AGENDA.md's method: fenced and 4-space-indented code, inline code and link targets out,
    then word tokens (letters and digits, with inner hyphens and apostrophes)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", text))
    return len(WORD.findall(text))


def counted(stem: str) -> tuple[int, int, int, int]:
    """(words, code cells, predictions, quiz questions) of one notebook, counted afresh."""
    nb = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    words = sum(prose_words("".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "markdown")
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    predictions = sum(bool(re.search(r"^predicted_\w+\s*=\s*None", c, re.M)) for c in code)
    banks = [stem] + (["final"] if stem.startswith("07") else [])  # 07 shows the final quiz too
    quiz = sum(len(json.loads(p.read_text())["questions"])
               for p in (ROOT / "src/shardlab/course/quizzes" / f"{b}.json" for b in banks) if p.exists())
    return words, len(code), predictions, quiz


def test_every_notebook_has_a_counts_row_and_its_slot_follows_the_rule():
    """The counts behind each slot are the notebook's own today (words within 5%, the rest
    exact), and the slot is the rule's: words at 180 a minute, half a minute a code cell, a
    minute and a half a prediction, a minute a quiz question, rounded up to 5 minutes."""
    rows = {m[0]: tuple(int(x) for x in m[1:]) for m in COUNTS.findall(AGENDA)}
    assert sorted(rows) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")), sorted(rows)
    for stem, (words, code, predictions, quiz, slot) in rows.items():
        real = counted(stem)
        assert abs(words - real[0]) <= 0.05 * real[0], f"{stem}: AGENDA says {words} words, the notebook has {real[0]}"
        assert (code, predictions, quiz) == real[1:], f"{stem}: AGENDA says {(code, predictions, quiz)}, counted {real[1:]}"
        minutes = real[0] / 180 + 0.5 * real[1] + 1.5 * real[2] + real[3]
        assert slot == 5 * math.ceil(minutes / 5), f"{stem}: slot {slot} min, the rule gives {minutes:.1f} min"


def test_each_plan_gives_a_notebook_the_slot_its_counts_give():
    slots = {m[0]: int(m[5]) for m in COUNTS.findall(AGENDA)}
    for title, rows in plans().items():
        for r in rows:
            path = path_of(r["part"])
            if path and path.startswith("notebooks/"):
                stem = Path(path).stem
                assert r["slot"] == slots[stem], f"{title}: {stem} has {r['slot']} min, its counts give {slots[stem]}"
