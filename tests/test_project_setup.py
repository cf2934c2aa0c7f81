"""The set-up promises: one dependency list, a CI script that runs the README's test command,
and a Colab block generated from the one configured repository URL."""

import re
import sys
import types
from pathlib import Path
from unittest import mock

import nbformat
import pytest
import tomllib
import yaml

from tutorial_lib import project

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dependencies_are_ranges_never_exact_pins():
    meta = pyproject()["project"]
    everything = meta["dependencies"] + [d for deps in meta["optional-dependencies"].values() for d in deps]
    for requirement in everything:
        assert "==" not in requirement, f"{requirement!r} is an exact pin; use a range"
    names = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in meta["dependencies"]}
    for needed in ("torch", "numpy", "matplotlib", "ipywidgets", "jupyterlab", "tqdm"):
        assert needed in names, f"{needed} missing from the package's dependencies"
    dev = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in meta["optional-dependencies"]["dev"]}
    for needed in ("pytest", "nbval", "hypothesis", "transformers", "ruff"):
        assert needed in dev, f"{needed} missing from the dev extra"


def test_environment_yml_installs_pyproject_and_nothing_else():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert pip_sections == [["-e .[dev]"]], (
        "environment.yml must install the checkout through pip (-e .[dev]) so that pyproject.toml "
        f"stays the one package list; found {pip_sections}")
    conda_pkgs = [d for d in deps if isinstance(d, str)]
    assert sorted(re.split(r"[<>=]", d)[0] for d in conda_pkgs) == ["pip", "python"], (
        f"conda should bring only python and pip, found {conda_pkgs}")
    python = next(d for d in conda_pkgs if d.startswith("python"))
    requires = pyproject()["project"]["requires-python"]
    assert python.removeprefix("python") == requires, (
        f"environment.yml asks for {python}, pyproject requires-python is {requires}")


def readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^(make \w+)", quick, flags=re.M)


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert commands == ["make lab", "make test"], f"Quick start commands: {commands}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M), ".ci/run must call the README's `make test`"
    assert "pip install --quiet torch==2.13.0" in ci
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "pytest" in test_recipe and "install" in test_recipe.splitlines()[0]


def test_pytest_runs_tests_and_notebooks_under_nbval_lax():
    ini = pyproject()["tool"]["pytest"]["ini_options"]
    assert ini["testpaths"] == ["tests", "notebooks"]
    assert "--nbval-lax" in ini["addopts"]


def test_repository_url_is_configured_in_exactly_one_place():
    url = project.REPOSITORY_URL
    holders = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
               if p.is_file() and p.suffix in {".py", ".toml", ".yml", ".cfg", ".md", ".txt"}
               and ".venv" not in p.parts and "build" not in p.parts and url in p.read_text(errors="ignore")]
    # README badges are generated too, and checked against project.colab_badge elsewhere
    assert [h for h in holders if h != "README.md"] == ["tutorial_lib/project.py"], holders


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_starts_with_the_generated_colab_block(path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source.startswith(project.colab_setup_block()), (
        f"{path.name}: the first code cell must start with the generated Colab block; "
        "run `python tools/sync_notebooks.py`")


def run_colab_block(simulate_colab: bool) -> list:
    calls = []
    fake_modules = {"google": types.ModuleType("google"), "google.colab": types.ModuleType("google.colab")}
    with mock.patch.dict(sys.modules, fake_modules if simulate_colab else {}), \
            mock.patch("subprocess.run", side_effect=lambda *a, **k: calls.append((a, k))):
        if not simulate_colab:
            sys.modules.pop("google.colab", None)
        exec(compile(project.colab_setup_block(), "<first cell>", "exec"), {})
    return calls


def test_colab_block_installs_tutorial_lib_from_the_configured_revision_on_colab():
    calls = run_colab_block(simulate_colab=True)
    assert len(calls) == 1
    (argv,), kwargs = calls[0]
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    assert argv[-1] == f"tutorial_lib @ git+{project.REPOSITORY_URL}@{project.REVISION}"
    assert kwargs == {"check": True}


def test_colab_block_does_nothing_elsewhere():
    assert run_colab_block(simulate_colab=False) == []


def test_colab_urls_are_built_from_the_configured_repository():
    url = project.colab_url("01_attention.ipynb")
    assert url.startswith("https://colab.research.google.com/github/")
    assert url.endswith(f"/blob/{project.REVISION}/notebooks/01_attention.ipynb")
    assert project.REPOSITORY_URL.removeprefix("https://github.com/") in url
    with pytest.raises(ValueError, match="github.com"):
        project.colab_url("x.ipynb", url="https://example.org/repo")


def test_readme_curriculum_lists_every_notebook_with_its_colab_link():
    text = (ROOT / "README.md").read_text()
    table = text.split("## Curriculum", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"^\| \d\d \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == [p.name[:2] for p in NOTEBOOKS]
    for row, path in zip(rows, NOTEBOOKS):
        assert f"(notebooks/{path.name})" in row, f"the README row {path.name[:2]} does not link {path.name}"
        assert f"({project.colab_url(path.name)})" in row, f"the README row {path.name[:2]} has no Colab link"
