"""What ``.ci/run`` tests: the newest releases the ranges admit, and the lowest ones for the integrations.

The lowest pins (``.ci/lowest.txt``) must be the lower bounds of pyproject.toml's ranges, and
the test files CI runs at them (``.ci/lowest-tests.txt``) every test file that imports
transformers, accelerate or megatron, besides ``tests/test_readme.py`` (it runs
docs/integrations.md's Hugging Face and Megatron blocks). The README states the tested range
that :data:`cpkv.integrations.hf_v4_forms.TESTED_TRANSFORMERS` names in its errors.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTED = ("transformers", "accelerate", "megatron-core")
IMPORTS = re.compile(r"(?:^|\s)(?:from|import)\s+(?:transformers|megatron|accelerate)\b"
                     r"|importorskip\(\s*\"(?:transformers|megatron|accelerate)", re.M)


def _lines(name: str) -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / name).read_text().splitlines() if line.strip() and not line.startswith("#")]


def _lower_bounds() -> dict[str, str]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    bounds = {}
    for requirement in extra:
        match = re.fullmatch(r"([\w-]+)>=([\d.]+),<[\d.]+", requirement)
        if match and match.group(1) in ADAPTED:
            bounds[match.group(1)] = match.group(2)
    return bounds


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_lowest_pins_are_the_lower_bounds_of_the_ranges() -> None:
    pins = dict(line.split("==") for line in _lines("lowest.txt"))
    bounds = _lower_bounds()
    assert sorted(bounds) == sorted(ADAPTED) == sorted(pins), (bounds, pins)
    assert all(_release(pins[name]) == _release(bound) for name, bound in bounds.items()), (pins, bounds)


def test_every_test_of_the_adapted_libraries_runs_at_the_lowest_pins() -> None:
    listed = _lines("lowest-tests.txt")
    assert all((ROOT / path).is_file() for path in listed), [p for p in listed if not (ROOT / p).is_file()]
    importing = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py") if IMPORTS.search(path.read_text())}
    assert importing and importing | {"tests/test_readme.py"} == set(listed), (importing ^ set(listed))


def test_the_ci_script_upgrades_eagerly_and_runs_the_lowest_pins() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert "--upgrade --upgrade-strategy eager -e '.[test]'" in script
    assert "-c .ci/lowest.txt" in script and ".ci/lowest-tests.txt" in script


def test_the_readme_states_the_tested_range() -> None:
    from cpkv.integrations.hf_v4_forms import TESTED_TRANSFORMERS

    low, high = TESTED_TRANSFORMERS
    assert _release(low) == _release(_lower_bounds()["transformers"])
    readme = (ROOT / "README.md").read_text()
    assert f"transformers {low} through {high}" in readme, "the README's 'Tested releases' paragraph"
