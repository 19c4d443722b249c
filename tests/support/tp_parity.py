"""Tensor-parallel parity helpers shared by the CPU and GPU tests: run one engine over a list
of requests recording every sampled logits row, and compare a TP run with a TP=1 run."""

from __future__ import annotations

import torch


def run_requests(engine, requests):
    """Queue ``[(prompt ids, SamplingParams)]`` at once and step to completion.

    Returns per request ``(tokens, [logits [vocab] float32 CPU, one per sampled step],
    final StepOutput)``; checks afterwards that no KV slot leaked (``check_idle``). In
    overlap mode (``engine/overlap.py``) a request that finished was already in the next
    launched batch; that discarded row's logits (sampled past its last output id) are
    dropped, so both modes record the same steps (latent steps included); so are a row
    computed after a latent step that was undone (a compression head's stop, learned a step
    later: its ids then are not a prefix of the final ones).
    """
    runner, logits, reqs = engine.runner, {}, {}
    original = runner.run

    def recording(batch, *args, **kwargs):
        out, hidden = original(batch, *args, **kwargs)
        for req, row in zip([r for r, s in zip(batch.reqs, batch.sample) if s], out):
            reqs[req.rid] = req
            # a copy: on the CPU .cpu() is the row itself, a graph's static buffer if replayed
            row = row.float().cpu().clone()
            logits.setdefault(req.rid, []).append((list(req.output_ids), row))
        return out, hidden

    runner.run = recording
    try:
        rids = [f"t{engine._arrivals + i}" for i in range(len(requests))]
        for rid, (prompt, params) in zip(rids, requests):
            engine.add_request(rid, prompt, params)
        toks, final = {r: [] for r in rids}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.rid] += o.new_token_ids
                if o.finished:
                    final[o.rid] = o
    finally:
        runner.run = original
    engine.cache.check_idle()
    for r in rids:  # a row sampled after ids that start the final ones; the rest discarded
        out = reqs[r].output_ids
        logits[r] = [row for ids, row in logits[r] if len(ids) < len(out) and all(
            a in (b, -1) for a, b in zip(ids, out))]  # -1: an id pending in overlap mode
    return [(toks[r], logits[r], final[r]) for r in rids]


def run_streams(engine, requests):
    """``(run_requests(engine, requests), streams)``: ``streams`` holds per request every
    ``StepOutput`` in order, as ``(new ids, finished, finish reason, latent_steps,
    latent_trace, latent_stats)`` (streamed latent steps included)."""
    streams, step = {}, engine.step

    def recording():
        outs = step()
        for o in outs:
            streams.setdefault(o.rid, []).append(
                (o.new_token_ids, o.finished, o.finish_reason, o.latent_steps, o.latent_trace,
                 o.latent_stats))
        return outs

    rids = [f"t{engine._arrivals + i}" for i in range(len(requests))]
    engine.step = recording
    try:
        results = run_requests(engine, requests)
    finally:
        engine.step = step
    return results, [streams[r] for r in rids]


def assert_same_streams(reference, other, atol: float = 1e-4) -> None:
    """``run_streams`` results with the same outputs (``assert_same_outputs``), output for
    output (float values within 1e-5), and every sampled step's logits within ``atol``."""
    (wr, ws), (gr, gs) = reference, other
    assert_same_outputs(wr, gr)
    assert_same(wr, gr, atol)
    for i, (a, b) in enumerate(zip(ws, gs)):
        assert close(b, a), f"request {i}: outputs {b} != {a}"


def spy_overlapped(engine) -> list[bool]:
    """Record, per forward of ``engine``, whether it read pending ids from the previous
    forward (overlap mode); returns the list it appends to."""
    seen, original = [], engine.runner.run

    def spy(batch, pending=None):
        seen.append(pending is not None)
        return original(batch, pending)

    engine.runner.run = spy
    return seen


def close(a, b, atol: float = 1e-5) -> bool:
    """Whether ``a`` and ``b`` (nested lists, dicts, tuples and scalars, e.g. latent traces)
    are equal but for float values within ``atol``."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= atol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], atol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, type(a)):
        return len(a) == len(b) and all(close(x, y, atol) for x, y in zip(a, b))
    return a == b


def assert_same_outputs(reference, other, atol: float = 1e-5) -> None:
    """``run_requests`` results with equal tokens, finish reasons and ``recurrence`` stats,
    and latent traces equal but for float values within ``atol`` (another batch shape
    changes the last bits)."""
    for i, ((wt, _, wf), (gt, _, gf)) in enumerate(zip(reference, other)):
        assert gt == wt, f"request {i}: tokens"
        assert gf.finish_reason == wf.finish_reason, f"request {i}: finish reason"
        assert gf.recurrence == wf.recurrence, f"request {i}: iterations per token"
        assert close(gf.latent_trace, wf.latent_trace, atol), f"request {i}: trace"


def assert_same(reference, other, atol: float = 1e-4) -> None:
    """Greedy tokens equal and every sampled step's logits within ``atol`` (fp32 runs)."""
    for i, ((t1, l1, _), (t2, l2, _)) in enumerate(zip(reference, other)):
        assert t2 == t1, f"request {i}: {t2} != reference {t1}"
        assert len(l2) == len(l1), f"request {i}: {len(l2)} sampled steps != {len(l1)}"
        for step, (a, b) in enumerate(zip(l1, l2)):
            torch.testing.assert_close(b, a, atol=atol, rtol=0, msg=f"request {i} step {step}")


def assert_close_bf16(ref32, ref16, other16) -> None:
    """bf16 tolerance (as ``tests/gpu/test_cuda_parity.py``): against the fp32 reference's
    first sampled logits, ``other16`` may be off by at most twice ``ref16``'s own error plus
    0.25, and its first greedy token must equal the reference's unless the reference's
    margin between the two tokens is within that bound (a near tie). Later tokens may
    diverge legitimately (bf16 sums in another order)."""
    for i, ((t32, l32, _), (_, l16, _), (t, lo, _)) in enumerate(zip(ref32, ref16, other16)):
        bound = 2 * float((l16[0] - l32[0]).abs().max()) + 0.25
        err = float((lo[0] - l32[0]).abs().max())
        assert err <= bound, f"request {i}: error {err:.3f} > {bound:.3f}"
        margin = float(l32[0][t32[0]] - l32[0][t[0]])
        assert margin <= bound, f"request {i}: first token {t[0]} vs reference {t32[0]}"


def mixed_head_requests(**over) -> list:
    """``[(prompt ids, SamplingParams)]``: eight requests over ``shared_prefix_prompts`` for a
    compression-head model (``tests.support.head_models``), greedy and seeded: caps 0 to 10,
    ``min_latent``, stop thresholds, ``use_stop`` off, thinking off, the answer-budget floor,
    an output budget spent inside the latent phase, traces and streamed latent steps
    (ignore_eos); ``over`` overrides fields of every request."""
    from latentserve.sampling_params import SamplingParams
    from tests.support.parity import shared_prefix_prompts

    kinds = [
        {"temperature": 0.0, "max_latent": 6, "min_latent": 1, "stop_threshold": 0.62,
         "max_tokens": 16},
        {"temperature": 0.8, "seed": 3, "max_latent": 4, "use_stop": False, "max_tokens": 12,
         "return_latent_trace": True, "stream_latent_steps": True},
        {"temperature": 0.0, "max_latent": 8, "min_latent": 0, "stop_threshold": 0.5,
         "max_tokens": 18, "return_latent_trace": True},
        {"temperature": 0.7, "top_k": 20, "seed": 11, "thinking": False, "max_tokens": 5},
        {"temperature": 0.0, "max_latent": 3, "min_output_tokens": 6, "max_tokens": 2,
         "use_stop": False},
        {"temperature": 0.9, "seed": 5, "max_latent": 10, "min_latent": 2,
         "stop_threshold": 0.64, "max_tokens": 20, "stream_latent_steps": True,
         "return_latent_trace": True},
        {"temperature": 0.0, "max_latent": 0, "max_tokens": 6},
        {"temperature": 0.0, "max_latent": 8, "use_stop": False, "max_tokens": 4},
    ]
    return [(p, SamplingParams(**{"ignore_eos": True, "min_output_tokens": 0,
                                  **kinds[i % len(kinds)], **over}))
            for i, p in enumerate(shared_prefix_prompts())]


def mixed_colar_requests(**over) -> list:
    """``[(prompt ids, SamplingParams)]``: eight requests for a tiny CoLaR model
    (``tests.support.colar_models``, vocabulary 1024), greedy and seeded, latent temperature
    0 and above (seeded), caps 0 to 12, ``min_latent``, ``use_stop`` off, thinking off,
    compression factors, traces and streamed latent steps (ignore_eos, 3 to 6 answer
    tokens); ``over`` overrides fields of every request."""
    from latentserve.sampling_params import SamplingParams
    from tests.support.parity import shared_prefix_prompts

    kinds = [
        {"temperature": 0.0, "max_latent": 12, "max_tokens": 4},
        {"temperature": 0.8, "seed": 3, "max_latent": 6, "latent_temperature": 1.0,
         "max_tokens": 5, "return_latent_trace": True, "stream_latent_steps": True},
        {"temperature": 0.0, "max_latent": 12, "min_latent": 3, "compression_factor": 3,
         "max_tokens": 6, "return_latent_trace": True},
        {"temperature": 0.7, "top_k": 20, "seed": 11, "thinking": False, "max_tokens": 5},
        {"temperature": 0.0, "max_latent": 5, "use_stop": False, "max_tokens": 3},
        {"temperature": 0.9, "seed": 5, "max_latent": 10, "latent_temperature": 0.5,
         "compression_factor": 1, "max_tokens": 4, "stream_latent_steps": True},
        {"temperature": 0.0, "max_latent": 0, "max_tokens": 4},
        {"temperature": 0.0, "max_latent": 12, "compression_factor": 5, "max_tokens": 6},
    ]
    return [([t % 900 + 30 for t in p], SamplingParams(**{"ignore_eos": True,
                                                          **kinds[i % len(kinds)], **over}))
            for i, p in enumerate(shared_prefix_prompts())]


def mixed_feedback_requests(**over) -> list:
    """``[(prompt ids, SamplingParams)]``: eight requests over ``shared_prefix_prompts`` for a
    feedback model, greedy and seeded, latent budgets 0, 1, 3, 6 and the model's default,
    traces and streamed latent steps (ignore_eos, 4 to 7 answer tokens); ``over`` overrides
    fields of every request."""
    from latentserve.sampling_params import SamplingParams
    from tests.support.parity import shared_prefix_prompts

    kinds = [
        {"temperature": 0.0, "latent_budget": 3, "max_tokens": 6},
        {"temperature": 0.8, "seed": 3, "latent_budget": 0, "max_tokens": 5,
         "return_latent_trace": True},
        {"temperature": 0.0, "latent_budget": 6, "max_tokens": 7, "stream_latent_steps": True,
         "return_latent_trace": True},
        {"temperature": 0.7, "top_k": 20, "seed": 11, "latent_budget": 1, "max_tokens": 4},
        {"temperature": 0.0, "max_tokens": 5},
    ]
    return [(p, SamplingParams(**{"ignore_eos": True, **kinds[i % len(kinds)], **over}))
            for i, p in enumerate(shared_prefix_prompts())]


def abort_in_phase_and_answer(engine, requests, warm_steps: int):
    """Add ``requests`` (``[(prompt, SamplingParams)]``) as ``a0``, ``a1``, ...; after
    ``warm_steps`` overlapped steps abort ``a0`` (still in its latent phase) and ``a1`` (in
    its answer), then step until idle. Returns ``(tokens per rid, final output per rid)``."""
    for i, (p, s) in enumerate(requests):
        engine.add_request(f"a{i}", p, s)
    toks: dict[str, list] = {f"a{i}": [] for i in range(len(requests))}
    finals = {}

    def step():
        for o in engine.step():
            toks[o.rid] += o.new_token_ids
            if o.finished:
                finals[o.rid] = o

    for _ in range(warm_steps):
        step()
    assert engine.inflight is not None
    req = {r.rid: r for r in engine.scheduler.running}
    assert req["a0"].answer_start is None and req["a1"].answer_start is not None
    engine.abort_request("a0")
    engine.abort_request("a1")
    while engine.has_unfinished_requests():
        step()
    return toks, finals


def fail_forward_after_preemption(engine) -> tuple[dict, dict]:
    """Two greedy requests that outgrow ``kv_slots``; the first forward after a preemption
    raises (as a device error would), and the running requests are then aborted, as the
    engine process does (``engine_process._fail_running``). Returns ``(tokens per rid,
    finish reason per rid)``; checks that no KV slot leaked."""
    from latentserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8, 9], sp)
    engine.add_request("b", [10, 11, 12, 13, 14], sp)
    original, failed = engine.runner.run, []

    def run(batch, *args):
        if engine.scheduler.num_preemptions and not failed:
            failed.append(True)
            raise RuntimeError("injected forward failure")
        return original(batch, *args)

    engine.runner.run = run
    toks: dict[str, list] = {"a": [], "b": []}
    finals = {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError:
            for req in list(engine.scheduler.running):
                engine.abort_request(req.rid)
            continue
        for o in outs:
            toks[o.rid] += o.new_token_ids
            if o.finished:
                finals[o.rid] = o.finish_reason
    assert failed
    engine.cache.check_idle()
    return toks, finals
