"""Render the executed notebooks to static HTML pages with an index in curriculum order, so the
course can be read without a kernel.

    python tools/build_site.py [--out site]

Each page is the committed notebook, outputs included (figures, and widgets as their saved
state); nothing is executed.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent


def title_and_summary(nb) -> tuple[str, str]:
    """The notebook's title (its first heading) and the first paragraph after it."""
    lines = nb.cells[0].source.splitlines()
    title = next((line.lstrip("# ").strip() for line in lines if line.startswith("# ")), "untitled")
    paragraphs = [p.strip() for p in "\n".join(lines[1:]).split("\n\n")]
    summary = next((p for p in paragraphs if p and not p.startswith(("[![", "#", "**"))), "")
    return title, re.sub(r"\s+", " ", summary)


def build(out: Path, notebooks: list[Path]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    entries, pages = [], []
    for path in sorted(notebooks):
        nb = nbformat.read(path, as_version=4)
        body, _ = exporter.from_notebook_node(nb)
        page = out / f"{path.stem}.html"
        page.write_text(body, encoding="utf-8")
        pages.append(page)
        title, summary = title_and_summary(nb)
        entries.append(f'<li><a href="{page.name}">{html.escape(title)}</a><p>{html.escape(summary)}</p></li>')
    index = out / "index.html"
    index.write_text(
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>Transformers from scratch</title>\n"
        "<style>body{font-family:sans-serif;max-width:52em;margin:2em auto;line-height:1.5}"
        "li{margin-bottom:1em}li p{margin:.2em 0;color:#444}</style></head>\n<body>\n"
        "<h1>Transformers from scratch, one notebook at a time</h1>\n"
        "<p>The executed notebooks of the course, in curriculum order. Run them yourself in "
        "JupyterLab (<code>make lab</code>) to change and explore.</p>\n<ol start='0'>\n"
        + "\n".join(entries) + "\n</ol>\n</body></html>\n", encoding="utf-8")
    return [index, *pages]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "site")
    args = parser.parse_args()
    written = build(args.out, list((ROOT / "notebooks").glob("*.ipynb")))
    print(f"wrote {len(written)} pages to {args.out}/ (open {args.out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
