"""Where the course lives. The repository URL is configured here and nowhere else.

The Colab set-up block at the top of every notebook and the "Open in Colab" badges are
generated from these values by ``tools/sync_notebooks.py``; a test checks that every
notebook carries the generated text, so changing the URL means: edit it here, run
``python tools/sync_notebooks.py``, commit.
"""

REPOSITORY_URL = "https://github.com/transformer-course/transformers-from-scratch"
# The git revision that the badges open and that Colab installs tutorial_lib from.
REVISION = "main"


def install_spec(url: str = REPOSITORY_URL, revision: str = REVISION) -> str:
    """The pip requirement that installs tutorial_lib from the repository at ``revision``."""
    return f"tutorial_lib @ git+{url}@{revision}"


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


def colab_setup_block() -> str:
    """The lines that start the first code cell of every notebook.

    On Colab they install tutorial_lib (and its dependencies) from the repository at the
    same revision as the notebook; anywhere else the ``if`` is false and nothing happens.
    """
    return (
        "# Colab set-up: installs tutorial_lib on Colab, does nothing elsewhere.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        "    import subprocess\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\",\n"
        f"                    \"{install_spec()}\"], check=True)\n"
    )
