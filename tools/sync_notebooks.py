"""Write the generated parts of every notebook from tutorial_lib/project.py:
the "Open in Colab" badge under the title and the Colab set-up block that starts the first
code cell.

    python tools/sync_notebooks.py                      # rewrite every notebook in place
    python tools/sync_notebooks.py notebooks/05_x.ipynb  # only the ones named
    python tools/sync_notebooks.py --check              # exit 1 if any notebook is out of date

The repository URL is configured in tutorial_lib/project.py alone; these are copies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tutorial_lib.project import colab_badge, colab_setup_block  # noqa: E402

MARK = "# Colab set-up:"


def synced_source(source: str) -> str:
    """The first code cell's source with its Colab block replaced by the generated one."""
    block = colab_setup_block()
    if source.startswith(MARK):
        # the old block runs up to its closing `check=True)` line
        end = source.index("check=True)\n") + len("check=True)\n")
        source = source[end:]
    return block + source.lstrip("\n") if source.strip() else block


def synced_title(source: str, notebook: str) -> str:
    """The first markdown cell with the badge line (re)written just under the title."""
    lines = [line for line in source.split("\n") if not line.startswith("[![Open in Colab]")]
    return "\n".join(lines[:1] + [colab_badge(notebook)] + lines[1:])


def first_code_cell(nb):
    return next(cell for cell in nb.cells if cell.cell_type == "code")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for path in args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        cell, title = first_code_cell(nb), nb.cells[0]
        new, new_title = synced_source(cell.source), synced_title(title.source, path.name)
        if (new, new_title) != (cell.source, title.source):
            stale.append(path.name)
            if not args.check:
                cell.source, title.source = new, new_title
                nbformat.write(nb, path)
    if stale:
        print(("out of date: " if args.check else "updated: ") + ", ".join(stale))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
