"""A real browser: JupyterLab in headless Chromium runs notebook 01 and the attention explorer
responds to its head slider.

Needs Debian's Chromium (``apt-get install chromium``; any Chromium works if CHROMIUM points
to it) and the ``playwright`` package (never a downloaded browser). Skips, saying how to
install, where either is missing. The screenshot lands in build/screenshots/.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "01_attention.ipynb"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab serving a copy of the notebooks (so nothing in the checkout is modified)."""
    folder = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, folder / NOTEBOOK)
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(folder / ".jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(folder / ".jupyter-runtime"))
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
               "--LabApp.expose_app_in_browser=True"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI containers run as root
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail("JupyterLab exited while starting")
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not start within 60 s")
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def test_notebook_01_runs_in_jupyterlab_and_the_explorer_responds(jupyterlab):
    chromium = chromium_path()
    if chromium is None:
        pytest.skip("Chromium is not installed: `sudo apt-get install chromium` (Debian/Ubuntu), "
                    "or set CHROMIUM=/path/to/chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download needed)")
    url, token = jupyterlab
    shots = ROOT / "build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget "
                                   "&& window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel",
                                   timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            # every code cell gets an execution count; none is left running ([*])
            page.wait_for_function(
                """() => {
                    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
                    return prompts.length > 0 &&
                           prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
                }""", timeout=600_000, polling=1000)
            errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')
            assert errors.count() == 0, f"a cell shows an error: {errors.first.inner_text()[:500]}"

            explorer = page.locator(".jp-OutputArea-output .widget-vbox").last
            explorer.scroll_into_view_if_needed()
            image = explorer.locator("img").first
            image.wait_for(state="visible", timeout=60_000)
            before = image.screenshot()
            page.screenshot(path=str(shots / "01_attention_explorer_head0.png"))
            head_slider = explorer.locator(".widget-slider", has_text="head").locator(".noUi-handle").first
            head_slider.focus()
            page.keyboard.press("ArrowRight")  # head 0 -> head 1
            page.wait_for_function(
                """(el) => el.querySelector('.widget-slider .widget-readout') !== null""",
                arg=explorer.element_handle())
            readouts = explorer.locator(".widget-readout")
            deadline = time.time() + 60
            after = before
            while time.time() < deadline and after == before:
                time.sleep(0.5)
                after = image.screenshot()
            page.screenshot(path=str(shots / "01_attention_explorer_head1.png"))
            assert after != before, "moving the head slider did not change the heatmap"
            assert any(readouts.nth(i).inner_text().strip() == "1" for i in range(readouts.count())), \
                "the head slider's readout did not move to 1"
        finally:
            browser.close()
