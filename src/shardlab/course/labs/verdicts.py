"""Many ranks' outcomes of one task -> one line for the learner: the verdict.

Each rank judges the task on its own and returns an outcome (plain data: status, message, and
the mistake's id when a check recognised one). The verdict puts the cause first (an exception,
an endless loop, a deadlock, a hint), drops the echoes (ranks released because a peer failed),
and says one thing per mistake: ranks that made the same mistake share one line, whatever
numbers their messages hold.
"""

from __future__ import annotations

import dataclasses

NOT_IMPLEMENTED = "not implemented"
#: Outcomes after which the process group cannot be trusted (a rank left it, or it timed out).
BROKEN = ("error", "timed out", "peer")
_SYMBOL = {"pass": "✓", NOT_IMPLEMENTED: "○"}

DEADLOCK = ("timed out after {limit:.0f} s: did every rank call the same collectives in the "
            "same order? (a rank that skips or adds one leaves the others waiting)")


@dataclasses.dataclass
class Result:
    """The verdict on one task: ``status`` is pass, fail, not implemented, error or timed out."""

    task: str
    status: str
    message: str
    stronger: str | None = None
    mistake: str | None = None   # the recognised mistake's id (None: no check named it)
    world_size: int | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        return f"{_SYMBOL.get(self.status, '✗')} {self.task}: {self.message}"


def verdict(task_id: str, outcomes: list, limit: float, world_size: int | None = None) -> Result:
    """One line from every rank's outcome (None: that rank never answered)."""
    deadlock = DEADLOCK.format(limit=limit)
    outcomes = [o if o is not None else {"status": "timed out", "message": deadlock} for o in outcomes]
    done = lambda status, text, first=None: Result(  # noqa: E731
        task_id, status, text, (first or {}).get("stronger"), (first or {}).get("mistake"), world_size)
    if outcomes and all(o["status"] == "pass" for o in outcomes):
        return done("pass", outcomes[0]["message"])
    waited = [r for r, o in enumerate(outcomes) if o["message"] == deadlock]
    looped = [r for r, o in enumerate(outcomes) if o["status"] == "timed out" and r not in waited]
    if not any(o["status"] == "error" for o in outcomes) and not looped and waited:
        # ranks left waiting: that is what happened, whatever the ranks that went on concluded
        others = [r for r in range(len(outcomes)) if r not in waited]
        if others:  # name the ranks that went on: they skipped (or added) a collective
            deadlock += (f" Rank{'s' if len(waited) > 1 else ''} {_list(waited)} waited in a "
                         f"collective that rank{'s' if len(others) > 1 else ''} {_list(others)} "
                         "never joined.")
        return done("timed out", deadlock)
    for status in ("error", "fail", "timed out", NOT_IMPLEMENTED, "peer"):
        ranks = [r for r, o in enumerate(outcomes) if o["status"] == status]
        if ranks:
            break
    if status == "peer":
        return done("timed out", deadlock)
    groups: dict[str, list[int]] = {}  # one group per mistake, whatever each rank's numbers
    for r in ranks:
        groups.setdefault(outcomes[r].get("mistake") or outcomes[r]["message"], []).append(r)
    first = outcomes[ranks[0]]
    everyone = len(ranks) == len(outcomes) or status in ("timed out", NOT_IMPLEMENTED)
    if len(groups) == 1 and everyone:
        text = first["message"]
    else:  # the lowest rank's problem in full; the others counted (one line, not a wall)
        (_, lowest), *rest = groups.items()
        text = f"rank{'s' if len(lowest) > 1 else ''} {_list(lowest)}: {first['message']}"
        if rest:
            others = sorted(r for _, rs in rest for r in rs)
            text += f" (rank{'s' if len(others) > 1 else ''} {_list(others)}: another problem)"
    return done("fail" if status == "error" else status, text, first)


def _list(ranks) -> str:
    return ", ".join(map(str, ranks))


def crashed(task_id: str, exc: Exception, limit: float, world_size: int | None = None) -> Result:
    """The verdict when a rank's process died (gloo aborts it on some mismatched collectives)."""
    texts = list(getattr(exc, "failures", {}).values())
    if all("no answer within" in t for t in texts):
        return Result(task_id, "timed out", DEADLOCK.format(limit=limit), world_size=world_size)
    texts.sort(key=lambda t: "process died" not in t)  # the rank that died first: the cause
    last = next((t.strip().splitlines()[-1] for t in texts if "no answer" not in t), str(exc))
    why = ": gloo aborts a rank when ranks call different collectives; did every rank call the " \
          "same collectives in the same order?" if "exit code -6" in last else ""
    return Result(task_id, "fail", f"your ranks crashed ({last}){why}", world_size=world_size)
