"""docs/operations.md's table of options is generated from the schema (tierfs/config.py):
a new option, a changed default or range without the doc regenerated fails here."""

from __future__ import annotations

from pathlib import Path

from tierfs.config import OPTIONS, options_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
START = "<!-- generated from the schema in tierfs/config.py"
END = "<!-- end of the generated table -->"


def test_the_operations_table_is_the_schema():
    text = DOC.read_text()
    assert START in text and END in text
    block = text.split(START, 1)[1].split(END, 1)[0]
    table = block[block.index("| key |"):]
    assert table == options_table(), (
        "docs/operations.md is out of date: replace its table with the output of "
        "`python -m tierfs.config --doc-table`")


def test_every_option_has_a_row_with_its_range_and_meaning():
    rows = {line.split("|")[1].strip(" `"): line for line in options_table().splitlines()[2:]}
    for name in OPTIONS:
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert len(cells) == 5 and cells[4], name  # key, TOML value, allowed, default, meaning
