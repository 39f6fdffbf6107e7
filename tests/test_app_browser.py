"""The page in a real headless Chromium (Debian's, driven by playwright): it loads, a comparison of two
configurations fills two outputs and the metrics table, and an over-long prompt shows an error.
The README's screenshot (``app/screenshot.png``) is the comparison's, taken here: it records the hash of the app's
sources it was taken from, and a run on other sources replaces it and fails until it is committed."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no {CHROMIUM} (CI installs Debian's chromium)")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from app import AppSettings, build_app

    demo = build_app(AppSettings(output_root=tmp_path_factory.mktemp("out")))
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, quiet=True)
    yield demo.local_url
    demo.close()


@pytest.fixture(scope="module")
def page(url, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        # a fresh --user-data-dir: playwright passes the profile itself with a persistent context
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                   viewport={"width": 1400, "height": 1000})
        pg = ctx.new_page()
        pg.goto(url, wait_until="domcontentloaded", timeout=60_000)
        yield pg
        ctx.close()


def test_compare_two_configurations_in_the_page(page, tmp_path):
    page.get_by_role("button", name="Compare").wait_for(timeout=60_000)
    # the app's readiness signal: every kernel compiled (or loaded from the cache); the bound is generous,
    # a cold cache on a loaded machine compiles for minutes, and the timed interactions below start after it
    page.locator("#kernel-status").get_by_text("Kernels ready").wait_for(timeout=900_000)
    page.locator("#prompt textarea").fill("It is a truth universally acknowledged")
    page.locator("#max-new input").fill("12")
    page.get_by_role("button", name="Compare").click()
    table = page.locator("#metrics-table")
    table.get_by_text("moqe:int4 / KV q8_0").first.wait_for(timeout=90_000)
    page.wait_for_function("""() => ['#out-1 textarea', '#out-2 textarea']
        .every(s => document.querySelector(s) && document.querySelector(s).value.length > 0)""", timeout=90_000)
    page.locator("#metrics-2").get_by_text("tok/s").wait_for(timeout=90_000)
    page.wait_for_timeout(1500)  # let the stream finish painting
    assert table.get_by_text("f32 (none) / KV f32").count() >= 1
    shot = page.screenshot(full_page=True)
    assert len(shot) > 10_000
    (tmp_path / "compare.png").write_bytes(shot)
    check_readme_screenshot(shot)


SCREENSHOT = Path(__file__).resolve().parents[1] / "app" / "screenshot.png"
SOURCES_KEY = b"moqe-app-sources"  # a PNG tEXt chunk: the hash of the app's sources the screenshot was taken from


def app_sources_hash() -> str:
    app = SCREENSHOT.parent
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(app.glob("*.py")))).hexdigest()[:16]


def png_text(png: bytes, key: bytes) -> str | None:
    """The value of the tEXt chunk ``key`` of a PNG, or None."""
    i = 8
    while i + 8 <= len(png):
        n, kind = struct.unpack(">I4s", png[i:i + 8])
        if kind == b"tEXt" and png[i + 8:i + 8 + n].startswith(key + b"\0"):
            return png[i + 8 + len(key) + 1:i + 8 + n].decode("latin-1")
        i += 12 + n
    return None


def with_png_text(png: bytes, key: bytes, value: str) -> bytes:
    """``png`` with a tEXt chunk ``key=value`` right after its header chunk (IHDR)."""
    data = key + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    end = 8 + 12 + struct.unpack(">I", png[8:12])[0]
    return png[:end] + chunk + png[end:]


def check_readme_screenshot(shot: bytes) -> None:
    """The README's screenshot is this test's, from the app's current sources: when the app's code changed since
    it was taken, it is replaced by this run's and the test fails so that the new one gets committed
    (``APP_UPDATE_SCREENSHOT=1`` replaces it in any case)."""
    current = app_sources_hash()
    old = png_text(SCREENSHOT.read_bytes(), SOURCES_KEY) if SCREENSHOT.exists() else None
    if old == current and not os.environ.get("APP_UPDATE_SCREENSHOT"):
        return
    SCREENSHOT.write_bytes(with_png_text(shot, SOURCES_KEY, current))
    assert png_text(SCREENSHOT.read_bytes(), SOURCES_KEY) == current
    if not os.environ.get("APP_UPDATE_SCREENSHOT"):
        pytest.fail(f"{SCREENSHOT} was taken from other app sources ({old}); it is now this run's (sources {current}): "
                    "commit it")


def test_over_long_prompt_shows_an_error(page, tmp_path):
    page.locator("#prompt textarea").fill("word " * 400)
    page.get_by_role("button", name="Compare").click()
    toast = page.locator('[data-testid="toast-text"].error').filter(has_text="exceeds the context").first
    toast.wait_for(timeout=60_000)  # Gradio's error toast, top right
    assert "Traceback" not in toast.inner_text()
    # the previous run's results are gone: no old text or metric line sits under the error
    page.wait_for_function("""() => document.querySelector('#out-1 textarea').value === ''
        && !document.querySelector('#metrics-1').innerText.includes('tok/s')""", timeout=10_000)
    page.wait_for_timeout(800)  # the toast fades in
    page.screenshot(path=str(tmp_path / "error.png"))
    if os.environ.get("APP_SCREENSHOT_DIR"):
        shutil.copyfile(tmp_path / "error.png", Path(os.environ["APP_SCREENSHOT_DIR"]) / "error.png")
    page.locator("#prompt textarea").fill("Hello")  # the app keeps serving
    page.get_by_role("button", name="Compare").click()
    page.wait_for_function("() => document.querySelector('#out-1 textarea').value.length > 0", timeout=60_000)
