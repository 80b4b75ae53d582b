"""Numeric questions with a learner's own numbers, so that a room cannot share one answer sheet.

A numeric question may carry a ``vary`` block::

    "vary": {"inputs": {"billions": [7, 3, 13, 70], "gpus": [8, 4, 16, 64]},
             "question": "GB per GPU for {billions:g}B on {gpus} GPUs with ZeRO-3 ...?",
             "explanation": "16 × {billions:g}e9 / {gpus} bytes = {answer:.4g} GB ...",
             "feedback": {"low": "...", "high": "..."}, "rel_tolerance": 0.02}

and its ``source`` names inputs as ``"$billions*1e9"`` (an input, optionally times a number), in
``args``, ``kwargs``, ``shape`` or ``divide``. Each input's first value is the one the question
as written uses, so without a learner's name the question, its answer and the website are exactly
as written. With a name, each input is drawn from its list by a hash of (name, question id,
input): the same name always gets the same numbers, in every process, and never the written
combination. The answer is then recomputed from the source, the formula itself, never stored.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace


def _pick(learner: str, qid: str, name: str, n: int) -> int:
    return int(hashlib.sha256(f"{learner}|{qid}|{name}".encode()).hexdigest()[:16], 16) % n


def inputs(q, learner: str | None) -> dict:
    """The inputs ``learner`` gets for ``q`` (the written ones without a learner)."""
    given = q.vary["inputs"]
    written = {k: v[0] for k, v in given.items()}
    if not learner:
        return written
    drawn = {k: v[_pick(learner, q.id, k, len(v))] for k, v in given.items()}
    if drawn == written:  # a learner's numbers are never the written ones
        k = next(k for k, v in given.items() if len(v) > 1)
        drawn[k] = given[k][(given[k].index(written[k]) + 1 + _pick(learner, q.id, "again", len(given[k]) - 1)) % len(given[k])]
    return drawn


def fill(value, values: dict):
    """``value`` with every ``"$name"`` or ``"$name*factor"`` replaced by that input's number."""
    if isinstance(value, str) and value.startswith("$"):
        name, _, factor = value[1:].partition("*")
        if name not in values:
            raise ValueError(f"source names input ${name}, which the question's vary.inputs do not have")
        return values[name] * float(factor) if factor else values[name]
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    return value


def for_learner(q, learner: str | None, recompute):
    """``q`` as ``learner`` sees it: the question, answer, tolerance and texts for their inputs."""
    if q.kind != "numeric" or not q.vary or not learner:
        return q
    values = inputs(q, learner)
    source = fill(q.source, values)
    answer = recompute(source, q.unit)
    if "rel_tolerance" in q.vary:
        tolerance = abs(answer) * q.vary["rel_tolerance"]
    else:
        tolerance = q.tolerance
    words = {**values, "answer": answer}
    return replace(q, question=q.vary["question"].format(**words), answer=answer, source=source,
                   tolerance=tolerance, explanation=q.vary["explanation"].format(**words),
                   feedback={k: v.format(**words) for k, v in q.vary.get("feedback", q.feedback).items()})
