"""Huginn's two adaptive-exit semantics (``exit_semantics``, ``latent/recurrent.py``) against
the eager reference (``HuginnReference.generate(..., semantics=...)``), on the tiny Huginn
checkpoint with a zero initial state (upstream's ``init_scale=0``):

* ``"engine"``: the prompt runs the full depth, an exited token's K/V fills the steps it
  skipped (``latest-m4``); ``"upstream"``: the prompt exits as one block, skipped steps are
  dropped from attention (``full`` lookup).
* Both, mixed in one batch, per request and as the server default, with the prefix cache
  cold and warm: greedy tokens equal, logits within 1e-5 (fp32), iterations per token equal.
* Refusals: a bad value, Ouro, a plain model, an attention backend that cannot mask keys, a
  prompt larger than the prefill budget (its exit block)."""

import pytest
import torch
from test_recurrent_parity import MAX_TOKENS, PROMPTS, hist, run, sp

from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
from latentserve.config import EngineConfig
from latentserve.latent.recurrent import cache_salt, resolve_exit_rule
from latentserve.sampling_params import SamplingParams
from tests.support.recurrent_reference import HuginnReference
from tests.support.recurrent_requests import HUGINN_EXITS


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return write_huginn(tmp_path_factory.mktemp("exit-semantics") / "huginn", init_scale=0)


@pytest.fixture(scope="module")
def ref(huginn_dir):
    return HuginnReference(huginn_dir)


def _engine(huginn_dir, **kw):
    from latentserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(huginn_dir), **{"kv_slots": 4096,
                                                            "max_model_len": 256, **kw}))


@pytest.fixture(scope="module")
def engine(huginn_dir):
    return _engine(huginn_dir)


def _expected(ref, semantics):
    return [ref.generate(p, MAX_TOKENS, d, c, t, m, e, semantics=s)
            for p, (d, c, t, m, e), s in zip(PROMPTS, HUGINN_EXITS, semantics)]


def _params(semantics, **kw):
    return [sp(latent_budget=d, exit_criterion=c, exit_threshold=t, exit_min_steps=m,
               exit_check_every=e, exit_semantics=s, **kw)
            for (d, c, t, m, e), s in zip(HUGINN_EXITS, semantics)]


def check(results, references):
    for i, ((toks, logits, iters, _), r) in enumerate(zip(results, references)):
        assert toks == r["tokens"], f"request {i}: engine {toks} != reference {r['tokens']}"
        for step, (a, b) in enumerate(zip(logits, r["logits"])):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"request {i} step {step}")
        assert iters == hist(r["iterations"]), f"request {i} iterations"


MIXED = ["engine", "upstream"] * 3


@pytest.mark.parametrize("semantics", [MIXED, MIXED[::-1]], ids=["eu", "ue"])
def test_mixed_semantics_batch_matches_reference_cold_and_warm(engine, ref, semantics):
    engine.cache.radix.reset()
    expected = _expected(ref, semantics)
    traces = []
    cold = run(engine, _params(semantics, return_latent_trace=True), traces)
    check(cold, expected)
    for trace, r in zip(traces, expected):  # steps per token, token by token
        assert [e["depth"] for e in trace] == r["iterations"]
    warm = run(engine, _params(semantics))
    check(warm, expected)
    for (*_, cached), p, s in zip(warm, PROMPTS, semantics):
        # engine: the prompt (full depth) comes from the cache; upstream: a prompt's K/V
        # depends on the whole prompt (its exit block), so it is never cached.
        assert cached == (len(p) - 1 if s == "engine" else 0)


def test_upstream_prompt_exits_early_and_differs_from_engine(ref):
    """The two semantics are different computations on this checkpoint: upstream's prompt
    exits early (engine's runs the full depth), and later tokens see other K/V."""
    eng, up = _expected(ref, ["engine"] * 6), _expected(ref, ["upstream"] * 6)
    for (d, *_), e, _u in zip(HUGINN_EXITS, eng, up):
        assert e["iterations"][0] == d
    assert any(u["iterations"][0] < d for (d, *_), u in zip(HUGINN_EXITS, up))
    assert any(e["tokens"] != u["tokens"] or e["iterations"] != u["iterations"]
               for e, u in zip(eng, up))
    # Without an exit rule the semantics coincide (nothing is skipped).
    a = ref.generate(PROMPTS[0], 4, 3, semantics="engine")
    b = ref.generate(PROMPTS[0], 4, 3, semantics="upstream")
    assert a["tokens"] == b["tokens"] and a["iterations"] == b["iterations"] == [3] * 4
    with pytest.raises(ValueError, match="semantics"):
        ref.generate(PROMPTS[0], 2, 3, semantics="bogus")


def test_server_default_applies_to_requests_that_do_not_say(huginn_dir, ref):
    eng = _engine(huginn_dir, exit_semantics="upstream")
    said = ["engine", None, None, "upstream", "engine", None]
    semantics = [s or "upstream" for s in said]
    check(run(eng, _params(said)), _expected(ref, semantics))


def test_upstream_prompt_block_under_a_small_prefill_budget_with_preemption(huginn_dir, ref):
    """Prompts of at most 16 tokens, a 16-token prefill budget and 40 slots: each upstream
    prompt runs whole in one forward; preempted requests recompute it and their tokens."""
    prompts = [p[:16] for p in PROMPTS]
    eng = _engine(huginn_dir, kv_slots=40, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    params = _params(["upstream"] * 6)
    rids = []
    for i, (p, s) in enumerate(zip(prompts, params)):
        eng.add_request(f"s{i}", p, s)
        rids.append(f"s{i}")
    toks = {r: [] for r in rids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.rid] += o.new_token_ids
    assert eng.scheduler.num_preemptions > 0
    for r, p, (d, c, t, m, e) in zip(rids, prompts, HUGINN_EXITS):
        assert toks[r] == ref.generate(p, MAX_TOKENS, d, c, t, m, e,
                                       semantics="upstream")["tokens"]
    assert eng.cache.num_free == eng.num_kv_slots


def test_semantics_keep_prefix_cache_entries_apart(engine):
    spec = engine.latent_spec
    rules = {s: resolve_exit_rule(spec, SamplingParams(exit_criterion="kl", exit_semantics=s))
             for s in ("engine", "upstream")}
    assert rules["upstream"].prompt_exits and not rules["engine"].prompt_exits
    assert cache_salt(8, rules["engine"]) != cache_salt(8, rules["upstream"])
    # The server default picks the semantics of a request that does not say.
    assert resolve_exit_rule(spec, SamplingParams(exit_criterion="kl"), "upstream") == \
        rules["upstream"]
    # No exit rule: nothing is skipped, both semantics are the same computation.
    assert resolve_exit_rule(spec, SamplingParams(exit_semantics="upstream")) is None


def test_refusals_name_the_field(huginn_dir, engine, tmp_path):
    from latentserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="^exit_semantics must be one of"):
        SamplingParams(exit_semantics="bogus")
    with pytest.raises(ValueError, match="^exit_semantics must be one of"):
        EngineConfig(exit_semantics="latest")
    up = SamplingParams(exit_criterion="kl", exit_semantics="upstream", max_tokens=2)
    # An attention backend that cannot mask keys per slot (Triton) refuses the combination.
    from latentserve.attention.triton_backend import TritonBackend

    assert not TritonBackend.supports_key_mask
    engine.key_mask_ok, engine.backend_name = False, "triton"
    try:
        with pytest.raises(ValueError, match="^exit_semantics 'upstream' needs the torch"):
            engine.add_request("t0", PROMPTS[0], up)
        engine.add_request("t1", PROMPTS[0], SamplingParams(exit_criterion="kl", max_tokens=2))
        engine.abort_request("t1")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.key_mask_ok, engine.backend_name = True, "torch"
    # The prompt is one exit block: it must fit one forward.
    small = _engine(huginn_dir, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="^exit_semantics 'upstream' runs the prompt as one"):
        small.add_request("t2", list(range(20, 37)), up)
    # Ouro's upstream never stops a token early (a server default "upstream" is refused at
    # start: test_server_default_upstream_refused_at_start_where_it_cannot_apply).
    ouro = LLMEngine(EngineConfig(model=str(write_ouro(tmp_path / "ouro")), kv_slots=512,
                                  max_model_len=128))
    with pytest.raises(ValueError, match="^exit_semantics 'upstream' is a Huginn option"):
        ouro.add_request("o0", [5, 6, 7], SamplingParams(exit_semantics="upstream"))
    ouro.add_request("o1", [5, 6, 7], SamplingParams(max_tokens=2))
    ouro.add_request("o2", [5, 6, 7], SamplingParams(max_tokens=2, exit_semantics="engine"))
    done = set()
    while ouro.has_unfinished_requests():
        done |= {o.rid for o in ouro.step() if o.finished}
    assert done == {"o1", "o2"}


def test_plain_model_refuses_exit_semantics(tmp_path):
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(save_tiny(tmp_path / "llama", "llama",
                                                     word_tokenizer=True)),
                                 kv_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match="^exit_semantics needs a recurrent-depth model"):
        eng.add_request("p0", [5, 6, 7], SamplingParams(exit_semantics="engine"))


def test_cli_flag_sets_the_server_default():
    from latentserve.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--exit-semantics", "upstream"])
    assert engine_config(args).exit_semantics == "upstream"
    assert engine_config(build_parser().parse_args(["serve"])).exit_semantics == "engine"


def test_server_default_upstream_refused_at_start_where_it_cannot_apply(tmp_path):
    """``--exit-semantics upstream`` on a plain model or Ouro refuses to start (as
    ``--upstream-stop-rules`` does where it cannot apply); with several models
    (``latent_cap_where_applicable``) it applies where it can and is dropped elsewhere."""
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.engine.llm_engine import LLMEngine

    plain = save_tiny(tmp_path / "llama", "llama", word_tokenizer=True)
    ouro = write_ouro(tmp_path / "ouro")
    for model in (plain, ouro):
        cfg = {"model": str(model), "kv_slots": 256, "max_model_len": 64,
               "exit_semantics": "upstream"}
        with pytest.raises(ValueError, match=r"^exit_semantics 'upstream' \(--exit-semantics\) "
                                             r"needs a Huginn model"):
            LLMEngine(EngineConfig(**cfg))
        several = LLMEngine(EngineConfig(**cfg, latent_cap_where_applicable=True))
        assert several.exit_semantics == "engine"
