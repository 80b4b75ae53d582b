"""The word "measured" in a notebook's or a lab's markdown stands beside a measurement.

Rule one of the course: what it calls measured was measured on live ranks. The values carry
that by construction (``shardlab.instruments.measured``: ``side_by_side`` and
``predict.compare`` refuse a formula in the measured place); this test holds the prose to it.

The rule, exactly. Each occurrence of the word "measured" (any case, as a whole word) in a
markdown cell must satisfy one of:

1. **Its section measures.** A section runs from a markdown heading line (``#``…) to the next
   heading line, across cells; text before a cell's first heading belongs to the section
   above it. The section passes when one of its code cells calls an instrument: a name in
   ``INSTRUMENTS`` called or passed on (followed by ``(``, ``,`` or ``)``: ``shardlab.memory_report(...)``,
   ``cluster.run(lab3.gradient_peak, ...)``, ``side_by_side(...)``,
   which only takes measured values, ``Measured(...)``, a value read off a rank and tagged).
2. **Its sentence names the instrument** (a name in ``INSTRUMENTS``, e.g. "measured with
   `shardlab.saved_activations`").
3. **Its sentence names another notebook** ("notebook 03", "notebooks 03 and 04") and every
   notebook named calls an instrument somewhere.
4. **It is not a claim that something here was measured**: the word is negated or modal
   ("not measured", "never measured", "cannot be measured", "can be measured"), or the
   sentence says who else measured it: one of ``PUBLISHED`` (a published run, cited).

A sentence is the text between sentence ends (``.``, ``!``, ``?`` before a space, or a blank line).
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb")) + sorted((ROOT / "labs" / "solutions").glob("*.ipynb"))

INSTRUMENTS = ("memory_report", "track_memory", "saved_activations", "count_comm", "trace", "time_steps",
               "time_links", "stage_memory", "collective_times", "timed_rounds", "planner_calibrate.measure",
               "gpu_results", "side_by_side", "Measured", "emulate_link", "gradient_peak")
PUBLISHED = ("Megatron-LM", "torchtitan", "Ultra-Scale Playbook", "et al.", "published")
WORD = re.compile(r"\bmeasured\b", re.I)
NOT_A_CLAIM = re.compile(r"\b(not|never|be)\s+$", re.I)
HEADING = re.compile(r"^#{1,6} ", re.M)
NOTEBOOK_REF = re.compile(r"\bnotebooks?\s+((?:\d\d(?:,\s*|\s+and\s+|\s*)?)+)", re.I)
INSTRUMENT_CALL = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in INSTRUMENTS) + r")(?:\.\w+)?\s*[(,)]")
INSTRUMENT_NAME = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in INSTRUMENTS) + r")\b")


def sections(path: Path) -> list[tuple[str, list[str]]]:
    """(markdown text, code cells) per section, in order (see the module doc)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    out = [["", []]]
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code":
            out[-1][1].append(text)
        elif cell["cell_type"] == "markdown":
            starts = [m.start() for m in HEADING.finditer(text)]
            if not starts or starts[0] > 0:
                out[-1][0] += "\n\n" + text[: starts[0] if starts else len(text)]
            for a, b in zip(starts, starts[1:] + [len(text)]):
                out.append([text[a:b], []])
    return [(t, c) for t, c in out]


def sentence_at(text: str, i: int) -> str:
    ends = list(re.finditer(r"[.!?](?=\s)|\n\s*\n", text))
    start = max([e.end() for e in ends if e.end() <= i], default=0)
    end = min([e.start() for e in ends if e.start() >= i], default=len(text))
    return text[start:end + 1]


def measures(path: Path) -> bool:
    return any(INSTRUMENT_CALL.search(code) for _, codes in sections(path) for code in codes)


def named_notebooks(sentence: str) -> list[Path]:
    nums = [n for m in NOTEBOOK_REF.finditer(sentence) for n in re.findall(r"\d\d", m.group(1))]
    return [p for n in nums for p in BOOKS if p.name.startswith(n)]


def unbacked(path: Path) -> list[str]:
    """Each "measured" in ``path``'s markdown that breaks the rule, with its sentence."""
    bad = []
    for text, codes in sections(path):
        section_measures = any(INSTRUMENT_CALL.search(code) for code in codes)
        for m in WORD.finditer(text):
            sentence = sentence_at(text, m.start())
            named = named_notebooks(sentence)
            if section_measures or INSTRUMENT_NAME.search(sentence) \
                    or NOT_A_CLAIM.search(text[: m.start()][-12:]) \
                    or any(p in sentence for p in PUBLISHED) \
                    or (named and all(measures(p) for p in named)):
                continue
            bad.append(" ".join(sentence.split()))
    return bad


@pytest.mark.parametrize("path", BOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_measured_stands_beside_a_measurement(path):
    bad = unbacked(path)
    assert not bad, (f"{path.name}: 'measured' with no instrument in its section, its sentence or the "
                     f"notebook it names (say 'the formula gives', 'computed', or measure it): {bad}")


def test_the_rule_catches_a_formula_called_measured(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["## The bubble\n\nThe bubble, measured: 47%."]},
                    {"cell_type": "code", "source": ["bubble = pm.pipeline_parallel(shape, 8, 8).extra['bubble']"]},
                    {"cell_type": "markdown", "source": ["## Memory, measured\n\nIt is not measured here."]},
                    {"cell_type": "code", "source": ["r = shardlab.memory_report(model, opt)"]}]}
    path = tmp_path / "99_synthetic.ipynb"
    path.write_text(json.dumps(nb))
    assert unbacked(path) == ["The bubble, measured: 47%."]
