"""`make site` renders every committed notebook to HTML with an index in curriculum order."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import build_site  # noqa: E402


def test_site_has_every_notebook_in_curriculum_order(tmp_path):
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    written = build_site.build(tmp_path, notebooks)
    index = (tmp_path / "index.html").read_text()
    links = re.findall(r'href="([^"]+\.html)"', index)
    assert links == [f"{p.stem}.html" for p in notebooks]
    for page in written[1:]:
        text = page.read_text()
        assert "<img" in text or "image/png" in text, f"{page.name} shows no figure"
    first = (tmp_path / f"{notebooks[0].stem}.html").read_text()
    assert "Learning objectives" in first
