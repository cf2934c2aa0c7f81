"""The module map: the table in tutorial_lib's docstring names every module of the package, and
nothing else, with one line each; the README's section "The package" shows the same table."""

import pkgutil
import re
from pathlib import Path

import tutorial_lib

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| *(?P<group>[^|`]*?) *\| *`(?P<module>[^`]+)` *\| *(?P<holds>[^|]*?) *\|$")


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def mapped_modules() -> list[tuple[str, str]]:
    """(module as written, what it holds) for every row of the docstring's table."""
    rows = [ROW.match(line) for line in table_lines(tutorial_lib.__doc__)[2:]]  # past the header and its rule
    assert all(rows), "every row of the map is | group | `module` | what it holds |"
    return [(row["module"], row["holds"]) for row in rows]


def test_every_module_of_the_package_is_in_the_map_and_every_module_named_there_exists():
    package = {info.name + ("/" if info.ispkg else ".py")
               for info in pkgutil.iter_modules(tutorial_lib.__path__)}
    names = [name for name, _ in mapped_modules()]
    assert len(names) == len(set(names)), f"a module is listed twice: {sorted(n for n in names if names.count(n) > 1)}"
    missing, unknown = sorted(package - set(names)), sorted(set(names) - package)
    assert not missing, f"modules of tutorial_lib not in the map of tutorial_lib/__init__.py: {missing}"
    assert not unknown, f"the map names modules that do not exist (or a package as a .py, or back): {unknown}"


def test_every_module_has_one_line_and_the_first_row_of_the_table_names_a_group():
    lines = table_lines(tutorial_lib.__doc__)[2:]
    assert ROW.match(lines[0])["group"], "the first row must name its group"
    for name, holds in mapped_modules():
        assert len(holds.split()) >= 3, f"{name}: say what it holds"


def test_the_readme_shows_the_same_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "\n## The package\n" in readme, "the README has a section 'The package'"
    section = readme.split("\n## The package\n", 1)[1].split("\n## ", 1)[0]
    assert table_lines(section) == table_lines(tutorial_lib.__doc__), (
        "the README's table differs from the one in tutorial_lib/__init__.py")
