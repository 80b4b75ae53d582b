"""Record the notebooks' and labs' nbval times in workshop/timings.json, which AGENDA.md is checked against.

    SHARDLAB_NB_TIMES=/tmp/times.json python -m pytest --nbval-lax notebooks labs
    python workshop/record_timings.py /tmp/times.json          # merges into workshop/timings.json

The root conftest.py writes ``/tmp/times.json`` (each notebook's cells' setup + call +
teardown seconds). This script keeps, per notebook, the seconds of the last passing run with
when, where and how it was measured; failed runs are refused. ``tests/test_agenda.py`` checks
that every slot of AGENDA.md is at least its notebook's recorded time.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMINGS = HERE / "timings.json"


def merge(times_files: list[str], out: Path = TIMINGS) -> dict:
    data = json.loads(out.read_text()) if out.exists() else {"unit": "seconds under pytest --nbval-lax", "runs": {}}
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for name in times_files:
        run = json.loads(Path(name).read_text())
        for path, t in run["notebooks"].items():
            if t["failed"]:
                raise SystemExit(f"error: {path} failed in {name}; record only passing runs")
            data["runs"][path] = {
                "seconds": t["seconds"], "cells": t["cells"], "date": when,
                "machine": f"{platform.machine()}, {run['cpu_count']} CPU core(s), {platform.system()}",
                "ci": run["ci"], "load_average_when_recorded": None if load is None else round(load, 1),
                "command": f"SHARDLAB_NB_TIMES={Path(name).name} pytest --nbval-lax {path}",
            }
    data["runs"] = dict(sorted(data["runs"].items()))
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for path, row in merge(sys.argv[1:])["runs"].items():
        print(f"{path:45} {row['seconds']:7.1f} s  ({row['date']})")
