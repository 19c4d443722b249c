"""The viewer in a real headless browser (Playwright driving Debian's chromium, or the browser
``playwright install chromium`` fetched), against a live server with a tiny CoLaR behind an
API key: the page asks for the key, lists the model with its controls, streams a prompt
and shows one column per latent step (logit-lens tokens as text with probabilities), the
stop marker where the phase ended, and the answer; side by side, the same prompt with
thinking off."""

import os
import shutil

import pytest
from server_testlib import API_KEY, COLAR_STOP_STEPS, COLAR_STOPS

BROWSERS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def _browser_path() -> str | None:
    """Debian's chromium (or another system Chrome), else None: Playwright's own download,
    when one was installed, is found by Playwright itself."""
    given = os.environ.get("LATENTSERVE_CHROMIUM")
    if given:
        return given
    return next((p for p in BROWSERS if shutil.which(p)), None)


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (the test extra)")
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=_browser_path(),
                                        args=["--no-sandbox"])
        except Exception as exc:  # noqa: BLE001 - no browser on this machine
            pytest.skip(f"no chromium to drive: install Debian's chromium (apt-get install "
                        f"chromium) or run `playwright install chromium` ({exc})")
        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        yield pg
        browser.close()


def _connect(page, srv):
    page.goto(f"{srv.base_url}/viewer/")
    page.fill("#key", API_KEY)
    page.click("#connect")
    page.wait_for_selector(f'#model option[value="{srv.model_dir}"]', state="attached")


def test_without_the_key_the_page_says_so(page, colar_key_server):
    page.goto(f"{colar_key_server.base_url}/viewer/")
    page.evaluate("sessionStorage.clear()")
    page.reload()
    page.wait_for_function("document.getElementById('status').textContent.includes('401')")
    assert page.locator("#model option").count() == 0


def test_model_shows_only_its_controls(page, colar_key_server):
    _connect(page, colar_key_server)
    assert page.inner_text("#family") == "colar (head)"
    assert page.locator("#c_compression_factor").get_attribute("max") == "5"
    assert page.locator("#c_stop_threshold").count() == 0  # CoLaR's stop is ### sampled
    assert page.locator("#c_latent_budget").count() == 0


def test_streams_step_columns_the_stop_marker_and_the_answer(page, colar_key_server):
    _connect(page, colar_key_server)
    page.select_option("#route", "completion")
    page.fill("#prompt", COLAR_STOPS)
    page.fill("#max_tokens", "3")
    page.fill("#c_compression_factor", "2")
    page.check("#compare")
    page.click("#run")
    page.wait_for_selector(".run:nth-child(2) table.summary tr", timeout=120_000)
    first = page.locator(".run").nth(0)
    cols = first.locator(".step-col")
    assert cols.count() == COLAR_STOP_STEPS
    assert cols.nth(0).locator(".tok").count() == 5
    assert cols.nth(0).locator(".tok code").first.inner_text().startswith('"')
    assert cols.nth(0).locator(".tok .p").first.inner_text().endswith("%")
    assert "p(###)" in cols.nth(0).inner_text()
    marker = first.locator(".stop-marker")
    assert marker.inner_text().startswith(f"stop at step {COLAR_STOP_STEPS}")
    assert "### sampled" in marker.inner_text()
    assert "fired" in cols.nth(COLAR_STOP_STEPS - 1).get_attribute("class")
    answer = first.locator(".answer").inner_text().strip()
    assert len(answer.split()) == 3  # three word tokens of the tiny vocabulary
    assert f"{COLAR_STOP_STEPS} latent steps" in first.locator("table.summary").inner_text()
    off = page.locator(".run").nth(1)
    assert off.locator("h2").inner_text().endswith("(thinking off)")
    assert off.locator(".stop-marker").inner_text().startswith("thinking off")
    assert "0 latent steps" in off.locator("table.summary").inner_text()
