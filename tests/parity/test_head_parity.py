"""Compression heads with a learned stop (latent/head.py): on a tiny Llama with a random
bundle inside its directory, batched engine output (answer tokens, finish reason, latent
steps, stop step, max stop probability, end reason) equals the eager single-request
reference over HF transformers (``latentserve.bench.baseline.head_reference``) in both injection
modes, for mixed caps, thresholds, min_latent and use_stop in one batch, cold and warm
prefix cache, chunked prefill with preemptions. The slot invariant holds after each run and
the prefix cache never holds a latent position."""

import pytest

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.head_models import save_head_model
from tests.support.head_reference import head_reference_generate
from tests.support.parity import shared_prefix_prompts

MAX_TOKENS = 24
MODES = ("closed_loop", "prompt")


def _cases():
    """11 (prompt, controls): every prompt with rotating controls, plus one prompt three
    more times with other caps / stop settings."""
    prompts = shared_prefix_prompts()
    caps, mins, thrs = (0, 3, 8, 12, 5), (0, 2, 4), (0.5, 0.62, 0.66, 0.7)
    out = [(p, {"max_latent": caps[i % 5], "min_latent": mins[i % 3],
                "use_stop": i % 2 == 0, "stop_threshold": thrs[i % 4]})
           for i, p in enumerate(prompts)]
    return out + [(prompts[0], {"max_latent": c, "min_latent": 1, "use_stop": u,
                                "stop_threshold": t})
                  for c, u, t in ((10, True, 0.64), (2, False, 0.5), (6, True, 0.99))]


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("head-parity")
    return {"closed_loop": save_head_model(root / "cl", injection="closed_loop",
                                           source_layer=1, stop_bias=0.3),
            "prompt": save_head_model(root / "pr", injection="prompt", source_layer=0,
                                      seed=3)}


def _reference(d, engine, prompt, c, mode, max_tokens=MAX_TOKENS):
    spec = engine.latent_spec
    return head_reference_generate(d, d / "latent_reasoning_head.safetensors", prompt,
                                   spec.start_ids, spec.end_ids, mode=mode,
                                   max_tokens=max_tokens, eos_ids=engine.eos_ids, **c)


@pytest.fixture(scope="module")
def references(head_dirs):
    out = {}
    for mode in MODES:
        engine = LLMEngine(EngineConfig(model=str(head_dirs[mode])))
        out[mode] = [_reference(head_dirs[mode], engine, p, c, mode) for p, c in _cases()]
    return out


def _run(engine, cases, max_tokens=MAX_TOKENS, **extra):
    """Run ``cases`` as one batch; per request ``(tokens, finish_reason, latent_stats,
    num_cached_tokens)``."""
    base = engine._arrivals
    rids = [f"h{base + i}" for i in range(len(cases))]
    for rid, (prompt, c) in zip(rids, cases):
        floor = {"min_output_tokens": 0} if engine.latent_spec else {}  # a head's control
        engine.add_request(rid, prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, **floor, **c, **extra))
    toks, final = {r: [] for r in rids}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.rid] += o.new_token_ids
            if o.finished:
                final[o.rid] = (o.finish_reason, o.latent_stats, o.num_cached_tokens)
    return [(toks[r], *final[r]) for r in rids]


def _assert_matches(mode, results, refs, cases):
    for i, ((toks, reason, stats, _), ref, (_, c)) in enumerate(zip(results, refs, cases)):
        what = f"{mode} request {i} {c}"
        assert toks == ref["tokens"], f"{what}: engine {toks} != ref {ref['tokens']}"
        assert reason == ref["finish_reason"], what
        for k in ("steps", "stop_step", "end"):
            assert stats[k] == ref[k], f"{what}: {k} engine {stats[k]} != ref {ref[k]}"
        if ref["max_stop_prob"] is not None and mode == "closed_loop":
            assert abs(stats["max_stop_prob"] - ref["max_stop_prob"]) < 1e-5, what
        assert stats["thinking"] is True and stats["mode"] == mode


def _radix_tokens(engine) -> int:
    return int(engine.cache.radix.total_size())


@pytest.mark.parametrize("mode", MODES)
def test_mixed_controls_batch_matches_reference_cold_then_warm(mode, head_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(head_dirs[mode])))
    spec = engine.latent_spec
    assert spec.kind == "head" and engine.runner.model.latent_head_mode == mode
    cases = _cases()
    _assert_matches(mode, _run(engine, cases), references[mode], cases)
    engine.cache.check_idle()
    if mode == "closed_loop":  # the batch exercises both ends and several stop steps
        ends = {r["end"] for r in references[mode]}
        assert ends == {"stop", "cap"}, ends
        assert len({r["stop_step"] for r in references[mode] if r["end"] == "stop"}) >= 2
    results = _run(engine, cases)  # warm
    _assert_matches(mode, results, references[mode], cases)
    engine.cache.check_idle()
    # Only prompt + opening ids are shareable; in prompt mode not even the last of them.
    shareable = {tuple(p) + tuple(spec.start_ids) for p, _ in cases}
    if mode == "prompt":
        shareable = {s[:-1] for s in shareable}
    for (_, _, _, cached), (p, _) in zip(results, cases):
        assert 0 < cached <= len(p) + len(spec.start_ids) - (mode == "prompt")
    bound = sum(len(s) for s in shareable)  # upper bound on what the radix tree may hold
    assert _radix_tokens(engine) <= bound


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption_match_reference(mode, head_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(head_dirs[mode]), max_num_batched_tokens=7,
                                    kv_slots=140, max_num_seqs=6))
    cases = _cases()
    _assert_matches(mode, _run(engine, cases), references[mode], cases)
    engine.cache.check_idle()
    assert engine.scheduler.num_preemptions > 0


def test_closing_ids_one_per_step_match_reference(head_dirs, references):
    """With CUDA graphs the engine computes a multi-token closing text one id per step
    (``Scheduler.forced_one_by_one``), so latent batches stay decode-shaped: same answers,
    stats and slots as the reference, and after the first prefill no step has a row of more
    than one token (every request was admitted in the first step)."""
    engine = LLMEngine(EngineConfig(model=str(head_dirs["closed_loop"])))
    assert len(engine.latent_spec.end_ids) > 1  # " Answer:" is two SmolLM2 tokens
    engine.scheduler.forced_one_by_one = True
    widths, schedule = [], engine.scheduler.schedule

    def spy():
        batch = schedule()
        if batch is not None:
            widths.append(max(batch.q_lens))
        return batch

    engine.scheduler.schedule = spy
    cases = _cases()
    _assert_matches("closed_loop", _run(engine, cases), references["closed_loop"], cases)
    engine.cache.check_idle()
    assert widths[0] > 1 and widths[1:] and max(widths[1:]) == 1


def test_budget_spent_inside_latent_phase_matches_reference(head_dirs):
    d = head_dirs["closed_loop"]
    engine = LLMEngine(EngineConfig(model=str(d)))
    prompts = shared_prefix_prompts()
    cases = [(prompts[i], {"max_latent": 8, "min_latent": 0, "use_stop": False}) for i in (1, 4)]
    cases += [(prompts[5], {"max_latent": 3, "use_stop": False})]
    results = _run(engine, cases, max_tokens=4)
    refs = [_reference(d, engine, p, c, "closed_loop", max_tokens=4) for p, c in cases]
    _assert_matches("closed_loop", results, refs, cases)
    assert [r[2]["end"] for r in results] == ["length", "length", "cap"]
    engine.cache.check_idle()


def test_floor_raises_max_tokens_and_latent_steps_count(head_dirs):
    engine = LLMEngine(EngineConfig(model=str(head_dirs["closed_loop"])))
    prompt = shared_prefix_prompts()[2]
    engine.add_request("f", prompt, SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, max_latent=3, use_stop=False,
        min_output_tokens=5))
    toks, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.new_token_ids
            final = o if o.finished else final
    n_close = len(engine.latent_spec.end_ids)
    # max_tokens 2 -> floor 5 + cap 3 = 8 outputs: 3 latent + closing ids + the answer.
    assert final.finish_reason == "length" and len(toks) == 8 - 3 - n_close
    assert final.latent_stats["steps"] == 3 and final.latent_stats["end"] == "cap"
    engine.cache.check_idle()


def test_latent_phase_leaves_room_for_an_answer_token_near_the_context_end(head_dirs):
    """A cap past the context is held to the steps that leave room for the closing ids and
    one answer token (it used to end in the latent phase with no answer); a floor that does
    not fit is a ValueError naming min_latent."""
    engine = LLMEngine(EngineConfig(model=str(head_dirs["closed_loop"]), max_model_len=48))
    prompt = shared_prefix_prompts()[2]
    room = 48 - len(prompt) - len(engine.latent_spec.start_ids) - \
        len(engine.latent_spec.end_ids) - 1
    assert room > 0
    engine.add_request("r", prompt, SamplingParams(
        temperature=0.0, ignore_eos=True, max_latent=2**64, use_stop=False))
    toks, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.new_token_ids
            final = o if o.finished else final
    stats = final.latent_stats
    assert stats["steps"] == stats["max_latent"] == room and stats["end"] == "cap"
    assert final.finish_reason == "length" and len(toks) == 1  # the one answer token
    with pytest.raises(ValueError, match=f"min_latent must be at most {room} for this prompt"):
        engine.add_request("m", prompt, SamplingParams(max_latent=2**64, min_latent=2**62))
    assert not engine.has_unfinished_requests()
    engine.cache.check_idle()


def test_the_server_default_floor_yields_to_the_context(head_dirs, monkeypatch):
    """A floor the request did not send (``LATENTSERVE_MIN_LATENT``) is held to the room
    the context leaves, not refused."""
    monkeypatch.setenv("LATENTSERVE_MIN_LATENT", "1000")
    engine = LLMEngine(EngineConfig(model=str(head_dirs["closed_loop"]), max_model_len=48))
    prompt = shared_prefix_prompts()[2]
    room = 48 - len(prompt) - len(engine.latent_spec.start_ids) - \
        len(engine.latent_spec.end_ids) - 1
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    stats = final.latent_stats
    assert stats["steps"] == stats["min_latent"] == stats["max_latent"] == room
    engine.cache.check_idle()


def test_thinking_off_is_the_bare_backbone_and_says_so(head_dirs):
    d = head_dirs["closed_loop"]
    engine = LLMEngine(EngineConfig(model=str(d)))
    bare = LLMEngine(EngineConfig(model=str(d), no_latent_head=True))
    assert bare.latent_spec is None and not hasattr(bare.runner.model, "latent_head")
    cases = [(p, {}) for p in shared_prefix_prompts()[:4]]
    off = _run(engine, cases, thinking=False)
    plain = _run(bare, cases)
    assert [r[0] for r in off] == [r[0] for r in plain]
    assert all(r[2]["thinking"] is False and r[2]["steps"] == 0 for r in off)
    assert all(r[2] is None for r in plain)
    (_, _, stats, _), = _run(bare, [([1, 2], {"thinking": True})])  # ignored: no head
    assert stats is None
    engine.cache.check_idle()
    bare.cache.check_idle()


def test_one_model_one_directory(tmp_path, head_dirs):
    # A bundle named by config.json (and a .pt one) loads with no flags.
    d = save_head_model(tmp_path / "named", bundle_name="my_head.safetensors",
                        bundle_format="pt", source_layer=1)
    assert (d / "my_head.pt").is_file() and not (d / "latent_reasoning_head.safetensors").exists()
    engine = LLMEngine(EngineConfig(model=str(d)))
    assert engine.latent_spec.kind == "head" and engine.runner.capture_layer == 2
    # An explicit bundle path overrides, and the injection mode can be overridden.
    plain = tmp_path / "plain"
    from latentserve.bench.baseline.tiny_models import save_tiny

    save_tiny(plain, "llama", num_hidden_layers=3)
    assert LLMEngine(EngineConfig(model=str(plain))).latent_spec is None
    other = LLMEngine(EngineConfig(model=str(plain), latent_injection="prompt",
                                   latent_head=str(d / "my_head.pt")))
    assert other.latent_spec.kind == "head" and other.runner.model.latent_head_mode == "prompt"
    (toks, _reason, stats, _), = _run(other, [([5, 6, 7], {})])
    assert stats["mode"] == "prompt" and stats["steps"] == 1 and toks
    other.cache.check_idle()


def test_bundle_that_does_not_fit_the_backbone_is_an_error(tmp_path):
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.latent.bundle import random_bundle, write_bundle

    d = save_tiny(tmp_path / "m", "llama", num_hidden_layers=2)
    write_bundle(random_bundle(32, 8, source_layer=0, think_open=" a", think_close=" b"),
                 tmp_path / "small.safetensors")
    with pytest.raises(ValueError, match="hidden_size 32"):
        LLMEngine(EngineConfig(model=str(d), latent_head=str(tmp_path / "small.safetensors")))
    write_bundle(random_bundle(64, 8, source_layer=5, think_open=" a", think_close=" b"),
                 tmp_path / "deep.safetensors")
    with pytest.raises(ValueError, match="source_layer 5"):
        LLMEngine(EngineConfig(model=str(d), latent_head=str(tmp_path / "deep.safetensors")))
    write_bundle(random_bundle(64, 8, source_layer=0), tmp_path / "nothink.safetensors")
    with pytest.raises(ValueError, match="think"):
        LLMEngine(EngineConfig(model=str(d), latent_head=str(tmp_path / "nothink.safetensors")))


def test_opening_not_appended_twice(head_dirs):
    """A prompt that already ends with the opening (a chat template that renders it) runs
    like one without it: the same tokens, reason and stats, ``max_stop_prob`` within 1e-5
    (fp32; the two batches may reduce in another order, as on a loaded machine)."""
    engine = LLMEngine(EngineConfig(model=str(head_dirs["closed_loop"])))
    p = shared_prefix_prompts()[4]
    c = {"max_latent": 4, "use_stop": False}
    (toks_a, reason_a, stats_a, _), = _run(engine, [(p, c)])
    (toks_b, reason_b, stats_b, _), = _run(engine, [(p + list(engine.latent_spec.start_ids), c)])
    assert (toks_a, reason_a) == (toks_b, reason_b)
    prob_a, prob_b = stats_a.pop("max_stop_prob"), stats_b.pop("max_stop_prob")
    assert stats_a == stats_b and abs(prob_a - prob_b) < 1e-5
    engine.cache.check_idle()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_smollm2_with_random_head_matches_reference(mode, smollm2_dir, tmp_path):
    """SmolLM2-135M (hidden 576, 30 layers) with a random bundle on layer 20, given by path
    (``latent_head``) with the injection mode overridden per server."""
    from latentserve.latent.bundle import random_bundle, write_bundle
    from tests.support.head_models import THINK_CLOSE, THINK_OPEN

    path = write_bundle(random_bundle(576, 32, source_layer=20, seed=11, stop_bias=0.2,
                                      think_open=THINK_OPEN, think_close=THINK_CLOSE),
                        tmp_path / "head.safetensors")
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), max_model_len=512,
                                    latent_head=str(path), latent_injection=mode))
    prompts = shared_prefix_prompts()
    cases = [(prompts[0], {"max_latent": 6, "min_latent": 0, "use_stop": True,
                           "stop_threshold": 0.5}),
             (prompts[4], {"max_latent": 3, "use_stop": False}),
             (prompts[5], {"max_latent": 5, "min_latent": 2, "use_stop": True,
                           "stop_threshold": 0.6})]
    results = _run(engine, cases, max_tokens=12)
    spec = engine.latent_spec
    refs = [head_reference_generate(smollm2_dir, path, p, spec.start_ids, spec.end_ids,
                                    mode=mode, max_tokens=12, eos_ids=engine.eos_ids, **c)
            for p, c in cases]
    _assert_matches(mode, results, refs, cases)
    engine.cache.check_idle()
