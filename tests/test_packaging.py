"""The project's metadata agrees with itself: one list of dependencies, two files."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from support import slowdown

ROOT = Path(__file__).resolve().parents[1]


def requires(_package: str = "shardlab") -> list[str]:
    """pyproject.toml's requirements, every extra included: read from the file, not from the
    installed metadata, which lags behind until the next ``pip install -e .``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_packages_as_pyproject():
    wanted = {_name(r) for r in requires("shardlab")}  # pyproject's lists, as installed
    conda, pip, section = set(), set(), None
    for line in (ROOT / "environment.yml").read_text().splitlines():
        text = line.split("#")[0].rstrip()
        if text.endswith(":") and not text.startswith(" "):
            section = text[:-1]  # top-level key: name, channels, dependencies
        elif section == "dependencies" and text.startswith("  - ") and text != "  - pip:":
            conda.add(text[4:].strip())
        elif section == "dependencies" and text.startswith("      - "):
            pip.add(text[8:].strip())
    named = {_name(r) for r in conda | pip if not r.startswith("-")} - {"python", "pip"}
    assert named == wanted, f"only in environment.yml: {named - wanted}; only in pyproject: {wanted - named}"
    assert "-e ." in pip, "environment.yml must install the package itself (pip: -e .)"


def test_torch_floor_is_2_9():
    """fully_shard on gloo sums instead of averaging gradients before 2.9 (reference facts)."""
    assert "torch>=2.9" in requires("shardlab")


def test_ruff_is_clean():
    """The course prints this code: it stays lint-clean (configuration in pyproject.toml)."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    done = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True, timeout=slowdown(120))
    assert done.returncode == 0, done.stdout + done.stderr
