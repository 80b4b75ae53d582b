"""The order a learner sees a question's choices in: shuffled, the same for everyone, and balanced.

A bank is written with its choices in any order (the key is often first, where the author put it).
If the course showed them as written, "pick a" or "pick the first" would score well without any
understanding. So every question's choices are relabelled a, b, c, ... in a new order when the
bank is loaded, and that order is:

- **the same everywhere.** Nothing is random at run time: the order is a function of the bank's
  text alone (each question's id, its choice keys and which are right), so the website, nbval and
  every learner see one order, and ``quiz.answer("03.x", "c")`` means the same thing on each.
- **balanced, not merely shuffled.** A random shuffle of 5 three-choice questions puts the key on
  one letter 3 times out of 5 quite often. Instead the questions are taken in bank order, and each
  question's right choices go to the positions that have held the fewest keys so far in that bank
  (ties broken by a hash of the question id and the position). A bank of n questions with 3 choices
  each ends with every position holding n/3 keys, give or take one.
- **shuffled within that.** The wrong choices fill the remaining positions in an order set by a
  hash of the question id and each choice's text key, so the distractors do not keep their
  written order either.

The hash is SHA-256 (Python's ``hash`` of a string changes from one process to the next).
Adding or removing a question changes the positions of the questions after it in its bank, and
only those.
"""

from __future__ import annotations

import hashlib
from collections import Counter

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _rank(question_id: str, what) -> int:
    """A stable pseudo-random number for (question, thing): the same in every process."""
    return int(hashlib.sha256(f"{question_id}|{what}".encode()).hexdigest()[:16], 16)


def relabel(items: list[tuple[str, list[str], set[str]]]) -> list[dict[str, str]]:
    """For each question ``(id, choice keys as written, right keys)`` of one bank, in bank order,
    a map from each written key to the letter it is shown under (see the module docstring)."""
    held = Counter()  # position -> keys placed there so far in this bank
    out = []
    for qid, keys, right in items:
        positions = sorted(range(len(keys)), key=lambda p: (held[p], _rank(qid, p)))
        for_right = sorted(positions[:len(right)])
        for_wrong = sorted(positions[len(right):])
        rights = sorted((k for k in keys if k in right), key=lambda k: _rank(qid, k))
        wrongs = sorted((k for k in keys if k not in right), key=lambda k: _rank(qid, k))
        held.update(for_right)
        out.append({k: LETTERS[p] for k, p in zip(rights + wrongs, for_right + for_wrong)})
    return out


def position_counts(keys_shown: list[list[str]]) -> Counter:
    """How many keys each letter holds, over a bank's questions (each a list of right letters)."""
    return Counter(letter for keys in keys_shown for letter in keys)
