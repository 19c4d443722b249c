"""CoLaR served closed-loop (latent/colar_head.py): on a tiny random CoLaR directory
(``tests.support.colar_models.save_colar_tiny``, whose policy leans towards ``###`` so the stop
fires after a few latents), batched engine runs equal the eager single-request reference
over HF transformers (``tests.support.colar_reference.colar_generate_reference``, upstream
``latent_generate`` with greedy choices): answer tokens, latent steps, stop or cap, the
prompt as the engine extends it, and the first answer token's logits within 1e-4 (fp32);
for a batch mixing thinking speeds and caps, cold and warm prefix cache, with overlap
scheduling asked for, chunked prefill with preemptions, and the decode-graph path (CUDA
graphs emulated on CPU). Per-request controls: thinking off, min_latent, use_stop, a
seeded latent temperature, a prompt that already holds the speed, refusals."""

import json
import os
import re

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (the graph test)

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.latent import colar
from latentserve.sampling_params import SamplingParams
from tests.support.colar_models import save_colar_tiny
from tests.support.colar_reference import colar_generate_reference, run_colar_batch

MAX_TOKENS = 8
SEP = 3  # "###" in save_colar_word_tokenizer

_BASE = [f"w{(37 * i + 11) % 900 + 30}" for i in range(24)]
_OTHER = [f"w{(53 * i + 7) % 800 + 100}" for i in range(12)]
QUESTIONS = [" ".join(_BASE + ["w500", "w501"]), " ".join(_BASE + ["w600"] * 5),
             " ".join(_BASE[:10]), " ".join(_BASE + [f"w{700 + i}" for i in range(9)]),
             "w45 w46", " ".join(_OTHER + ["w31"]), " ".join(_OTHER + ["w33", "w34", "w35"]),
             " ".join(_BASE + ["w999"])]


def _cases():
    """10 (question, compression factor, max_latent): every question with rotating speeds
    and caps, plus two more runs of one question at other speeds."""
    caps = (12, 3, 12, 6, 12)
    out = [(q, i % 5 + 1, caps[i % 5]) for i, q in enumerate(QUESTIONS)]
    return out + [(QUESTIONS[4], 3, 12), (QUESTIONS[4], 5, 3)]


@pytest.fixture(scope="module")
def colar_dir(tmp_path_factory):
    return save_colar_tiny(tmp_path_factory.mktemp("colar") / "m", stop_push=16.0)


@pytest.fixture(scope="module")
def reference(colar_dir):
    """``run(question, c, max_latent, max_tokens=MAX_TOKENS, **kw)`` -> the reference's
    ``ColarReferenceOutput``."""
    from transformers import AutoModelForCausalLM

    from latentserve.models.checkpoint import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(colar_dir, dtype=torch.float32).eval()
    tok = load_tokenizer(colar_dir)
    cfg, policy = colar.load_colar(colar_dir)

    def run(question, c, max_latent, max_tokens=MAX_TOKENS, **kw):
        return colar_generate_reference(model, tok, policy, cfg, question, c, max_latent,
                                        max_tokens, **kw)

    return run


@pytest.fixture(scope="module")
def references(reference):
    return [reference(q, c, m) for q, c, m in _cases()]


def _run(engine, cases, max_tokens=MAX_TOKENS, **extra):
    return run_colar_batch(engine, cases, max_tokens, **extra)


def _end(ref) -> str:
    """Upstream's phase end: the stop fired when the last latent's logits name ``###``."""
    fired = ref.n_latent > 0 and int(ref.latent_logits[-1].argmax()) == SEP
    return "stop" if fired else "cap"


def _assert_matches(results, refs, cases, what=""):
    for i, ((toks, final, first), ref, case) in enumerate(zip(results, refs, cases)):
        msg = f"{what} request {i} {case[1:]}"
        assert toks == ref.answer_ids, f"{msg}: engine {toks} != ref {ref.answer_ids}"
        st = final.latent_stats
        assert (st["steps"], st["end"]) == (ref.n_latent, _end(ref)), msg
        assert st["stop_step"] == (ref.n_latent if _end(ref) == "stop" else None), msg
        assert st["compression_factor"] == case[1] and st["max_latent"] == case[2], msg
        assert final.latent_steps == ref.n_latent, msg
        assert final.num_prompt_tokens == len(ref.prompt_ids), msg  # + speed + "###"
        torch.testing.assert_close(first, ref.answer_logits[0], atol=1e-4, rtol=0, msg=msg)


def test_the_batch_fires_stops_at_several_steps_and_hits_caps(references):
    ends = [_end(r) for r in references]
    assert "cap" in ends
    assert len({r.n_latent for r, e in zip(references, ends) if e == "stop"}) >= 3


@pytest.mark.parametrize("config", [
    {}, {"overlap_schedule": True},
    {"max_num_batched_tokens": 7, "kv_slots": 120, "max_num_seqs": 6}],
    ids=["default", "overlap", "chunked-preempted"])
def test_mixed_batch_matches_reference_cold_then_warm(colar_dir, references, config):
    engine = LLMEngine(EngineConfig(model=str(colar_dir), **config))
    spec = engine.latent_spec
    assert (spec.kind, spec.family, spec.end_ids) == ("head", "colar", (SEP,))
    cases = _cases()
    _assert_matches(_run(engine, cases), references, cases, "cold")
    engine.cache.check_idle()
    warm = _run(engine, cases)
    _assert_matches(warm, references, cases, "warm")
    engine.cache.check_idle()
    if "kv_slots" in config:
        assert engine.scheduler.num_preemptions > 0
    else:  # prompt + speed + "###" were served from the cache, and no latent position
        for (_, final, _), ref in zip(warm, references):
            assert 0 < final.num_cached_tokens <= len(ref.prompt_ids)


def test_thinking_off_is_the_reference_without_latents(colar_dir, reference):
    """Thinking off (or ``latent_budget`` 0): ``###`` right after the prompt's ``###``."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    cases = [(q, c, None) for q, c in zip(QUESTIONS[:4], (1, 2, 4, 5))]
    refs = [reference(q, c, 0) for q, c, _ in cases]
    for extra in ({"thinking": False}, {"latent_budget": 0}):
        for (toks, final, first), ref in zip(_run(engine, cases, **extra), refs):
            assert toks == ref.answer_ids
            assert final.latent_stats["thinking"] is False and final.latent_stats["steps"] == 0
            assert final.num_prompt_tokens == len(ref.prompt_ids) + 1  # the forced "###"
            torch.testing.assert_close(first, ref.answer_logits[0], atol=1e-4, rtol=0)
    engine.cache.check_idle()


def test_min_latent_and_use_stop_hold_the_stop_back(colar_dir, references):
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    i = next(k for k, r in enumerate(references) if _end(r) == "stop" and r.n_latent <= 2)
    q, c, _ = _cases()[i]
    (_, off, _), = _run(engine, [(q, c, 9)], use_stop=False)
    (_, late, _), = _run(engine, [(q, c, 9)], min_latent=4)
    assert (off.latent_stats["steps"], off.latent_stats["end"]) == (9, "cap")
    st = late.latent_stats
    assert st["steps"] >= 4 and (st["end"], st["stop_step"]) in (("cap", None),
                                                                  ("stop", st["steps"]))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_answer_masks_leave_the_latent_phase_alone(colar_dir, references, overlap):
    """A grammar, ``bad_words``, ``allowed_token_ids``, a ``logit_bias`` or a repetition
    penalty (``###`` is in the prompt) that exclude ``###`` cover the answer only: the stop
    is the token a latent step samples, so the latent phase (steps, stop step) is the
    reference's."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir), overlap_schedule=overlap))
    picked = [k for k, r in enumerate(references) if _end(r) == "stop"][:3]
    cases = [_cases()[k] for k in picked]
    for extra in ({"bad_words": ["###"]}, {"allowed_token_ids": list(range(4, 1024))},
                  {"structured_outputs": {"regex": "w[0-9]+"}}, {"logit_bias": {SEP: -100}},
                  {"repetition_penalty": 1e6}):
        for (toks, final, _), k in zip(_run(engine, cases, **extra), picked):
            st, ref = final.latent_stats, references[k]
            assert (st["steps"], st["end"], st["stop_step"]) == (
                ref.n_latent, "stop", ref.n_latent), extra
            assert SEP not in toks, extra
            if "structured_outputs" in extra:  # and the grammar holds the answer
                raw = "".join(engine.tokenizer.convert_ids_to_tokens(toks))
                assert re.fullmatch("w[0-9]+", raw), raw
    engine.cache.check_idle()


def test_latent_budget_is_max_latent_and_checked_as_it(colar_dir):
    """``latent_budget`` aliases ``max_latent``: ``min_latent`` above it is refused as above
    ``max_latent``, and two different values are refused (neither silently wins)."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    ids = engine.tokenizer.encode(QUESTIONS[0])
    for kw, msg in (({"min_latent": 10, "latent_budget": 3},
                     r"^min_latent must be at most latent_budget \(3\), got 10$"),
                    ({"latent_budget": 3, "max_latent": 6},
                     r"^latent_budget must equal max_latent when both are sent .* got 3 and 6; "
                     r"give one$")):
        with pytest.raises(ValueError, match=msg):
            engine.add_request("x", ids, SamplingParams(max_tokens=2, **kw))
    engine.add_request("ok", ids, SamplingParams(max_tokens=2, latent_budget=3, max_latent=3))
    while engine.has_unfinished_requests():
        engine.step()
    engine.cache.check_idle()


def test_max_tokens_counts_answer_tokens_only(colar_dir):
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    (toks, final, _), = _run(engine, [(QUESTIONS[0], 2, 6)], max_tokens=2, use_stop=False,
                             ignore_eos=True)
    assert len(toks) == 2 and final.finish_reason == "length"
    assert final.latent_stats["steps"] == 6


def test_seeded_latent_temperature_draws_the_reference_latents(colar_dir, reference):
    """``latent_temperature`` > 0 draws each latent with the request's seed (greedy tokens
    leave the generator to the latents), as the reference does with a generator seeded
    alike; another seed draws other latents."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    cases = [(QUESTIONS[i], c, 12) for i, c in ((0, 2), (4, 3), (6, 5))]
    got = _run(engine, cases, latent_temperature=0.8, seed=7)
    for (toks, final, first), (q, c, cap) in zip(got, cases):
        ref = reference(q, c, cap, temperature=0.8, generator=torch.Generator().manual_seed(7))
        assert toks == ref.answer_ids and final.latent_stats["steps"] == ref.n_latent
        assert final.latent_stats["latent_temperature"] == 0.8
        torch.testing.assert_close(first, ref.answer_logits[0], atol=1e-4, rtol=0)
    other = _run(engine, cases, latent_temperature=0.8, seed=8)
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(got, other))


def test_a_prompt_holding_the_speed_is_taken_as_is(colar_dir, reference):
    """Upstream's whole prompt (``prompt_text``, ending in ``###``) gets nothing appended;
    its speed is the request's, and a contradicting ``compression_factor`` is refused."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    q = QUESTIONS[4]
    ids = engine.tokenizer.encode(colar.prompt_text(q, 3), add_special_tokens=False)
    ref = reference(q, 3, 12)
    assert ids == ref.prompt_ids
    for c in (None, 3):
        (toks, final, _), = _run(engine, [(ids, c, 12)])
        assert toks == ref.answer_ids and final.num_prompt_tokens == len(ids)
        assert final.latent_stats["compression_factor"] == 3
    with pytest.raises(ValueError, match="compression_factor 2 contradicts"):
        engine.add_request("x", ids, SamplingParams(compression_factor=2))
    # a speed the model does not take, and a prompt naming none (whose speed is unknown)
    enc = engine.tokenizer.encode
    bad = enc(colar.prompt_text(q, 9), add_special_tokens=False)
    with pytest.raises(ValueError, match=r"^prompt names \(Thinking speed: 9\); the speed "
                                         r"must be in \[1, 5\] for this model$"):
        engine.add_request("x", bad, SamplingParams())
    bare = enc(colar.QUESTION.format(q), add_special_tokens=False) + [SEP]
    with pytest.raises(ValueError, match="compression_factor 3 would be ignored: the prompt "
                                         "ends with ### and names no speed"):
        engine.add_request("x", bare, SamplingParams(compression_factor=3))
    (_, final, _), = _run(engine, [(bare, None, 4)])
    assert final.latent_stats["compression_factor"] is None
    assert not engine.has_unfinished_requests()
    engine.cache.check_idle()


def test_latent_steps_past_the_context_end_with_length(colar_dir):
    """CoLaR's latent steps take KV slots beside ``max_tokens``; offline, as vLLM's
    ``max_tokens``, a cap past the context is taken and the request ends with ``length``
    where the context does (the server refuses a sent one: tests/server/test_colar_api.py)."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir), max_model_len=40))
    ids = engine.tokenizer.encode(colar.QUESTION.format(QUESTIONS[4]), add_special_tokens=False)
    # each latent step's output is fed at the next position: the last must fit too
    room = 40 - len(ids) - len(engine.latent_spec.start_ids) - 1
    engine.add_request("x", ids, SamplingParams(max_latent=10**30, use_stop=False,
                                                max_tokens=4))
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    st = out[0].latent_stats
    assert (st["steps"], st["end"], out[0].finish_reason) == (room, "length", "length")
    # a floor that leaves no room for ### and one answer token is refused, as the server's
    # context-length 400 (offline it ran fewer steps than the floor)
    with pytest.raises(ValueError, match=f"min_latent must be at most {room - 1} for this"):
        engine.add_request("y", ids, SamplingParams(max_latent=room + 5, min_latent=room))
    assert not engine.has_unfinished_requests()
    engine.cache.check_idle()


@pytest.mark.parametrize("field,value,match", [
    ("compression_factor", 6, r"compression_factor must be in \[1, 5\]"),
    ("compression_factor", 0, "compression_factor must be >= 1"),
    ("latent_temperature", -0.5, r"latent_temperature must be in \[0.0, 100.0\]"),
    ("latent_temperature", 1e39, r"latent_temperature must be in \[0.0, 100.0\]"),
    ("stop_threshold", 0.5, "stop_threshold is not a control of a CoLaR model"),
    ("min_output_tokens", 0, "min_output_tokens is not a control of a CoLaR model")])
def test_bad_or_foreign_controls_are_refused(colar_dir, field, value, match):
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", [40, 41], SamplingParams(**{field: value}))
    assert not engine.has_unfinished_requests()


def test_a_plain_model_refuses_the_colar_fields(small_vocab_dirs):
    engine = LLMEngine(EngineConfig(model=str(small_vocab_dirs["llama"])))
    for field, value in (("compression_factor", 2), ("latent_temperature", 0.0)):
        with pytest.raises(ValueError, match=f"{field} needs a CoLaR model"):
            engine.add_request("x", [5, 6], SamplingParams(**{field: value}))


def test_a_train_colar_output_serves_like_the_reference(tmp_path):
    """``latentserve train colar``'s output (a PEFT LoRA adapter over the base, merged at
    load, beside ``colar_config.json`` and the policy) serves as the reference runs it."""
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.train.colar import ColarTrainConfig, train
    from tests.support.colar_models import save_colar_word_tokenizer
    from tests.support.colar_reference import load_colar_reference

    base = save_tiny(tmp_path / "base", "llama", word_tokenizer=True, vocab_size=64)
    save_colar_word_tokenizer(base, 64)
    data = tmp_path / "toy.txt"
    data.write_text("".join(f"{x} + {y}||{x} + {y} = {x + y} #### {x + y}\n"
                            for x in range(10) for y in range(10 - x)))
    out = tmp_path / "colar"
    train(ColarTrainConfig(data=[str(data)], out=str(out), base=str(base), lora_r=8,
                           steps=40, batch_size=16, lr=1e-2, warmup=5,
                           max_compression_factor=2, max_latent=8), progress=lambda *_: None)
    model, tok, cfg, policy = load_colar_reference(out)
    engine = LLMEngine(EngineConfig(model=str(out)))
    cases = [(q, c, 8) for q in ("3 + 4", "1 + 2", "5 + 0") for c in (1, 2)]
    refs = [colar_generate_reference(model, tok, policy, cfg, q, c, m, MAX_TOKENS)
            for q, c, m in cases]
    _assert_matches(_run(engine, cases), refs, cases, "trained")
    engine.cache.check_idle()


def test_warmup_runs_a_latent_step(colar_dir):
    """The engine's warm-up request takes only controls CoLaR accepts: prompt, speed and
    ``###``, one latent, the forced ``###`` and an answer token are computed."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir)))
    engine.warmup()
    assert engine.runner.num_computed_tokens >= 4 + len(engine.latent_spec.start_ids) + 2
    engine.cache.check_idle()


def test_colar_eval_runs_latents_at_the_asked_speed(colar_dir, reference):
    """``eval.colar_eval.evaluate`` on a CoLaR model sends the question part and its
    compression factor, and reads the latent steps from the stats."""
    from latentserve.entrypoints.llm import LLM
    from latentserve.eval.colar_eval import evaluate
    from latentserve.eval.datasets import Item

    llm = LLM(model=str(colar_dir))
    items = [Item(question=q, gold="1", kind="number") for q in QUESTIONS[:3]]
    records, summary = evaluate(llm, items, max_tokens=4, compression_factor=3, max_latent=6)
    assert [r["thinking"] for r in records] == [reference(q, 3, 6, 4).n_latent
                                                for q in QUESTIONS[:3]]
    assert summary["n"] == 3


def test_colar_eval_takes_colars_controls_and_refuses_a_heads(colar_dir, reference):
    """``min_latent`` and ``use_stop`` are CoLaR's controls too: the eval sends them (the
    reference's steps with the stop off run to the cap); ``stop_threshold`` is a stop
    head's, refused naming its flag."""
    from latentserve.entrypoints.llm import LLM
    from latentserve.eval.colar_eval import evaluate
    from latentserve.eval.datasets import Item

    llm = LLM(model=str(colar_dir))
    items = [Item(question=q, gold="1", kind="number") for q in QUESTIONS[:2]]
    records, _ = evaluate(llm, items, max_tokens=3, compression_factor=2, max_latent=5,
                          min_latent=1, use_stop=False)
    assert [r["thinking"] for r in records] == [5, 5]
    with pytest.raises(ValueError, match=r"^--stop-threshold \(stop_threshold\) is not a "
                                         r"control of this model \(colar\)"):
        evaluate(llm, items, max_tokens=3, stop_threshold=0.3)
    # the chat-format backend sends no answer-budget floor, which CoLaR does not take
    from latentserve.eval.backends import EngineBackend, Request

    (done,) = EngineBackend(model=str(colar_dir)).run(
        [Request(QUESTIONS[0], max_tokens=3, max_latent=4)], use_stop=False)
    assert done.latent_steps == 4


def test_cli_sweep_and_the_flag_it_sweeps_are_refused_together(colar_dir, tmp_path, capsys):
    from latentserve.cli import main

    data = tmp_path / "q.txt"
    data.write_text(f"{QUESTIONS[0]}||x #### 1\n")
    for flag, key in (("--max-latent", "max_latent"),
                      ("--compression-factor", "compression_factor")):
        assert main(["eval", "--model", str(colar_dir), "--dataset-file", str(data), flag, "3",
                     "--sweep", f"{key}=1,2"]) == 2
        assert f"{flag} and --sweep {key}=... both set {key}; give one" in \
            capsys.readouterr().err


def test_cli_speed_sweep_writes_runs_and_a_plot_beside_a_baseline(colar_dir, reference,
                                                                   tmp_path):
    """``latentserve eval`` on a CoLaR directory: ``--sweep compression_factor=1,3`` writes
    one summary per speed (latent steps as the reference runs them) and ``--plot`` a PNG
    with a text-CoT ``--baseline``; a baseline that is no summary is refused first."""
    from latentserve.cli import main

    data = tmp_path / "q.txt"
    data.write_text("".join(f"{q}||x #### 1\n" for q in QUESTIONS[:2]))
    base = tmp_path / "cot.json"
    base.write_text(json.dumps({"n": 2, "accuracy": 0.5, "thinking": {"median": 9.0}}))
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = ["eval", "--model", str(colar_dir), "--dataset-file", str(data), "--max-tokens",
            "3", "--max-latent", "6", "--sweep", "compression_factor=1,3"]
    assert main([*args, "--json-out", str(out), "--plot", str(png),
                 "--baseline", str(base)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["compression_factor"] for r in runs] == [1, 3]
    for r, c in zip(runs, (1, 3)):
        steps = [reference(q, c, 6, 3).n_latent for q in QUESTIONS[:2]]
        assert r["thinking"]["max"] == max(steps) and r["n"] == 2
    assert png.read_bytes()[:4] == b"\x89PNG"
    base.write_text("{}")
    assert main([*args, "--plot", str(tmp_path / "p.png"), "--baseline", str(base)]) != 0


def test_no_latent_head_serves_the_bare_backbone(colar_dir):
    engine = LLMEngine(EngineConfig(model=str(colar_dir), no_latent_head=True))
    assert engine.latent_spec is None and not hasattr(engine.runner.model, "latent_head")


# ----------------------------------------------------------------------------- graphs

@pytest.fixture
def emulated_graphs(monkeypatch):
    pytest.importorskip("triton")
    from tests.support.graph_emulation import emulate_graphs
    from tests.support.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()
    emulate_graphs(monkeypatch)


def test_decode_graphs_run_the_policy_beside_the_lm_head(colar_dir, references,
                                                        emulated_graphs):
    """Fused ops, Triton attention and decode steps replayed from (emulated) CUDA graphs:
    the policy runs in the decode graph on its final-normed hidden, beside the LM head, and
    the answers equal the reference's."""
    engine = LLMEngine(EngineConfig(model=str(colar_dir), fused_ops=True,
                                    attention_backend="triton", max_num_seqs=8,
                                    max_model_len=128, attention_num_kv_splits=2))
    engine.runner.capture_graphs(8, engine.runner.model.config.hidden_size, torch.float32)
    engine.scheduler.forced_one_by_one = True
    graphs = engine.runner.graphs
    assert graphs.head is engine.runner.model.latent_head and graphs.capture_layer == -1
    cases = _cases()[:5]  # every speed 1..5, caps 12 and 3 and 6
    _assert_matches(_run(engine, cases), references[:5], cases, "graphs")
    engine.cache.check_idle()
    assert engine.runner.num_graph_steps > MAX_TOKENS
    assert 0 < graphs.num_latent_replays < engine.runner.num_graph_steps
