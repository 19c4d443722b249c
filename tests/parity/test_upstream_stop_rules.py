"""``upstream_stop_rules`` (issue 26): with it on, the engine ends on EOS as COCONUT's and
PCCoT's upstream ``generate`` do, and its tokens equal the upstream-following references
(``reference_generate`` / ``reference_generate_loop`` with ``upstream_stop_rules=True``) at
the edges: an EOS as the first answer token is kept and decoding goes on (at least two
tokens), an EOS as the second answer token ends the answer there. Requests with and without
the option share batches and a warm prefix cache; without it the answers are today's.
Families whose upstream stops as the engine does refuse the option.

The edges are forced on random tiny weights by declaring EOS (``eos_token_id`` in a copy
of the model directory's ``config.json``, as a user's checkpoint declares it) the tokens the
model picks first or second for a prompt, alongside the tokenizer's own EOS.
"""

import dataclasses
import json
import shutil

import pytest

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.parity import shared_prefix_prompts

MAX_TOKENS = 6
PROMPTS = shared_prefix_prompts()
BUDGET = 2


def _with_eos(model_dir, dest, extra: set[int]):
    """A copy of ``model_dir`` at ``dest`` whose config (and generation config) declare the
    original eos ids plus ``extra``. Returns ``dest``."""
    shutil.copytree(model_dir, dest)
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            eos = cfg.get("eos_token_id")
            eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
            cfg["eos_token_id"] = sorted(set(eos) | extra)
            path.write_text(json.dumps(cfg))
    return dest


def _edges(generate) -> tuple[int, int, set[int]]:
    """``(first, second, ids)``: ``ids`` to declare eos, ``PROMPTS[first]``'s first answer
    token and ``PROMPTS[second]``'s second (``generate(prompt)`` -> answer ids with
    ``ignore_eos``), ``second`` the first prompt whose first two tokens differ from each
    other and from ``PROMPTS[first]``'s first."""
    answers = [generate(p) for p in PROMPTS]
    first = 0
    a = answers[first][0]
    second = next(i for i, (x, y, *_) in enumerate(answers) if a not in (x, y) and x != y)
    return first, second, {a, answers[second][1]}


@dataclasses.dataclass
class Case:
    """A model directory with edge ids as eos; ``reference(prompt, upstream)`` -> answer
    ids; ``PROMPTS[first]`` answers eos first, ``PROMPTS[second]`` eos second."""

    model: object
    reference: object
    first: int
    second: int


def _requests(case):
    """(prompt, upstream_stop_rules) pairs: every prompt with the option on and off (the
    same prompt on and off in one batch), and the edge prompts once more."""
    return ([(p, True) for p in PROMPTS] + [(p, False) for p in PROMPTS]
            + [(PROMPTS[case.first], True), (PROMPTS[case.second], None)])


def _run(engine, reqs):
    """Run ``reqs`` in one batch; per request ``(output ids, finish_reason, cached tokens)``."""
    rids = [f"q{engine._arrivals + i}" for i in range(len(reqs))]
    for rid, (prompt, upstream) in zip(rids, reqs):
        engine.add_request(rid, prompt, SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, latent_budget=BUDGET,
            upstream_stop_rules=upstream))
    tokens, reason, cached = {r: [] for r in rids}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.rid] += out.new_token_ids
            cached[out.rid] = out.num_cached_tokens
            if out.finished:
                reason[out.rid] = out.finish_reason
    engine.cache.check_idle()
    return [(tokens[r], reason[r], cached[r]) for r in rids]


def _engine(model_dir, **kw):
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def _check_edges(case):
    """The forced edges happen in the reference."""
    first = PROMPTS[case.first]
    off, on = case.reference(first, False), case.reference(first, True)
    assert len(off) == 1  # today: the first-token eos ends the answer
    assert len(on) >= 2 and on[0] == off[0]  # upstream: kept, and decoding goes on
    # an eos as the second token ends the answer there with either rule
    second = PROMPTS[case.second]
    assert len(case.reference(second, True)) == len(case.reference(second, False)) == 2


def _check_engine(engine, case):
    """Cold, then warm: every request equals the reference of its setting (None: off, the
    engine default here)."""
    reqs = _requests(case)
    for warm in (False, True):
        results = _run(engine, reqs)
        for (ids, reason, _), (prompt, upstream) in zip(results, reqs):
            assert ids == case.reference(prompt, bool(upstream)), (prompt[:3], upstream)
            stopped = ids[-1] in engine.eos_ids and (len(ids) >= 2 or not upstream)
            assert reason == ("stop" if stopped else "length")
        if warm:
            assert sum(c for _, _, c in results) > 0  # the prompts were served from the cache


# ----------------------------------------------------------------------------- COCONUT


@pytest.fixture(scope="module")
def coconut(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from tests.support.latent_reference import reference_generate

    root = tmp_path_factory.mktemp("upstream-stop-coconut")
    plain = save_latent_tiny(root / "src", "coconut-llama")
    first, second, extra = _edges(lambda p: reference_generate(
        plain, p, BUDGET, MAX_TOKENS, ignore_eos=True)[0])
    model = _with_eos(plain, root / "model", extra)

    def reference(prompt, upstream):
        return reference_generate(model, prompt, BUDGET, MAX_TOKENS,
                                  upstream_stop_rules=upstream)[0]

    return Case(model, reference, first, second)


def test_coconut_keeps_a_first_answer_eos_as_upstream(coconut):
    _check_edges(coconut)
    _check_engine(_engine(coconut.model), coconut)


def test_server_default_applies_to_requests_that_do_not_say(coconut):
    """``EngineConfig.upstream_stop_rules``: None takes it, False overrides it."""
    engine, reference = _engine(coconut.model, upstream_stop_rules=True), coconut.reference
    prompt = PROMPTS[coconut.first]
    results = _run(engine, [(prompt, None), (prompt, False), (prompt, True)])
    assert [ids for ids, _, _ in results] == [reference(prompt, True), reference(prompt, False),
                                              reference(prompt, True)]
    assert len(results[0][0]) > len(results[1][0]) == 1


def test_max_tokens_one_ends_a_kept_first_eos_with_length(coconut):
    """Upstream with max_new_tokens=1 returns the first-token eos alone; so does the
    engine, with reason "length" (the eos did not stop it)."""
    engine = _engine(coconut.model)
    engine.add_request("a", PROMPTS[coconut.first], SamplingParams(
        max_tokens=1, temperature=0.0, latent_budget=BUDGET, upstream_stop_rules=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == 1 and ids[0] in engine.eos_ids
    assert outs[-1].finished and outs[-1].finish_reason == "length"


# ----------------------------------------------------------------------------- PCCoT


@pytest.fixture(scope="module")
def pccot(tmp_path_factory, smollm2_dir):
    pytest.importorskip("peft")
    from latentserve.bench.baseline.loop_reference import load_pccot_reference
    from tests.support.loop_models import save_loop_tiny
    from tests.support.loop_reference import reference_generate_loop

    root = tmp_path_factory.mktemp("upstream-stop-pccot")
    plain = save_loop_tiny(root, "pccot-llama", block_size=3, iterations=2)
    ref = load_pccot_reference(str(root / "base"), str(root / "adapter"))
    first, second, extra = _edges(lambda p: reference_generate_loop(
        ref, p, BUDGET, MAX_TOKENS, ignore_eos=True)[0])
    model = _with_eos(plain, root / "model-eos", extra)
    ref = dataclasses.replace(ref, eos=ref.eos | extra)

    def reference(prompt, upstream):
        return reference_generate_loop(ref, prompt, BUDGET, MAX_TOKENS,
                                       upstream_stop_rules=upstream)[0]

    return Case(model, reference, first, second)


def test_pccot_emits_at_least_two_tokens_as_upstream(pccot):
    _check_edges(pccot)
    _check_engine(_engine(pccot.model), pccot)


# ----------------------------------------------------------------------------- refusals


def test_families_without_an_upstream_rule_refuse_it(tmp_path, smollm2_dir, tiny_dirs):
    """CODI (upstream stops on the first eos, as the engine does), LOTUS (no upstream code)
    and a plain model: True is a ValueError naming the field, per request and as the engine
    default; False and None are accepted; a multi-model server's default is ignored there."""
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from tests.support.loop_models import write_lotus

    codi = save_latent_tiny(tmp_path / "codi", "codi-gpt2")
    lotus = write_lotus(tmp_path / "lotus", block_size=2, iterations=1)
    for model_dir in (codi, lotus, tiny_dirs["llama"]):
        engine = _engine(model_dir)
        with pytest.raises(ValueError, match="^upstream_stop_rules needs"):
            engine.add_request("a", [5, 6, 7], SamplingParams(upstream_stop_rules=True))
        for ok in (False, None):
            engine.add_request(f"ok-{ok}", [5, 6, 7], SamplingParams(
                max_tokens=2, temperature=0.0, upstream_stop_rules=ok))
        while engine.has_unfinished_requests():
            engine.step()
        with pytest.raises(ValueError, match="^upstream_stop_rules needs"):
            _engine(model_dir, upstream_stop_rules=True)
        several = _engine(model_dir, upstream_stop_rules=True, latent_cap_where_applicable=True)
        assert several.upstream_stop_rules is False


def test_sampling_params_take_a_boolean_or_none():
    assert SamplingParams().upstream_stop_rules is None
    with pytest.raises(ValueError, match="^upstream_stop_rules must be a boolean"):
        SamplingParams(upstream_stop_rules=1)


def test_cli_flag_sets_the_default_and_several_models_apply_it_where_it_can(tiny_dirs):
    """``--upstream-stop-rules`` reaches ``EngineConfig`` (off without it); with several
    ``--model`` each config may ignore it (``latent_cap_where_applicable``)."""
    import argparse

    from latentserve.cli import add_engine_args, build_parser, engine_config, engine_configs

    assert engine_config(build_parser().parse_args(["serve"])).upstream_stop_rules is False
    args = build_parser().parse_args(["serve", "--upstream-stop-rules"])
    assert engine_config(args).upstream_stop_rules is True
    p = argparse.ArgumentParser()
    add_engine_args(p, several_models=True)
    args = p.parse_args(["--model", str(tiny_dirs["llama"]), "--model", "other",
                         "--upstream-stop-rules"])
    plain = engine_configs(args)[0]
    assert plain.upstream_stop_rules and plain.latent_cap_where_applicable
    assert LLMEngine(plain).upstream_stop_rules is False  # the plain model ignores it
