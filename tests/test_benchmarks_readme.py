"""``benchmarks/README.md`` lists every benchmark with its last HEADLINE (issue #13): the list is checked against the
recorded results, so a re-run that is not copied into the README fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
README = BENCHMARKS / "README.md"


def recorded_headlines() -> dict[str, str]:
    """Each results file's HEADLINE, by its name (files without one, like the hostile suite's table, left out)."""
    found = {}
    for path in sorted((BENCHMARKS / "results").glob("*.json")):
        headline = json.loads(path.read_text()).get("headline")
        if isinstance(headline, str):
            found[path.stem] = headline
    return found


def listed_headlines() -> dict[str, str]:
    text = README.read_text()
    section = text.split("\n## Last headlines\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^- `([a-z_]+)`: `(HEADLINE: .*)`$", section, flags=re.M))


def test_the_readme_lists_every_recorded_headline_verbatim() -> None:
    assert listed_headlines() == recorded_headlines()


def test_every_benchmark_script_has_a_row_in_the_table() -> None:
    table = README.read_text().split("\n## ", 1)[0]
    scripts = [path.name for path in BENCHMARKS.glob("*.py")
               if "HEADLINE:" in path.read_text() and path.name != "common.py"]
    scripts.append("protocol/")
    assert scripts
    for name in scripts:
        assert f"| `{name}` |" in table, name
