"""Write the generated parts of every notebook from tutorial_lib/project.py:
the "Open in Colab" badge under the title and the Colab set-up block that starts the first
code cell, which installs tutorial_lib at a pinned commit and prints the device (on a GPU: its
name and the precision training will use).

    python tools/sync_notebooks.py                      # rewrite every notebook in place
    python tools/sync_notebooks.py notebooks/05_x.ipynb  # only the ones named
    python tools/sync_notebooks.py --check              # exit 1 if any notebook is out of date
    python tools/sync_notebooks.py --revision v1.0      # pin a tag instead (for a release)

The pinned commit is the last one that changed the package (tutorial_lib/ or pyproject.toml),
so it must be committed first: commit the package, run this, commit the notebooks.
The repository URL is configured in tutorial_lib/project.py alone; these are copies.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tutorial_lib.project import DEVICE_LINES, PACKAGE_PATHS, colab_badge, colab_setup_block  # noqa: E402

MARK = "# Colab set-up:"


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def package_revision(root: Path = ROOT) -> str:
    """The last commit that changed the package; SystemExit with the reason if there is none
    or if the package has changes that are not committed (they would not be installed)."""
    try:
        log = git(root, "log", "-1", "--format=%H", "--", *PACKAGE_PATHS)
    except FileNotFoundError:
        raise SystemExit("git is not installed: pass the revision to pin with --revision") from None
    if log.returncode != 0 or not log.stdout.strip():
        raise SystemExit(f"no git history of {', '.join(PACKAGE_PATHS)} here ({log.stderr.strip() or 'no commit'}); "
                         "pass the revision to pin with --revision")
    dirty = git(root, "status", "--porcelain", "--", *PACKAGE_PATHS).stdout.strip()
    if dirty:
        raise SystemExit("the package has changes that are not committed, so no commit holds it yet; commit "
                         f"them first, then run this again:\n{dirty}")
    return log.stdout.strip()


# What notebooks printed by hand before the generated block did: dropped, or it would print twice.
HAND_WRITTEN_DEVICE_LINE = 'print("running on", describe(device))'


def synced_source(source: str, revision: str) -> str:
    """The first code cell's source with its Colab block replaced by the generated one, and the
    hand-written line that printed the device (now the block's job) removed."""
    block, ends_line = colab_setup_block(revision), source.endswith("\n")
    if source.startswith(MARK):
        # the current block runs up to DEVICE_LINES; an older one up to its closing `check=True)` line
        if DEVICE_LINES in source:
            source = source[source.index(DEVICE_LINES) + len(DEVICE_LINES):]
        else:
            source = source[source.index("check=True)\n") + len("check=True)\n"):]
    source = "".join(line for line in source.splitlines(keepends=True)
                     if line.strip() != HAND_WRITTEN_DEVICE_LINE)
    if not source.strip():
        return block
    return block + (source if ends_line else source.rstrip("\n")).lstrip("\n")


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
    parser.add_argument("--revision", help="pin this commit or tag (default: the last commit that changed the package)")
    args = parser.parse_args()
    revision = args.revision or package_revision()
    stale = []
    for path in args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        cell, title = first_code_cell(nb), nb.cells[0]
        new, new_title = synced_source(cell.source, revision), synced_title(title.source, path.name)
        if (new, new_title) != (cell.source, title.source):
            stale.append(path.name)
            if not args.check:
                cell.source, title.source = new, new_title
                nbformat.write(nb, path)
    if stale:
        print(("out of date: " if args.check else f"updated (tutorial_lib pinned at {revision}): ") + ", ".join(stale))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
