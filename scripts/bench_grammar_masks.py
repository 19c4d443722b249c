"""Token-mask cost of llguidance and xgrammar on CPU for a JSON schema with SmolLM2's tokenizer.

For each library: compile the schema (once, as a request's grammar), then walk a valid JSON
instance token by token, timing each step's mask (``[1, ceil(vocab / 32)] int32`` bitmask)
and the consumption of the token. Prints one JSON line per library; docs/server.md quotes it.

    python scripts/bench_grammar_masks.py [--repeats 20]
"""

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
            "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
            "active": True}


def bench_llguidance(tok, ids, repeats):
    import llguidance
    import llguidance.hf
    import torch
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    tok_s = time.perf_counter() - t0
    compile_s, mask_us = [], []
    bitmask = allocate_token_bitmask(1, len(tok))
    for _ in range(repeats):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for t in ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, bitmask)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            allowed = bool((bitmask[0, t // 32] >> (t % 32)) & 1)
            assert allowed, (t, tok.decode([t]))
            assert m.consume_token(t), m.get_error()
    del torch
    return tok_s, compile_s, mask_us


def bench_xgrammar(tok, ids, repeats):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    compile_s, mask_us = [], []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                               separators=(",", ":"))
        m = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            allowed = bool((bitmask[0, t // 32] >> (t % 32)) & 1)
            assert allowed, (t, tok.decode([t]))
            assert m.accept_token(t)
    return tok_s, compile_s, mask_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    text = json.dumps(INSTANCE, separators=(",", ":"))
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        tok_s, compile_s, mask_us = fn(tok, ids, args.repeats)
        mask_us.sort()
        print(json.dumps({
            "library": name, "tokens_per_walk": len(ids), "walks": args.repeats,
            "tokenizer_setup_s": round(tok_s, 3),
            "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
            "compile_ms_first": round(compile_s[0] * 1e3, 2),
            "mask_us_median": round(statistics.median(mask_us), 1),
            "mask_us_mean": round(statistics.mean(mask_us), 1),
            "mask_us_p99": round(mask_us[int(0.99 * (len(mask_us) - 1))], 1),
            "mask_us_max": round(mask_us[-1], 1)}))
    bench_batch(tok, ids, args.batch)


def bench_batch(tok, ids, batch=64):
    """Per decode step, the masks of ``batch`` requests (each at the same point of the walk),
    filled one by one and with the library's batched (threaded) call; microseconds per step."""
    import llguidance
    import llguidance.hf
    import xgrammar as xgr
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

    out = {}
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    ms = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    ms2 = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]  # batched walk
    ex = llguidance.LLExecutor()
    bm = allocate_token_bitmask(batch, len(tok))
    seq, par = [], []
    for t in ids:
        t0 = time.perf_counter()
        for i, m in enumerate(ms):
            m.unsafe_compute_mask_ptr(bm[i].data_ptr(), bm.shape[1] * 4)
        seq.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms2)], bm)
        par.append(time.perf_counter() - t0)
        for m in ms + ms2:
            m.consume_token(t)
    out["llguidance"] = (seq, par)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    ms = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    ms2 = [xgr.GrammarMatcher(compiled) for _ in range(batch)]  # batched walk
    bm = xgr.allocate_token_bitmask(batch, info.vocab_size)
    bgm = xgr.BatchGrammarMatcher()
    seq, par = [], []
    for t in ids:
        t0 = time.perf_counter()
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bm, i)
        seq.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bgm.batch_fill_next_token_bitmask(ms2, bm)
        par.append(time.perf_counter() - t0)
        for m in ms + ms2:
            m.accept_token(t)
    out["xgrammar"] = (seq, par)
    for name, (seq, par) in out.items():
        print(json.dumps({"library": name, "batch": batch,
                          "step_us_one_by_one_median": round(statistics.median(seq) * 1e6, 1),
                          "step_us_one_by_one_mean": round(statistics.mean(seq) * 1e6, 1),
                          "step_us_batched_median": round(statistics.median(par) * 1e6, 1),
                          "step_us_batched_mean": round(statistics.mean(par) * 1e6, 1)}))


if __name__ == "__main__":
    main()
