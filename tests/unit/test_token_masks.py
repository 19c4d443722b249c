"""Token masks in the sampler (``token_masks.py``, ``sampling.apply_token_mask``) and the
four vLLM fields built on them, offline (``LLM.generate``) on a tiny Llama with SmolLM2's
tokenizer: ``allowed_token_ids``, ``bad_words``, ``min_tokens`` and
``include_stop_str_in_output``; plus structured outputs and the latent phase."""

import json
import random
import re

import numpy as np
import pytest
import torch

from latentserve import token_masks
from latentserve.core import Req
from latentserve.sampling import TokenMask, apply_token_mask, sample_with_logprobs, unpack_bitmask
from latentserve.sampling_params import SamplingParams, StructuredOutputsParams
from latentserve.token_masks import RequestMask, bad_words_ids, ids_bitmask

VOCAB = 100


def _mask(ids_per_row: dict[int, list[int]], vocab=VOCAB) -> TokenMask:
    rows = sorted(ids_per_row)
    bits = np.stack([ids_bitmask(ids_per_row[b], vocab) for b in rows])
    return TokenMask(rows, torch.from_numpy(bits))


def test_unpack_bitmask_sets_exactly_the_packed_ids():
    ids = [0, 1, 31, 32, 63, 64, 99]
    allowed = unpack_bitmask(torch.from_numpy(ids_bitmask(ids, VOCAB))[None], VOCAB)[0]
    assert allowed.nonzero().flatten().tolist() == ids


def test_masked_rows_only_take_allowed_ids_and_other_rows_are_untouched():
    logits = torch.randn(4, VOCAB)
    mask = _mask({1: [7, 9], 3: [50]})
    out = apply_token_mask(logits, mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [7, 9]
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [50]
    assert torch.equal(out[1, [7, 9]], logits[1, [7, 9]])


def test_library_kernel_and_torch_fallback_agree(monkeypatch):
    import builtins

    logits = torch.randn(3, 70)  # a vocabulary that is no multiple of 32
    mask = _mask({0: [1, 33, 69], 2: list(range(0, 70, 3))}, vocab=70)
    with_lib = apply_token_mask(logits, mask)
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    assert torch.equal(apply_token_mask(logits, mask), with_lib)


def _req(params, output=()):
    r = Req("r", [1, 2], params)
    r.output_ids = list(output)
    return r


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_takes_masked_rows_from_their_allowed_ids_and_logprobs_stay_raw(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    reqs = [_req(SamplingParams(temperature=temperature, logprobs=0)) for _ in range(3)]
    mask = _mask({1: [3, 4, 5]})
    for _ in range(5):
        out = sample_with_logprobs(logits, reqs, mask=mask,
                                   greedy=logits.argmax(-1))  # a graph's (unmasked) argmax
        assert out.tokens[1].item() in (3, 4, 5)
        raw = torch.log_softmax(logits[1], -1)[out.tokens[1]].item()
        assert out.logprobs[1].logprob == pytest.approx(raw, abs=1e-5)
    if temperature == 0.0:
        assert out.tokens[0].item() == logits[0].argmax().item()
        assert out.tokens[1].item() == 3 + logits[1, 3:6].argmax().item()


def test_bad_words_are_tokenized_as_vllm_does(smollm2_tokenizer):
    tok = smollm2_tokenizer
    got = bad_words_ids(tok, ["hello world"])
    assert got[0] == tok.encode("hello world", add_special_tokens=False)
    assert got[1] == tok.encode(" hello world", add_special_tokens=False)
    with pytest.raises(ValueError, match="bad_words"):
        bad_words_ids(tok, [" "])


def _filled_row(mask, params, answer):
    """The ``[W] int32`` row ``batch_bitmask`` fills for one request of ``answer``."""
    req = Req("r", [1], params, output_ids=list(answer), constraint=mask)
    return token_masks.batch_bitmask([req], VOCAB)[1][0]


def test_a_bad_words_last_token_is_masked_only_after_its_prefix():
    params = SamplingParams(bad_words=["x"])
    m = RequestMask(params, VOCAB, {2}, bad_words=[[10, 11, 12], [40]])

    def banned(answer):
        allowed = unpack_bitmask(_filled_row(m, params, answer)[None], VOCAB)[0]
        return sorted(set(range(VOCAB)) - set(allowed.nonzero().flatten().tolist()))

    assert banned([]) == [40]
    assert banned([10]) == [40]
    assert banned([5, 10, 11]) == [12, 40]
    assert banned([10, 11, 13]) == [40]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[7], max_tokens=5)
    m = RequestMask(params, VOCAB, {2, 7})
    for n, masked in ((0, True), (1, True), (2, False)):
        allowed = unpack_bitmask(_filled_row(m, params, [5] * n)[None], VOCAB)[0]
        assert (not allowed[2] and not allowed[7]) is masked
        assert allowed[3]


def test_sampling_params_validate_the_mask_fields():
    for kw, field in ((dict(min_tokens=-1), "min_tokens"),
                      (dict(min_tokens=9, max_tokens=8), "min_tokens"),
                      (dict(allowed_token_ids=[]), "allowed_token_ids"),
                      (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
                      (dict(bad_words="word"), "bad_words"), (dict(bad_words=[""]), "bad_words"),
                      (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
                      (dict(structured_outputs={"regex": "a", "choice": ["b"]}),
                       "structured_outputs"),
                      (dict(structured_outputs={"choice": []}), "structured_outputs"),
                      (dict(structured_outputs={"schema": {}}), "structured_outputs")):
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="^guided_json is not valid JSON"):
        StructuredOutputsParams(json="{x", param="guided_json")


# --- offline, on a tiny Llama with SmolLM2's tokenizer --------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    from latentserve import LLM

    return LLM(str(tiny_dirs["llama"]), max_num_seqs=8)


PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_allowed_token_ids_only_yields_those_ids(llm):
    allowed = [11, 257, 1000, 4000]
    for seed in range(3):
        outs = _gen(llm, PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=seed,
                                                 allowed_token_ids=allowed, ignore_eos=True))
        for o in outs:
            assert len(o.token_ids) == 12 and set(o.token_ids) <= set(allowed)


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=r"^allowed_token_ids must be in \[0, 49152\)"):
        _gen(llm, PROMPTS[:1], SamplingParams(allowed_token_ids=[5, 49152]))


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused(llm):
    """(Found by fuzzing the server: token 0, outside the allowed ids, came out.)"""
    with pytest.raises(ValueError, match=r"^allowed_token_ids holds only stop ids .* "
                                         r"min_tokens=2 forbids"):
        _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=3, allowed_token_ids=[2],
                                              stop_token_ids=[2], min_tokens=2))
    with pytest.raises(ValueError, match=r"^allowed_token_ids holds only ids that bad_words"):
        _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=3, allowed_token_ids=[11],
                                              bad_words=[llm.get_tokenizer().decode([11])]))
    # an EOS among others is fine: min_tokens only masks it
    out = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=3, allowed_token_ids=[2, 11],
                                                stop_token_ids=[2], min_tokens=2))[0]
    assert out.token_ids[:2] == [11, 11]


def test_a_bad_word_context_never_empties_the_allowed_ids():
    """A multi-token bad word whose last token is the only allowed one: allowed_token_ids
    wins over bad_words (nothing would be sampleable)."""
    import numpy as np

    from latentserve.token_masks import RequestMask, ids_bitmask

    params = SamplingParams(allowed_token_ids=[7])
    mask = RequestMask(params, 64, {2}, bad_words=[[5, 7]])
    row = np.full(2, -1, dtype=np.int32)
    mask.restrict(row, [5], 1, grammar=False)
    assert (row == ids_bitmask([7], 64)).all()


@pytest.mark.parametrize("bad", [49152, 10**6])
def test_stop_token_ids_outside_the_vocabulary_are_refused(llm, bad):
    with pytest.raises(ValueError, match=rf"^stop_token_ids must be in \[0, 49152\), got {bad}$"):
        _gen(llm, PROMPTS[:1], SamplingParams(stop_token_ids=[5, bad], min_tokens=2))


def _one_token_words(tok, ids):
    """Ids of ``ids`` whose text is a word that tokenizes back to that one id, both bare
    and after a space."""
    out = []
    for t in dict.fromkeys(ids):
        w = tok.decode([t])
        if w.strip() and re.fullmatch(r" ?[A-Za-z]+", w) and all(
                len(tok.encode(p + w.lstrip(), add_special_tokens=False)) == 1
                for p in ("", " ")):
            out.append((t, w))
    return out


def test_bad_words_are_never_produced(llm):
    tok = llm.tokenizer
    plain = _gen(llm, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    words = [w for o in plain for _, w in _one_token_words(tok, o.token_ids)][:6]
    assert words, "the greedy text has no one-token word to ban"
    banned = {t for w in words for t in (tok.encode(w.lstrip(), add_special_tokens=False)
                                         + tok.encode(" " + w.lstrip(), add_special_tokens=False))}
    outs = _gen(llm, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                             bad_words=words))
    for o, _p in zip(outs, plain):
        assert not banned & set(o.token_ids)
    assert [o.token_ids for o in outs] != [p.token_ids for p in plain]


def test_a_multi_token_bad_word_bans_its_last_token_after_its_prefix(llm):
    tok = llm.tokenizer
    plain = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0,
                                                  ignore_eos=True))[0].token_ids
    pair = next((plain[i : i + 2] for i in range(len(plain) - 1)
                 if tok.encode(tok.decode(plain[i : i + 2]), add_special_tokens=False)
                 == plain[i : i + 2] and tok.decode(plain[i : i + 2]).strip()), None)
    assert pair is not None
    word = tok.decode(pair)
    out = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                bad_words=[word]))[0].token_ids
    assert all(out[i : i + 2] != pair for i in range(len(out) - 1))
    assert out[: plain.index(pair[0]) + 1] == plain[: plain.index(pair[0]) + 1]


def test_min_tokens_forces_length_past_eos(llm):
    eos = llm.tokenizer.eos_token_id
    two = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, allowed_token_ids=[eos, 5])
           for s in range(4)]
    early = _gen(llm, PROMPTS * 4, [p for p in two for _ in PROMPTS])
    assert any(len(o.token_ids) < 6 for o in early)  # EOS is a likely pick
    forced = _gen(llm, PROMPTS * 4, [SamplingParams(max_tokens=10, temperature=1.0, seed=s,
                                                    allowed_token_ids=[eos, 5], min_tokens=6)
                                     for s in range(4) for _ in PROMPTS])
    for o in forced:
        assert len(o.token_ids) >= 6 and eos not in o.token_ids[:6]
        assert o.finish_reason == ("stop" if o.token_ids[-1] == eos else "length")


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_offline(llm, include):
    plain = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0,
                                                  ignore_eos=True))[0].text
    stop = plain[5:8]
    assert stop.strip() and plain.find(stop) == 5
    out = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                stop=[stop],
                                                include_stop_str_in_output=include))[0]
    assert out.finish_reason == "stop"
    assert out.text == (plain[:8] if include else plain[:5])


def test_min_tokens_holds_stop_strings_back_until_reached(llm):
    plain = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0,
                                                  ignore_eos=True))[0]
    stop = llm.tokenizer.decode(plain.token_ids[:1]).strip()[:3]
    assert stop and plain.text.count(stop) == 1
    out = _gen(llm, PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                stop=[stop], min_tokens=4))[0]
    assert out.text == plain.text and out.finish_reason == "length"


def test_masked_requests_leave_unmasked_ones_in_the_batch_exact(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = _gen(llm, PROMPTS, plain)
    so = StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{3,8}){0,3}")
    mixed = _gen(llm, [PROMPTS[0], "Hi", PROMPTS[1], "Yo", PROMPTS[2]],
                 [plain, SamplingParams(max_tokens=12, temperature=1.0, structured_outputs=so),
                  plain, SamplingParams(max_tokens=12, bad_words=["the"], min_tokens=3),
                  plain])
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in alone]
    assert re.fullmatch(so.regex, mixed[1].text) or mixed[1].finish_reason == "length"


# --- structured outputs offline ------------------------------------------------------------

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}


def _valid(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "ok"}
            and isinstance(value["name"], str) and 1 <= len(value["name"]) <= 8
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["ok"], bool))


def test_json_schema_answers_parse_and_validate(llm):
    outs = _gen(llm, PROMPTS * 2, [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                                                  structured_outputs={"json": SCHEMA})
                                   for s in range(6)])
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert _valid(json.loads(o.text)), o.text
        assert o.token_ids[-1] == 2  # the grammar ended the answer with EOS


@pytest.mark.parametrize("so,check", [
    ({"choice": ["red", "green", "blue \"x\""]}, lambda t: t in ("red", "green", 'blue "x"')),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"grammar": 'start: "up" | "down"'}, lambda t: t in ("up", "down")),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_each_constraint_kind_holds(llm, so, check):
    for o in _gen(llm, PROMPTS, [SamplingParams(max_tokens=48, temperature=1.0, seed=s,
                                                structured_outputs=so) for s in range(3)]):
        if "json_object" in so and o.finish_reason == "length":
            continue  # an object of a random model may outgrow max_tokens
        assert o.finish_reason == "stop" and check(o.text), o.text


def test_a_structural_tags_blocks_follow_their_schema(llm):
    """``structural_tag`` (xgrammar's format, as a JSON string): the answer is one
    ``<b>...</b>`` block whose body follows SCHEMA (free text between triggered blocks is
    tests/server/test_tool_calls.py's strict tools)."""
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<b>", "end": "</b>",
        "content": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}}})
    for o in _gen(llm, PROMPTS, [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                                                structured_outputs={"structural_tag": tag})
                                 for s in range(3)]):
        assert o.finish_reason == "stop", o.text
        body = re.fullmatch(r"(?s)<b>(.*)</b>", o.text)
        assert body is not None and _valid(json.loads(body.group(1))), o.text
    with pytest.raises(ValueError, match="^structured_outputs structural_tag is not valid"):
        SamplingParams(structured_outputs={"structural_tag": "{x"})


def test_a_schema_or_structural_tag_nested_too_deep_is_a_value_error_naming_its_field():
    """Past Python's recursion limit a JSON string's decoding raises RecursionError, and a
    deep object overflows later (pickled to the engine): both are a ValueError naming the
    field, which the server answers as a 400, not a 500."""
    deep = '{"items": ' * 2000 + "{}" + "}" * 2000
    for kind in ("json", "structural_tag"):
        with pytest.raises(ValueError, match="^guided_json .*not valid JSON"):
            StructuredOutputsParams(**{kind: deep}, param="guided_json")
        nested = json.loads('{"items": ' * 200 + "{}" + "}" * 200)
        with pytest.raises(ValueError, match="^guided_json nests deeper than 128"):
            StructuredOutputsParams(**{kind: nested}, param="guided_json")
    StructuredOutputsParams(json=json.loads('{"items": ' * 100 + "{}" + "}" * 100))


def test_vllms_legacy_structural_tag_means_its_triggered_tags(smollm2_tokenizer):
    """vLLM still takes ``{"structures": [{"begin", "schema", "end"}], "triggers"}``: free
    text, each triggered block's body under its schema."""
    from latentserve.structured import Grammars

    grammars = Grammars(smollm2_tokenizer, len(smollm2_tokenizer), {2})
    so = StructuredOutputsParams(structural_tag={
        "structures": [{"begin": "<b>", "schema": SCHEMA, "end": "</b>"}], "triggers": ["<b>"]})
    assert grammars.matcher(so).accept_string(
        'hi <b>{"name": "a", "age": 3, "ok": true}</b> bye')
    assert not grammars.matcher(so).accept_string('hi <b>{"name": 7')


def test_a_schema_or_regex_that_does_not_compile_names_its_field(llm):
    for so, field in (({"json": {"type": "foo"}, "param": "guided_json"}, "guided_json"),
                      ({"regex": "(ab", "param": "guided_regex"}, "guided_regex"),
                      ({"grammar": "root ::= ", "param": "guided_grammar"}, "guided_grammar")):
        with pytest.raises(ValueError, match=f"^{field} "):
            _gen(llm, PROMPTS[:1], SamplingParams(structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()


def test_the_constraint_covers_the_answer_not_the_latent_phase(tmp_path):
    """A COCONUT model thinks its latent steps, then answers inside the grammar; the latent
    phase is the same as without the constraint."""
    from latentserve import LLM
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    llm = LLM(str(save_latent_tiny(tmp_path, "coconut-llama")), max_num_seqs=4)
    base = {"max_tokens": 20, "temperature": 0, "latent_budget": 3}
    free = _gen(llm, PROMPTS[:2], SamplingParams(**base))
    choice = _gen(llm, PROMPTS[:2], SamplingParams(**base,
                                                  structured_outputs={"choice": ["alpha",
                                                                                 "beta"]}))
    for f, c in zip(free, choice):
        assert c.latent_steps == f.latent_steps == 3
        assert c.text in ("alpha", "beta") and c.finish_reason == "stop"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_head_without_closing_ids_masks_the_step_that_ends_its_phase(tmp_path, overlap):
    """A compression head whose thinking has no closing ids (``think_close=""``): the token
    sampled at the latent step that ends the phase is the answer's first, so that row is
    masked (its grammar not yet fed) and biased (``logit_bias``), while CoLaR's latent rows
    are not (test_colar_parity)."""
    import json

    from latentserve import LLM
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.latent.bundle import random_bundle, write_bundle
    from latentserve.latent.head import HEAD_BUNDLE_NAME

    d = save_tiny(tmp_path / "head", "llama", seed=0, num_hidden_layers=3)
    hidden = json.loads((d / "config.json").read_text())["hidden_size"]
    write_bundle(random_bundle(hidden, 16, source_layer=1, seed=7, stop_bias=0.0,
                               injection="closed_loop", think_open=" Let me think.",
                               think_close=""), d / HEAD_BUNDLE_NAME)
    llm = LLM(model=str(d), overlap_schedule=overlap)
    assert llm.engine.latent_spec.end_ids == ()
    allowed = llm.tokenizer.encode(" yes no", add_special_tokens=False)
    base = {"temperature": 0, "max_tokens": 8, "min_output_tokens": 0, "use_stop": False}
    for cap in (1, 3):
        free, masked, choice, biased = _gen(llm, ["hello world"] * 4, [
            SamplingParams(**base, max_latent=cap),
            SamplingParams(**base, max_latent=cap, allowed_token_ids=allowed),
            SamplingParams(**base, max_latent=cap, structured_outputs={"choice": ["yes", "no"]}),
            SamplingParams(**base, max_latent=cap, logit_bias={allowed[1]: 100})])
        assert free.token_ids[0] not in allowed  # else the test shows nothing
        assert masked.latent_steps == choice.latent_steps == biased.latent_steps == cap
        assert biased.token_ids[0] == allowed[1]
        assert set(masked.token_ids) <= set(allowed)
        assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    llm.engine.cache.check_idle()


def test_overlap_scheduling_gives_the_synchronous_outputs(tiny_dirs):
    """Masks under overlap scheduling (engine/overlap.py): static ones are built before the
    previous token is on the host, bad words and grammars after it; every request gets the
    tokens of the synchronous engine, and the steps stay overlapped."""
    from tests.support.overlap_runs import sync_and_overlapped

    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=1,
                             allowed_token_ids=[11, 257, 1000, 4000], min_tokens=12),
              SamplingParams(max_tokens=12, temperature=0, bad_words=["the", " of"]),
              SamplingParams(max_tokens=24, temperature=1.0, seed=2,
                             structured_outputs={"json": SCHEMA}),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                             structured_outputs={"regex": "[a-z]{2,5}( [a-z]{2,5}){0,3}"})]
    prompts = [[1 + i, 50 + i, 700 + i] for i in range(len(params))]
    results = sync_and_overlapped(tiny_dirs["llama"], prompts, params)
    assert results[0] == results[1]


def _run_engine(engine, params, prompts, abort_at=()):
    """``rid -> (tokens, finish_reason)``; ``abort_at``: ``(rid, n)`` pairs, each aborting
    ``rid`` once it has ``n`` tokens."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    out = {f"r{i}": [[], None] for i in range(len(params))}
    aborts = dict(abort_at)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.rid][0].extend(o.new_token_ids)
            if o.finished:
                out[o.rid][1] = o.finish_reason
        for rid, n in list(aborts.items()):
            if len(out[rid][0]) >= n:
                engine.abort_request(rid)
                del aborts[rid]
    engine.cache.check_idle()
    return {rid: tuple(v) for rid, v in out.items()}


@pytest.mark.parametrize("opts", [{}, {"kv_slots": 192}], ids=["roomy", "preemption"])
def test_mixed_masked_batch_overlapped_equals_synchronous(tiny_dirs, opts):
    """Grammars (JSON schema, regex, choice), static masks, bad words and plain requests,
    greedy and seeded, in one batch with aborts mid-way, one mid-grammar (and, with a small
    KV pool, preemptions): the overlapped engine gives every request the tokens and finish
    reason of the synchronous engine (the aborted ones: a prefix)."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    kinds = [{"temperature": 0}, {"temperature": 1.0, "seed": 5},
             {"allowed_token_ids": [11, 257, 1000, 4000], "min_tokens": 8},
             {"bad_words": ["the", " of"]},
             {"structured_outputs": {"json": SCHEMA}},
             {"structured_outputs": {"regex": "[a-z]{2,5}( [a-z]{2,5}){0,5}"}},
             {"structured_outputs": {"choice": ["alpha", "beta gamma"]}},
             {"structured_outputs": {"json": SCHEMA}, "min_tokens": 25}]
    params = [SamplingParams(max_tokens=28, **k, **({} if "temperature" in k else
                                                     {"temperature": 0} if j % 2 else
                                                     {"temperature": 1.0, "seed": j}))
              for j, k in enumerate(kinds)] * 2
    prompts = [[1 + (i * 13 + k) % 900 for k in range(20 + 3 * i)] for i in range(len(params))]
    results = []
    for overlap in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_num_seqs=8,
                                        overlap_schedule=overlap, **opts))
        results.append(_run_engine(engine, params, prompts, abort_at=(("r9", 3), ("r12", 4))))
        if opts:
            assert engine.scheduler.num_preemptions > 0
    want, got = results
    for rid in want:
        if rid in ("r9", "r12"):
            assert got[rid][1] == want[rid][1] == "abort"
            assert want[rid][0][: len(got[rid][0])] == got[rid][0]
        else:
            assert got[rid] == want[rid], rid
    assert {reason for _, reason in want.values()} >= {"stop", "length"}


GVOCAB = 49152  # SmolLM2's
GKINDS = [{"structured_outputs": {"json": SCHEMA}},
          {"structured_outputs": {"regex": "[a-z]{2,5}( [a-z]{2,5}){0,4}"}},
          {"structured_outputs": {"json": SCHEMA}, "min_tokens": 30},
          {"structured_outputs": {"regex": "[a-z ]+"}, "bad_words": ["the"]},
          {"allowed_token_ids": [11, 257, 1000]},
          {}]


def _grammar_reqs(grammars, tok):
    """One request per entry of ``GKINDS`` (``SamplingParams`` fields), at its answer's start."""
    reqs = []
    for i, kw in enumerate(GKINDS):
        params = SamplingParams(max_tokens=64, **kw)
        r = Req(f"r{i}", [1, 2, 3], params)
        r.answer_start = 0
        if params.has_token_mask:
            so = params.structured_outputs
            r.constraint = RequestMask(
                params, GVOCAB, {tok.eos_token_id},
                bad_words_ids(tok, params.bad_words) if params.bad_words else None,
                None if so is None else grammars.matcher(so))
        reqs.append(r)
    return reqs


def _end_check(r, n):
    """``Scheduler._finish_reason``'s feeding of the grammar: the answer's first ``n`` ids."""
    if r.constraint is not None and r.constraint.matcher is not None:
        r.constraint.sync(r.output_ids, 0, n)


@pytest.mark.parametrize("background", [False, True])
def test_rows_from_pending_ids_equal_the_synchronous_rows(smollm2_tokenizer, background):
    """Two copies of a mixed batch (grammars, grammars with ``min_tokens`` and ``bad_words``,
    a static mask, no mask) walk the same random allowed tokens for 40 steps: one with each
    token in ``output_ids`` before the step (``LLMEngine.step``), one with it as a pending
    id whose token is ``known`` and finalized a step later (``engine/overlap.py``), fed and
    filled on the worker thread when ``background``; every step's bitmask is the same."""
    pytest.importorskip("xgrammar")
    from latentserve.scheduler.scheduler import PENDING_ID
    from latentserve.structured import Grammars

    tok = smollm2_tokenizer
    grammars = Grammars(tok, GVOCAB, {tok.eos_token_id})
    want, got = _grammar_reqs(grammars, tok), _grammar_reqs(grammars, tok)
    rng, prev = random.Random(0), None
    for step in range(40):
        known = None if prev is None else {id(r): (step - 1, t) for r, t in zip(got, prev)}
        ref = token_masks.batch_bitmask(want, GVOCAB)
        mine = token_masks.begin_bitmask(got, GVOCAB, known, background=background).result()
        assert ref[0] == mine[0] and torch.equal(ref[1], mine[1]), step
        toks = []
        for b in range(len(want)):
            if b not in ref[0]:
                toks.append(rng.randrange(GVOCAB))
                continue
            i = ref[0].index(b)
            allowed = unpack_bitmask(ref[1][i : i + 1], GVOCAB)[0]
            toks.append(rng.choice(allowed.nonzero().flatten().tolist()))
        for r, t in zip(want, toks):
            r.output_ids.append(t)
            _end_check(r, step + 1)
        for r, t in zip(got, prev or ()):  # finalize the batch before, then advance this one
            r.output_ids[step - 1] = t
            _end_check(r, step)
        for r in got:
            r.output_ids.append(PENDING_ID)
        prev = toks
    assert any(r.constraint.consumed for r in got[:4])


@pytest.mark.parametrize("overlap,worker", [(False, True), (True, True), (True, False)])
def test_grammar_masks_fill_on_the_worker_beside_the_forward(tiny_dirs, monkeypatch, overlap,
                                                             worker):
    """``LLMEngine.begin_token_mask``: a batch with grammar rows has its grammars fed and
    filled before the forward (overlap: when the previous tokens are on the host, always on
    the CPU), on the worker thread where ``grammar_worker`` (CUDA's default; the CPU's is
    the engine's thread); the outputs are those of the engine without it (``token_mask``
    built after the forward); a forward that raises waits for the fill before the error
    leaves the step."""
    import threading
    import time

    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    params = [SamplingParams(max_tokens=16, temperature=t, seed=3,
                             structured_outputs={"json": SCHEMA} if i % 2 else {"regex": "[a-z ]+"})
              for i, t in enumerate([0, 1.0, 0, 1.0])]
    prompts = [[1 + i, 50 + i, 700 + i] for i in range(len(params))]
    eng = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_num_seqs=8,
                                 overlap_schedule=overlap))
    assert not eng.grammar_worker  # on the CPU
    eng.grammar_worker = worker
    threads, in_flight = [], []
    real_fill, real_run = token_masks.PendingBitmask.build, eng.runner.run

    def fill(self, *a, **k):
        threads.append(threading.current_thread().name)
        return real_fill(self, *a, **k)

    def run(*a, **k):
        in_flight.append(len(threads))
        return real_run(*a, **k)

    monkeypatch.setattr(token_masks.PendingBitmask, "build", fill)
    monkeypatch.setattr(eng.runner, "run", run)
    got = _run_engine(eng, params, prompts)
    assert threads and set(threads) == {"latentserve-grammar_0" if worker else "MainThread"}
    assert max(in_flight) > 0  # fills were submitted before a forward began
    monkeypatch.setattr(eng, "begin_token_mask", lambda *a, **k: None)  # built after it
    assert _run_engine(eng, params, prompts) == got
    monkeypatch.undo()

    done = []

    def slow_fill(self, *a, **k):
        time.sleep(0.3)
        real_fill(self, *a, **k)
        done.append(True)

    def broken_run(*a, **k):
        raise RuntimeError("forward failed")

    eng.add_request("x", prompts[1], params[1])
    eng.step()  # the prompt; its first token is being sampled (overlap) or sampled
    monkeypatch.setattr(token_masks.PendingBitmask, "build", slow_fill)
    monkeypatch.setattr(eng.runner, "run", broken_run)
    with pytest.raises(RuntimeError, match="forward failed"):
        eng.step()
    assert done == [True]  # the fill ended before the error left the step


def test_a_mask_begun_for_other_rows_is_waited_for_and_built_anew(llm, smollm2_tokenizer):
    """``LLMEngine.token_mask`` given a ``begin_token_mask`` of another row list (a family
    changed the sampled rows): the rows of a fresh ``batch_bitmask``."""
    pytest.importorskip("xgrammar")
    from latentserve.structured import Grammars

    tok = smollm2_tokenizer
    grammars = Grammars(tok, GVOCAB, {tok.eos_token_id})
    want, got = _grammar_reqs(grammars, tok), _grammar_reqs(grammars, tok)
    engine = llm.engine
    begun = engine.begin_token_mask(got)
    mask = engine.token_mask(got[1:], "cpu", begun=begun)
    rows, bits = token_masks.batch_bitmask(want[1:], GVOCAB)
    assert mask.rows == rows and torch.equal(mask.bits, bits)


def test_static_key_changes_only_with_what_a_static_mask_reads():
    allowed = SamplingParams(allowed_token_ids=[3, 4], min_tokens=2, max_tokens=8)
    reqs = [_req(SamplingParams()), _req(allowed, [9])]
    reqs[1].constraint = RequestMask(allowed, VOCAB, {2})
    reqs[1].answer_start = 0
    key = token_masks.static_key(reqs)
    assert key == token_masks.static_key(reqs)
    reqs[1].output_ids.append(5)  # min_tokens reached: EOS no longer masked
    assert token_masks.static_key(reqs) != key
    other = RequestMask(allowed, VOCAB, {2})  # another request's mask, same content
    reqs[1].constraint = other
    assert token_masks.static_key(reqs) != key
    reqs[1].constraint = RequestMask(SamplingParams(bad_words=["x"]), VOCAB, {2},
                                     bad_words=[[7]])
    assert token_masks.static_key(reqs) is None  # reads the answer's tokens


def test_unchanged_static_masks_are_reused_with_the_same_tokens(llm, monkeypatch):
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True,
                             allowed_token_ids=[11, 257, 1000, 4000, 2], min_tokens=6)
              for i in range(3)]
    fills = []
    real = token_masks.batch_bitmask
    monkeypatch.setattr(token_masks, "batch_bitmask",
                        lambda *a, **k: fills.append(1) or real(*a, **k))
    reused = [o.token_ids for o in _gen(llm, PROMPTS, params)]
    n_reused = len(fills)
    monkeypatch.setattr(token_masks, "static_key", lambda reqs: None)
    fills.clear()
    assert [o.token_ids for o in _gen(llm, PROMPTS, params)] == reused
    assert n_reused < len(fills)


def test_a_grammar_this_tokenizer_cannot_write_is_refused(tmp_path):
    """A word-level tokenizer (``w<N>`` words, no byte fallback) cannot write "yes": the
    grammar's first mask allows no token, so the request is refused naming the field, not
    decoded without its constraint."""
    from latentserve import LLM
    from latentserve.bench.baseline.tiny_models import save_tiny

    llm = LLM(str(save_tiny(tmp_path / "words", "llama", word_tokenizer=True,
                            vocab_size=1024)))
    with pytest.raises(ValueError, match="^guided_choice allows no token"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs={
            "choice": ["yes", "no"], "param": "guided_choice"}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
