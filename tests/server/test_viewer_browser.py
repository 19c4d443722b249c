"""The viewer in a real headless browser (Playwright driving Debian's chromium, or the browser
``playwright install chromium`` fetched), against live servers.

A tiny CoLaR behind an API key: the page asks for the key, lists the model with its
controls, streams a prompt and shows one column per latent step (logit-lens tokens as text
with probabilities), the stop marker where the phase ended, and the answer; side by side, the
same prompt with thinking off; Run is disabled until the models are listed, a key refused at
Run says so as at Connect, an out-of-range value is named in the pane, and a stream cut
short (no finish_reason, or a connection reset) shows no summary.

One server with tiny Huginn, Ouro, PCCoT and COCONUT models (``views_server``): the
recurrent heat map has one cell per generated token (also when a stop token or EOS ends the
request), each with its depth, and for Ouro the token's exit distribution (one bar per loop
step, the values the API returned); the looped-block grid has one row per pass and each
cell the position's logit-lens token in that pass; the feedback view has one column per
latent step with its top 5 tokens; controls the cards list beyond the numbers (Huginn's
exit_semantics, COCONUT's upstream_stop_rules) are selects, and Connect keeps the model and
its control values."""

import json
import os
import shutil

import httpx
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
    assert page.inner_text("#status") == "API key needed (401)"
    assert page.locator("#model option").count() == 0
    # no model yet: Run is disabled, and the hint says why
    assert page.is_disabled("#run") and page.is_visible("#run_hint")
    page.fill("#key", "not-the-key")
    page.click("#connect")
    page.wait_for_function("document.getElementById('status').textContent.includes('rejected')")
    assert page.inner_text("#status").startswith("API key rejected (401)")
    assert page.locator("#model option").count() == 0


def test_a_key_refused_at_run_time_says_so_as_at_connect(page, colar_key_server):
    _connect(page, colar_key_server)
    assert page.is_enabled("#run") and page.is_hidden("#run_hint")
    page.fill("#prompt", COLAR_STOPS)
    if page.is_checked("#compare"):
        page.uncheck("#compare")
    page.fill("#key", "not-the-key")
    page.click("#run")
    page.wait_for_selector(".run .error")
    assert page.inner_text(".run .error") == "API key rejected (401): check the key"


def test_an_out_of_range_value_is_named_in_the_pane(page, colar_key_server):
    """The form is checked before a run: a value outside its min/max is reported in the pane
    (a headless browser draws no validation bubble), naming the field; nothing is sent."""
    _connect(page, colar_key_server)
    page.fill("#prompt", COLAR_STOPS)
    sent = []

    def record(request):
        if "/v1/" in request.url:
            sent.append(request.url)

    page.on("request", record)
    try:
        for field, value in (("#max_tokens", "0"), ("#c_compression_factor", "9")):
            page.fill(field, value)
            page.click("#run")
            page.wait_for_selector(".run .error")
            want = page.eval_on_selector(field, "e => e.validationMessage")
            assert want  # the browser's own reason, e.g. "Value must be ... 1."
            name = field.removeprefix("#").removeprefix("c_")
            assert page.inner_text(".run .error") == f"{name}: {want}"
            page.fill(field, "2")
    finally:
        page.remove_listener("request", record)
    assert sent == [] and page.is_enabled("#run")


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
    marker = first.locator(".stop-marker")
    assert marker.inner_text().startswith(f"stop at step {COLAR_STOP_STEPS}")
    assert "### sampled" in marker.inner_text()
    assert "fired" in cols.nth(COLAR_STOP_STEPS - 1).get_attribute("class")
    # Step k shows p(###) read from its own output: the next entry's stop_prob, and on the
    # step that fired the stop the final stats' end_stop_prob, as the marker does.
    latent = httpx.post(f"{colar_key_server.base_url}/v1/completions", timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": colar_key_server.model_dir, "prompt": COLAR_STOPS,
                              "max_tokens": 3, "temperature": 0, "compression_factor": 2,
                              "return_latent_trace": True}).json()["choices"][0]["latent"]
    fired = latent["stats"]["end_stop_prob"]
    want = [e["stop_prob"] for e in latent["trace"][1:]] + [fired]
    shown = [float(cols.nth(k).locator(".stoptext").inner_text().removeprefix("p(###) "))
             for k in range(COLAR_STOP_STEPS)]
    assert shown == pytest.approx(want, rel=0.05, abs=5e-4)
    assert float(marker.inner_text().split("(p ")[1].rstrip(")")) == pytest.approx(
        fired, rel=0.05, abs=5e-4)
    answer = first.locator(".answer").inner_text().strip()
    assert len(answer.split()) == 3  # three word tokens of the tiny vocabulary
    assert f"{COLAR_STOP_STEPS} latent steps" in first.locator("table.summary").inner_text()
    off = page.locator(".run").nth(1)
    assert off.locator("h2").inner_text().endswith("(thinking off)")
    assert off.locator(".stop-marker").inner_text().startswith("thinking off")
    # thinking off: CoLaR reasons in text before "###"; this tiny one writes no mark
    assert _summary(off)["thinking"] == "none (thinking off, no ### or Answer: mark in the output)"


def test_thinking_counts_text_tokens_before_the_mark_only(page, colar_key_server):
    """The summary's thinking value (viewer.js ``thinkingSummary``): a head model with
    thinking off counts its text tokens before ``###`` / ``Answer:``; a plain model's output
    without either mark is not counted as thinking."""
    _connect(page, colar_key_server)
    head, plain = {"kind": "head", "family": "colar"}, None
    off = {"steps": 0, "stats": {"thinking": False}}
    on = {"steps": 4, "stats": {"thinking": True}}
    cases = [(head, off, ["I", " add", " 2", " ###", " 5"], "3 thinking tokens (thinking off, "
              "text before ### / Answer:)"),
             (head, on, ["Answer:", " 5"], "4 latent steps"),
             (plain, None, [" 5", " apples", ".", "\n", "Sure", "!"],
              "none (no ### or Answer: mark in the output)"),
             (plain, None, ["2", "+", "3", " Answer:", " 5"], "3 thinking tokens (text before "
              "### / Answer:)")]
    for lat, latent, tokens, want in cases:
        got = page.evaluate("([l, s, t]) => thinkingSummary(l, s, t)", [lat, latent, tokens])
        assert got == want


def test_stop_aborts_and_a_cut_stream_shows_no_summary(page, colar_key_server):
    """Stop aborts the request in flight; a stream that ends without a finish_reason (the
    server stopped) is said to be cut short, with no summary as if it had finished."""
    _connect(page, colar_key_server)
    page.fill("#prompt", COLAR_STOPS)
    if page.is_checked("#compare"):
        page.uncheck("#compare")
    page.route("**/v1/chat/completions", lambda route: None)  # never answered
    try:
        page.click("#run")
        page.wait_for_selector("#stop:not([hidden])")
        page.click("#stop")
        page.wait_for_selector(".run .error")
        assert page.inner_text(".run .error") == "stopped (Stop pressed)"
        assert page.locator("#stop").is_hidden() and page.is_enabled("#run")
    finally:
        page.unroute("**/v1/chat/completions")
    tick = {"choices": [{"index": 0, "delta": {"content": " w5"}, "finish_reason": None}]}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=f"data: {json.dumps(tick)}\n\n"))
    try:
        page.click("#run")
        page.wait_for_selector(".run .error")
        assert page.inner_text(".run .error").startswith(
            "the stream ended before the request finished")
        assert page.locator(".run table.summary tr").count() == 0
    finally:
        page.unroute("**/v1/chat/completions")
    # The connection breaks mid-stream (a reset: the read fails after the first event).
    page.evaluate("""tick => {
        window.fetch = async () => new Response(new ReadableStream({
            start(c) { c.enqueue(new TextEncoder().encode(`data: ${tick}\n\n`)); },
            pull(c) { c.error(new TypeError("network error")); },
        }), { status: 200, headers: { "Content-Type": "text/event-stream" } });
    }""", json.dumps(tick))
    page.click("#run")
    page.wait_for_selector(".run .error")
    assert page.inner_text(".run .error") == (
        "the stream ended before the request finished (the server stopped or the connection "
        "broke): network error")
    assert page.inner_text(".run .answer") == " w5"
    assert page.locator(".run table.summary tr").count() == 0


# --- the other views: one server, four tiny latent models ------------------------------------

WORDS = "w5 w17 w29 w41"  # the recurrent models' word tokenizer
PCCOT_BLOCK, PCCOT_BUDGET = 3, 2
COCONUT_BUDGET = 3


@pytest.fixture(scope="module")
def views_server(tmp_path_factory, smollm2_dir):
    """Tiny Huginn, Ouro, PCCoT (GPT-2, block 3) and COCONUT (Llama) in one server; its
    ``dirs`` attribute maps ``huginn`` / ``ouro`` / ``pccot`` / ``coconut`` to the served
    name."""
    pytest.importorskip("peft")
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server
    from tests.support.loop_models import save_loop_tiny

    root = tmp_path_factory.mktemp("viewer-views")
    dirs = {"huginn": write_huginn(root / "huginn"), "ouro": write_ouro(root / "ouro"),
            "pccot": save_loop_tiny(root / "pccot", "pccot-gpt2", block_size=PCCOT_BLOCK,
                                    iterations=PCCOT_BUDGET),
            "coconut": save_latent_tiny(root / "coconut", "coconut-llama", max_budget=8)}
    srv = start_server([EngineConfig(model=str(d), max_num_seqs=4, kv_slots=2048)
                        for d in dirs.values()], timeout=600)
    srv.dirs = {k: str(d) for k, d in dirs.items()}
    yield srv
    srv.stop()


def _submit(page, srv, which: str, prompt: str, max_tokens: int, controls=None,
            extra_body=None):
    """Open the page, run ``prompt`` on model ``which`` (completion route) and wait for the
    summary. ``extra_body``: fields the page has no control for, merged into its request
    body by a wrapped ``fetch``; the body sent is ``window.sentBody``."""
    page.goto(f"{srv.base_url}/viewer/")
    name = srv.dirs[which]
    page.wait_for_selector(f'#model option[value="{name}"]', state="attached")
    page.select_option("#model", name)
    page.evaluate("""extra => {
        const real = window.fetch.bind(window);
        window.fetch = (url, opts) => {
            if (opts && opts.body) {
                window.sentBody = {...JSON.parse(opts.body), ...(extra || {})};
                opts = {...opts, body: JSON.stringify(window.sentBody)};
            }
            return real(url, opts);
        };
    }""", extra_body)
    page.select_option("#route", "completion")
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", str(max_tokens))
    for key, value in (controls or {}).items():
        if page.eval_on_selector(f"#c_{key}", "e => e.tagName") == "SELECT":
            page.select_option(f"#c_{key}", str(value))
        else:
            page.fill(f"#c_{key}", str(value))
    if page.is_checked("#compare"):
        page.uncheck("#compare")
    page.click("#run")
    page.wait_for_selector(".run table.summary tr, .run .error", timeout=120_000)
    assert page.locator(".run .error").count() == 0, page.inner_text(".run .error")
    return page.locator(".run").nth(0)


def _api(srv, which: str, prompt: str, max_tokens: int, **body) -> dict:
    """The same request through the API (not streamed): the choice."""
    r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120, json={
        "model": srv.dirs[which], "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "logprobs": 0, "return_latent_trace": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _summary(run) -> dict:
    rows = run.locator("table.summary tr")
    return {rows.nth(i).locator("td").nth(0).inner_text():
            rows.nth(i).locator("td").nth(1).inner_text() for i in range(rows.count())}


def test_huginn_heat_map_has_one_cell_per_token_with_its_depth(page, views_server):
    run = _submit(page, views_server, "huginn", WORDS, 5,
                  {"latent_budget": 3, "exit_semantics": "engine"})
    assert page.evaluate("sentBody.exit_semantics") == "engine"
    assert page.locator("#c_exit_semantics option").all_inner_texts() == [
        "default", "engine", "upstream"]
    cells = run.locator(".heat .cell")
    assert cells.count() == 5
    assert _summary(run)["tokens"] == "5 generated"
    assert [cells.nth(i).get_attribute("data-depth") for i in range(5)] == ["3"] * 5
    assert run.locator(".heat .exitbars").count() == 0  # Huginn has no exit distribution
    assert run.locator(".align-warn").count() == 0
    want = _api(views_server, "huginn", WORDS, 5, latent_budget=3)["logprobs"]["tokens"]
    assert _cell_texts(cells) == want
    # Recurrent depth has no thinking-off mode: only the other models to compare with, and
    # with no other model no side-by-side at all.
    assert page.locator('#compare_with option[value=""]').count() == 0
    assert page.locator("#compare_row").is_visible()
    page.evaluate("""name => { for (const id of Object.keys(models)) if (id !== name)
        delete models[id]; showControls(); }""", views_server.dirs["huginn"])
    assert page.locator("#compare_row").is_hidden() and not page.is_checked("#compare")
    assert page.evaluate("visible(' a\\n')") == "\u2423a\u21b5"


def _cell_texts(cells) -> list[str]:
    """Each heat-map cell's token text (``data-token``), checked against what the cell shows
    (its first text node, whitespace made visible: no readout subscript)."""
    raw = cells.evaluate_all("cs => cs.map((c) => c.dataset.token)")
    shown = cells.evaluate_all("cs => cs.map((c) => c.firstChild.textContent)")
    assert shown == [t.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")
                     for t in raw]
    return raw


def test_ouro_heat_map_shows_each_tokens_exit_distribution(page, views_server):
    run = _submit(page, views_server, "ouro", WORDS, 4, {"latent_budget": 3})
    want = _api(views_server, "ouro", WORDS, 4, latent_budget=3)["latent"]["trace"]
    cells = run.locator(".heat .cell")
    assert cells.count() == len(want) == 4
    for i, e in enumerate(want):
        cell = cells.nth(i)
        assert cell.get_attribute("data-depth") == "3"
        bars = cell.locator(".exitbars i")
        assert bars.count() == len(e["exit_probs"]) == 3
        heights = [float(bars.nth(n).evaluate("b => b.style.height").rstrip("%"))
                   for n in range(3)]
        # CSS keeps 6 significant digits of each height
        assert heights == pytest.approx([max(1, p * 100) for p in e["exit_probs"]], rel=1e-5)
        assert cell.locator(".exitbars i.read").count() == 1
        assert bars.nth(e["readout_step"]).get_attribute("class") == "read"
        assert "exit probability per step: 1: " in cell.get_attribute("title")
        assert cell.locator("sub").inner_text() == f"@{e['readout_step'] + 1}"
        # every token at full depth: the darkest cell; its text and @n still read, and the
        # exit bars keep their own light ground
        assert _contrast(cell) >= 4.5 and _contrast(cell.locator("sub")) >= 4.5
        assert cell.locator(".exitbars").evaluate(
            "b => getComputedStyle(b).backgroundColor") == "rgb(255, 255, 255)"
    assert "exit probability of each step" in run.locator(".legend").inner_text()
    labels = run.locator(".hist div span").evaluate_all(
        "ss => Math.max(...ss.map((s) => s.getBoundingClientRect().bottom))")
    answer = run.locator("h3", has_text="Answer").bounding_box()
    assert labels <= answer["y"]  # the histogram's depth labels clear the Answer heading


def _contrast(loc) -> float:
    """WCAG contrast ratio of an element's text against its heat-map cell's background (an
    rgba over the white pane)."""
    return loc.evaluate("""e => {
        const rgb = (s) => s.match(/[0-9.]+/g).map(Number);
        const cell = e.closest(".cell");
        const [r, g, b, a = 1] = rgb(getComputedStyle(cell).backgroundColor);
        const bg = [r, g, b].map((v) => v * a + 255 * (1 - a));
        const lum = (c) => c.map((v) => v / 255).map((v) => v <= 0.03928 ? v / 12.92
            : ((v + 0.055) / 1.055) ** 2.4).reduce((s, v, i) => s + v * [0.2126, 0.7152,
            0.0722][i], 0);
        const [l1, l2] = [lum(rgb(getComputedStyle(e).color).slice(0, 3)), lum(bg)];
        return (Math.max(l1, l2) + 0.05) / (Math.min(l1, l2) + 0.05);
    }""")


@pytest.mark.parametrize("how", ["eos", "stop_token"])
def test_heat_map_cells_match_the_tokens_when_the_request_stops(page, views_server, how):
    """A stop token or EOS ends the request: its token is generated (the logprobs name it,
    the trace has its entry), so cells, tokens and trace entries stay one to one."""
    if how == "eos":  # only EOS (id 2) may be sampled: it is the first and last token
        extra, n = {"allowed_token_ids": [2]}, 1
    else:  # the second greedy token stops the request
        ids = _api(views_server, "ouro", WORDS, 4, return_tokens_as_token_ids=True)
        second = int(ids["logprobs"]["tokens"][1].removeprefix("token_id:"))
        extra, n = {"stop_token_ids": [second]}, 2
    choice = _api(views_server, "ouro", WORDS, 4, **extra)
    assert choice["finish_reason"] == "stop" and len(choice["latent"]["trace"]) == n
    run = _submit(page, views_server, "ouro", WORDS, 4, extra_body=extra)
    assert _summary(run)["finish"] == "stop"
    assert _summary(run)["tokens"] == f"{n} generated"
    cells = run.locator(".heat .cell")
    assert cells.count() == n
    assert _cell_texts(cells) == choice["logprobs"]["tokens"]
    assert run.locator(".align-warn").count() == 0


def test_pccot_grid_shows_each_passes_lens_tokens(page, views_server):
    run = _submit(page, views_server, "pccot", "Question: 2 + 3 =", 2,
                  {"latent_budget": PCCOT_BUDGET})
    passes = PCCOT_BUDGET + 1
    assert run.locator(".grid .lab").count() == passes
    cells = run.locator(".grid .cell.lens")
    assert cells.count() == passes * PCCOT_BLOCK
    trace = _api(views_server, "pccot", "Question: 2 + 3 =", 2,
                 latent_budget=PCCOT_BUDGET)["latent"]["trace"]
    for i, e in enumerate(trace):
        cell = cells.nth(i)
        assert (cell.get_attribute("data-pass"), cell.get_attribute("data-position")) == (
            str(e["pass"]), str(e["position"]))
        assert cell.locator("code").inner_text() == json.dumps(e["top_texts"][0],
                                                               ensure_ascii=False)
    marker = run.locator(".stop-marker").inner_text()
    assert marker == f"{passes * PCCOT_BLOCK} latent positions: {passes} passes over the block"


def test_pccot_budget_0_runs_pass_0_and_says_so(page, views_server):
    """latent_budget counts the passes after pass 0 (docs/models.md): at 0 the block still
    runs once over its latent-token placeholders (the engine's trace has that pass), and the
    view says so instead of "no thinking"; side by side names that option the same way."""
    run = _submit(page, views_server, "pccot", "Question: 2 + 3 =", 2, {"latent_budget": 0})
    latent = _api(views_server, "pccot", "Question: 2 + 3 =", 2, latent_budget=0)["latent"]
    assert latent["steps"] == PCCOT_BLOCK
    assert [(e["pass"], e["position"]) for e in latent["trace"]] == [
        (1, j + 1) for j in range(PCCOT_BLOCK)]
    assert run.locator(".grid .lab").count() == 1
    assert run.locator(".grid .cell.lens").count() == PCCOT_BLOCK
    marker = run.locator(".stop-marker").inner_text()
    assert marker == (f"{PCCOT_BLOCK} latent positions: 1 pass over the block (latent_budget 0: "
                      "pass 0 only, the latent-token placeholders with no feedback)")
    assert _summary(run)["thinking"] == marker
    assert page.inner_text('#compare_with option[value=""]') == "latent_budget 0: pass 0 only"


def test_coconut_view_has_a_column_per_latent_step(page, views_server):
    run = _submit(page, views_server, "coconut", "Question: 2 + 3 =", 2,
                  {"latent_budget": COCONUT_BUDGET, "upstream_stop_rules": "true"})
    assert page.evaluate("sentBody.upstream_stop_rules") is True
    cols = run.locator(".step-col")
    assert cols.count() == COCONUT_BUDGET
    assert all(cols.nth(i).locator(".tok").count() == 5 for i in range(COCONUT_BUDGET))
    assert run.locator(".stop-marker").inner_text().startswith(
        f"ended after {COCONUT_BUDGET} steps")
    assert f"{COCONUT_BUDGET} latent steps" in _summary(run)["thinking"]


def test_models_card_lists_only_the_controls_each_model_takes(views_server):
    """``/v1/models``: Huginn's card lists its exit fields, all of which it takes; Ouro's only
    the criterion and threshold (it exits by its gate and refuses the others)."""
    cards = {c["id"]: c["latent"] for c in httpx.get(
        f"{views_server.base_url}/v1/models", timeout=30).json()["data"]}
    huginn, ouro = (cards[views_server.dirs[k]] for k in ("huginn", "ouro"))
    assert huginn["controls"] == ["latent_budget", "exit_criterion", "exit_threshold",
                                  "exit_min_steps", "exit_check_every", "exit_semantics"]
    assert ouro["controls"] == ["latent_budget", "exit_criterion", "exit_threshold"]
    _api(views_server, "huginn", WORDS, 2, exit_criterion="kl", exit_threshold=0.1,
         exit_min_steps=1, exit_check_every=2, exit_semantics="engine")
    _api(views_server, "ouro", WORDS, 2, exit_criterion="threshold", exit_threshold=0.5)
    for field, value in (("exit_min_steps", 1), ("exit_check_every", 2),
                         ("exit_semantics", "upstream")):
        r = httpx.post(f"{views_server.base_url}/v1/completions", timeout=60, json={
            "model": views_server.dirs["ouro"], "prompt": WORDS, "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_connect_keeps_the_model_and_its_control_values(page, views_server):
    page.goto(f"{views_server.base_url}/viewer/")
    name = views_server.dirs["ouro"]
    page.wait_for_selector(f'#model option[value="{name}"]', state="attached")
    page.select_option("#model", name)
    page.fill("#c_latent_budget", "2")
    page.select_option("#c_exit_criterion", "weighted")
    other = page.eval_on_selector("#compare_with", "s => s.options[s.options.length - 1].value")
    page.select_option("#compare_with", other)
    page.evaluate("document.getElementById('status').textContent = ''")
    page.click("#connect")
    page.wait_for_function("document.getElementById('status').textContent === '4 models'")
    assert page.input_value("#model") == name
    assert page.input_value("#c_latent_budget") == "2"
    assert page.input_value("#c_exit_criterion") == "weighted"
    assert page.input_value("#compare_with") == other
