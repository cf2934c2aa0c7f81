"""Convert between a notebook and an editable text source, for authors.

    python tools/nbsource.py to-text notebooks/01_attention.ipynb build/nbsrc/01_attention.txt
    python tools/nbsource.py to-notebook build/nbsrc/01_attention.txt notebooks/01_attention.ipynb

The text form: a line ``# %% [markdown]`` starts a markdown cell, a line ``# %%`` a code cell;
cell text follows as it is. Outputs are dropped: execute the notebook afterwards
(``make notebooks``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

CODE, MARKDOWN = "# %%", "# %% [markdown]"


def to_text(nb_path: Path, text_path: Path) -> None:
    nb = nbformat.read(nb_path, as_version=4)
    parts = []
    for cell in nb.cells:
        parts.append(MARKDOWN if cell.cell_type == "markdown" else CODE)
        parts.append(cell.source.rstrip("\n"))
        parts.append("")
    text_path.parent.mkdir(parents=True, exist_ok=True)
    text_path.write_text("\n".join(parts), encoding="utf-8")


def to_notebook(text_path: Path, nb_path: Path) -> None:
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            source = "\n".join(lines).strip("\n")
            make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
            cells.append(make(source))

    for line in text_path.read_text(encoding="utf-8").splitlines():
        if line.rstrip() in (CODE, MARKDOWN):
            flush()
            kind, lines = ("markdown" if line.rstrip() == MARKDOWN else "code"), []
        else:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, nb_path)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("to-text", "to-notebook"):
        sys.exit(__doc__)
    (to_text if sys.argv[1] == "to-text" else to_notebook)(Path(sys.argv[2]), Path(sys.argv[3]))
