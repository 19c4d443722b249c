"""Host time of one batch of grammar masks, parts apart (no GPU needed): 64 requests under
``scripts/bench_structured_gpu.py``'s JSON schema, each a random walk of allowed tokens, on
SmolLM2's tokenizer. Per step (median us over 40 steps): the whole
``token_masks.begin_bitmask`` on the calling thread; xgrammar's batched accept alone; its
batch fill alone at 1, 2, 4, 8 and 16 threads; and whether a fill or an accept running on
another thread lets this thread run Python meanwhile (the GIL released). Writes
``OUT/probe_grammar_host.json``::

    OUT=dir python scripts/probe_grammar_host.py --tokenizer DIR
"""

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

pc = time.perf_counter


def _repeat(work, stop) -> None:
    while not stop.is_set():
        work()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    import torch
    import xgrammar
    from transformers import AutoTokenizer

    from latentserve import token_masks
    from latentserve.core import Req
    from latentserve.sampling import unpack_bitmask
    from latentserve.sampling_params import SamplingParams
    from latentserve.structured import Grammars
    from latentserve.token_masks import RequestMask

    spec = __import__("importlib.util").util
    m = spec.spec_from_file_location("bsg", Path(__file__).with_name("bench_structured_gpu.py"))
    bsg = spec.module_from_spec(m)
    m.loader.exec_module(bsg)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = 49152
    grammars = Grammars(tok, vocab, {tok.eos_token_id})
    params = SamplingParams(max_tokens=256, structured_outputs={"json": bsg.SCHEMA})
    reqs = []
    for i in range(args.rows):
        r = Req(f"r{i}", [1, 2, 3], params)
        r.answer_start = 0
        r.constraint = RequestMask(params, vocab, {tok.eos_token_id}, None,
                                   grammars.matcher(params.structured_outputs))
        reqs.append(r)
    rng = random.Random(0)
    bits = torch.empty(args.rows, token_masks.bitmask_width(vocab), dtype=torch.int32)
    res: dict = {"rows": args.rows, "cpus": os.cpu_count()}
    whole, accepts = [], []
    cpus = len(os.sched_getaffinity(0))
    batchers = {t: xgrammar.BatchGrammarMatcher(t) for t in (1, 2, 4, 8, 16) if t <= cpus}
    fills: dict[int, list] = {t: [] for t in batchers}
    for _ in range(40):
        t0 = pc()
        rows, b = token_masks.begin_bitmask(reqs, vocab, None, bits).result()
        whole.append(pc() - t0)
        ms = [r.constraint.matcher for r in reqs if r.constraint.grammar_on]
        for t, batcher in batchers.items():
            t0 = pc()
            batcher.batch_fill_next_token_bitmask(ms, bits)
            fills[t].append(pc() - t0)
        rows, b = token_masks.batch_bitmask(reqs, vocab, None, bits)  # the walk's mask
        toks = []
        allowed_all = unpack_bitmask(b, vocab)
        allowed_all[:, tok.eos_token_id] = False  # the walk stays inside the JSON
        for i in range(len(reqs)):
            allowed = allowed_all[i].nonzero().flatten().tolist()
            toks.append(rng.choice(allowed) if allowed else tok.eos_token_id)
        live = [(r, t) for r, t in zip(reqs, toks) if r.constraint.grammar_on]
        t0 = pc()
        ok = xgrammar.BatchGrammarMatcher.batch_accept_token(
            [r.constraint.matcher for r, _ in live], [t for _, t in live])
        accepts.append(pc() - t0)
        xgrammar.BatchGrammarMatcher.batch_rollback([r.constraint.matcher for r, _ in live],
                                                    [1 if a else 0 for a in ok])
        for r, t in zip(reqs, toks):
            r.output_ids.append(t)
    med = lambda xs: round(statistics.median(xs[8:]) * 1e6, 1)  # noqa: E731
    res["begin_bitmask_inline_us"] = med(whole)
    res["batch_accept_us"] = med(accepts)
    res["batch_fill_us_by_threads"] = {t: med(v) for t, v in fills.items()}
    res["live_rows_end"] = sum(r.constraint.grammar_on for r in reqs)
    # the GIL: Python on this thread while another thread fills or accepts
    ms = [r.constraint.matcher for r in reqs if r.constraint.grammar_on]
    batcher = batchers[max(batchers)]

    def spin(sec):
        n, t0 = 0, pc()
        while pc() - t0 < sec:
            n += 1
        return n

    rows, b = token_masks.batch_bitmask(reqs, vocab, None, bits)
    live = [r for r in reqs if r.constraint.grammar_on]
    one = [unpack_bitmask(b[rows.index(reqs.index(r)):][:1], vocab)[0].nonzero()[-1].item()
           for r in live]

    def accept_and_undo():
        lm = [r.constraint.matcher for r in live]
        ok = xgrammar.BatchGrammarMatcher.batch_accept_token(lm, one)
        xgrammar.BatchGrammarMatcher.batch_rollback(lm, [1 if a else 0 for a in ok])

    for name, work in (("fill", lambda: batcher.batch_fill_next_token_bitmask(ms, bits)),
                       ("accept", accept_and_undo)):
        alone = spin(0.3)
        stop = threading.Event()
        th = threading.Thread(target=_repeat, args=(work, stop))
        th.start()
        busy = spin(0.3)
        stop.set()
        th.join()
        res[f"python_beside_{name}"] = round(busy / alone, 3)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(exist_ok=True)
    (out / "probe_grammar_host.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
