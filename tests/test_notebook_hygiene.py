"""What a learner opening a committed notebook must not trip over."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MACHINE_PATHS = re.compile(r"(/root/|/home/\w+/|/Users/\w+/|/tmp/|/work/|site-packages|[A-Z]:\\\\Users)")


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found"


def load(path):
    return json.loads(path.read_text(encoding="utf-8"))


def output_text(output) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    data = output.get("data", {})
    return "".join(data.get("text/plain", "")) + "".join(data.get("text/html", ""))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_small_and_opens_with_title_and_objectives(path):
    assert path.stat().st_size < 1024 * 1024, f"{path.name} is {path.stat().st_size} bytes"
    cells = load(path)["cells"]
    first = "".join(cells[0]["source"])
    assert cells[0]["cell_type"] == "markdown" and first.lstrip().startswith("# "), "first cell: a title"
    assert re.search(r"learning objectives", first, re.I), "first cell: learning objectives"
    assert re.search(r"prerequisites", first, re.I), "first cell: prerequisites"
    assert re.search(r"\bCPU\b", first), "first cell: time on a laptop CPU"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_was_executed_cleanly_top_to_bottom(path):
    code = [c for c in load(path)["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"execution counts {counts}: run it top to bottom"
    for i, cell in enumerate(code, start=1):
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", f"code cell {i} holds an error"
            text = output_text(output)
            assert not MACHINE_PATHS.search(text), f"code cell {i} shows a machine-specific path"
            if output.get("name") == "stderr":
                assert "Warning" not in text and "Traceback" not in text, (
                    f"code cell {i} shows a warning on stderr: {text[:200]}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_checks_its_deterministic_outputs(path):
    code = ["".join(c["source"]) for c in load(path)["cells"] if c["cell_type"] == "code"]
    assert any("# NBVAL_CHECK_OUTPUT" in src for src in code), "no cell carries # NBVAL_CHECK_OUTPUT"
    assert any(re.search(r"^\s*assert ", src, re.M) for src in code), "no assert in the notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_headings_are_not_commented_out(path):
    for i, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for line in "".join(cell["source"]).splitlines():
            assert not re.match(r"^# #", line), (
                f"markdown cell {i} has a heading written as {line[:40]!r}: in the text form markdown "
                "cells are raw markdown (write '## Title', not '# ## Title')")
