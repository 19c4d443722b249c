"""Recurrent depth (Huginn, Ouro) against the eager per-request references written from the
upstream algorithms (``latentserve.bench.baseline.recurrent_reference``), on tiny random checkpoints
in the upstream formats: greedy tokens equal, every sampled step's logits within 1e-4 (fp32),
iterations per token equal, in batches that mix depths and exit rules, with the prefix cache
cold and warm; early exit lowers the iterations run in the forward; free + cached slots ==
total after every run. ``return_latent_trace``: each generated token's depth (Huginn,
adaptive exit) and readout step (Ouro) equal the reference's, in batches that mix traced and
untraced requests (those get no trace)."""

import pytest
import torch

from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
from latentserve.config import EngineConfig
from latentserve.latent.recurrent import RecurrentBatch
from latentserve.sampling_params import SamplingParams
from tests.support.recurrent_reference import HuginnReference, OuroReference
from tests.support.recurrent_requests import HUGINN_EXITS
from tests.support.recurrent_requests import RECURRENT_PROMPTS as PROMPTS

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")
    return {"huginn": write_huginn(root / "huginn"), "ouro": write_ouro(root / "ouro")}


@pytest.fixture(scope="module")
def engines(dirs):
    from latentserve.engine.llm_engine import LLMEngine

    return {k: LLMEngine(EngineConfig(model=str(d), kv_slots=4096, max_model_len=256))
            for k, d in dirs.items()}


@pytest.fixture(scope="module")
def refs(dirs):
    return {"huginn": HuginnReference(dirs["huginn"]), "ouro": OuroReference(dirs["ouro"])}


def run(engine, params, traces=None):
    """Run one request per (PROMPTS[i], params[i]) to completion, all queued at once.
    Returns per request ``(tokens, [logits per sampled step], iterations, cached)``; a
    ``traces`` list gets each request's final ``latent_trace``, in order."""
    runner, logits = engine.runner, {}
    original = runner.run

    def recording(batch):
        out, hidden = original(batch)
        for req, row in zip([r for r, s in zip(batch.reqs, batch.sample) if s], out):
            logits.setdefault(req.rid, []).append(row.float().clone())
        return out, hidden

    runner.run = recording
    try:
        rids = [f"r{engine._arrivals + i}" for i in range(len(params))]
        for rid, prompt, sp in zip(rids, PROMPTS, params):
            engine.add_request(rid, prompt, sp)
        toks, iters, cached, trace = {r: [] for r in rids}, {}, {}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.rid] += o.new_token_ids
                cached[o.rid] = o.num_cached_tokens
                if o.finished:
                    hist = o.recurrence["histogram"]
                    iters[o.rid] = hist
                    trace[o.rid] = o.latent_trace
    finally:
        runner.run = original
    engine.cache.check_idle()
    if traces is not None:
        traces.extend(trace[r] for r in rids)
    return [(toks[r], logits[r], iters[r], cached[r]) for r in rids]


def sp(**kw):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def hist(iters):
    out = {}
    for n in iters:
        out[n] = out.get(n, 0) + 1
    return dict(sorted(out.items()))


def check(results, references):
    for i, ((toks, logits, iters, _), ref) in enumerate(zip(results, references)):
        assert toks == ref["tokens"], f"request {i}: engine {toks} != reference {ref['tokens']}"
        for step, (a, b) in enumerate(zip(logits, ref["logits"])):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"request {i} step {step}")
        assert iters == hist(ref["iterations"]), f"request {i} iterations"


HUGINN_DEPTHS = [1, 2, 4, 8, 3, 4]


def test_huginn_mixed_depths_cold_and_warm(engines, refs):
    engine = engines["huginn"]
    engine.cache.radix.reset()
    params = [sp(latent_budget=d) for d in HUGINN_DEPTHS]
    expected = [refs["huginn"].generate(p, MAX_TOKENS, d) for p, d in zip(PROMPTS, HUGINN_DEPTHS)]
    check(run(engine, params), expected)
    before = engine.runner.num_computed_tokens
    warm = run(engine, params)
    check(warm, expected)
    assert all(c == len(p) - 1 for (*_, c), p in zip(warm, PROMPTS)), \
        "warm: every prompt but its last token comes from the cache"
    assert engine.runner.num_computed_tokens - before == len(PROMPTS) * MAX_TOKENS
    # The same prompt at another depth has other KV: it must not hit those entries.
    other = run(engine, [sp(latent_budget=5)])
    assert other[0][3] == 0
    check(other, [refs["huginn"].generate(PROMPTS[0], MAX_TOKENS, 5)])


def test_huginn_early_exit_matches_reference_and_saves_iterations(engines, refs):
    engine = engines["huginn"]
    model = engine.runner.model
    engine.cache.radix.reset()
    params = [sp(latent_budget=d, exit_criterion=c, exit_threshold=t, exit_min_steps=m,
                 exit_check_every=e) for d, c, t, m, e in HUGINN_EXITS]
    expected = [refs["huginn"].generate(p, MAX_TOKENS, d, c, t, m, e)
                for p, (d, c, t, m, e) in zip(PROMPTS, HUGINN_EXITS)]
    before = model.num_iterations
    cold = run(engine, params)
    with_exit = model.num_iterations - before
    check(cold, expected)
    # Every criterion exits early somewhere, and the forward ran fewer iterations than the
    # same requests without exit (all tokens at full depth).
    for (d, *_), (_, _, iters, _) in zip(HUGINN_EXITS, cold):
        assert min(iters) < d, f"no early exit with depth {d}: {iters}"
    full = sum(len(p) * d + (MAX_TOKENS - 1) * d for p, (d, *_) in zip(PROMPTS, HUGINN_EXITS))
    assert with_exit < full
    saved = sum((d - n) * c for (d, *_), (_, _, it, _) in zip(HUGINN_EXITS, cold)
                for n, c in it.items())
    assert with_exit == full - saved  # exactly the iterations the exits skipped
    check(run(engine, params), expected)  # warm: prompts and generated tokens from cache


def test_huginn_exit_with_chunked_prefill_and_preemption(dirs, refs):
    from latentserve.engine.llm_engine import LLMEngine

    # 6 prompts of up to 33 tokens + 8 outputs cannot all fit in 64 slots; no prefix cache,
    # so preempted requests recompute their generated tokens (one per step, exit included).
    engine = LLMEngine(EngineConfig(model=str(dirs["huginn"]), kv_slots=64, max_model_len=256,
                                    max_num_batched_tokens=16, enable_prefix_caching=False))
    params = [sp(latent_budget=d, exit_criterion=c, exit_threshold=t, exit_min_steps=m,
                 exit_check_every=e) for d, c, t, m, e in HUGINN_EXITS]
    expected = [refs["huginn"].generate(p, MAX_TOKENS, d, c, t, m, e)
                for p, (d, c, t, m, e) in zip(PROMPTS, HUGINN_EXITS)]
    results = run(engine, params)
    assert engine.scheduler.num_preemptions > 0
    for (toks, *_), ref in zip(results, expected):
        assert toks == ref["tokens"]
    assert engine.cache.num_free == engine.num_kv_slots


OURO_CASES = [  # (depth, criterion, threshold); None = the config default (threshold 1.0)
    (4, None, None), (2, "threshold", 0.6), (6, "weighted", None), (3, "last", None),
    (6, "threshold-approx", 0.6), (4, "threshold", 0.8),
]


def _ouro_expected(refs):
    mode = {None: "threshold"}
    return [refs["ouro"].generate(p, MAX_TOKENS, d, mode.get(c, c), 1.0 if t is None else t)
            for p, (d, c, t) in zip(PROMPTS, OURO_CASES)]


def test_ouro_readout_modes_cold_and_warm(engines, refs):
    engine = engines["ouro"]
    model = engine.runner.model
    engine.cache.radix.reset()
    params = [sp(latent_budget=d, exit_criterion=c, exit_threshold=t) for d, c, t in OURO_CASES]
    expected = _ouro_expected(refs)
    # The readouts are not all the same thing: threshold 0.6 picks another step than "last".
    assert refs["ouro"].generate(PROMPTS[1], MAX_TOKENS, 2, "last")["tokens"] != \
        expected[1]["tokens"]
    before = model.num_iterations
    cold = run(engine, params)
    check(cold, expected)
    full = sum((len(p) + MAX_TOKENS - 1) * d for p, (d, _, _) in zip(PROMPTS, OURO_CASES))
    assert model.num_iterations - before < full  # threshold-approx stopped some tokens
    assert min(cold[4][2]) < 6
    warm = run(engine, params)
    check(warm, expected)
    assert all(c > 0 for *_, c in warm)


def check_traces(traces, params, references, family):
    """Traced requests: one entry per generated token, its depth the reference's iterations
    and (Ouro) its readout step the reference's; untraced ones: no trace at all."""
    for i, (trace, p, ref) in enumerate(zip(traces, params, references)):
        if not p.return_latent_trace:
            assert trace is None, f"request {i} did not ask for a trace"
            continue
        assert [e["depth"] for e in trace] == ref["iterations"], f"request {i} depths"
        if family == "ouro":
            assert [e["readout_step"] for e in trace] == ref["readouts"], f"request {i}"
            check_exit_probs(trace, ref, f"request {i}")
        else:  # Huginn reads out its last iteration: no readout field
            assert all(set(e) == {"depth"} for e in trace), trace


def check_exit_probs(trace, ref, what):
    """Each Ouro entry's ``exit_probs``: one per step the token ran, summing to 1, within
    1e-4 of the reference's exit pdf."""
    for j, (e, want) in enumerate(zip(trace, ref["exit_probs"], strict=True)):
        got = e["exit_probs"]
        assert len(got) == len(want) == e["depth"], f"{what}, token {j}: {got} vs {want}"
        assert all(isinstance(p, float) and 0 <= p <= 1 for p in got)
        assert abs(sum(got) - 1) < 1e-9
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, f"{what}, token {j}"


def test_huginn_trace_has_each_tokens_adaptive_depth(engines, refs):
    engine = engines["huginn"]
    engine.cache.radix.reset()
    params = [sp(latent_budget=d, exit_criterion=c, exit_threshold=t, exit_min_steps=m,
                 exit_check_every=e, return_latent_trace=i != 2)
              for i, (d, c, t, m, e) in enumerate(HUGINN_EXITS)]
    params[3] = sp(latent_budget=3, return_latent_trace=True)  # no exit rule: fixed depth
    expected = [refs["huginn"].generate(p, MAX_TOKENS, d, c, t, m, e)
                for p, (d, c, t, m, e) in zip(PROMPTS, HUGINN_EXITS)]
    expected[3] = refs["huginn"].generate(PROMPTS[3], MAX_TOKENS, 3)
    traces = []
    check(run(engine, params, traces), expected)
    check_traces(traces, params, expected, "huginn")
    depths = [e["depth"] for e in traces[0]]
    assert min(depths) < 8 and len(set(depths)) > 1, f"adaptive depths expected: {depths}"
    assert [e["depth"] for e in traces[3]] == [3] * MAX_TOKENS


def test_ouro_trace_has_each_tokens_readout_step(engines, refs):
    engine = engines["ouro"]
    engine.cache.radix.reset()
    params = [sp(latent_budget=d, exit_criterion=c, exit_threshold=t,
                 return_latent_trace=i != 5) for i, (d, c, t) in enumerate(OURO_CASES)]
    expected = _ouro_expected(refs)
    traces = []
    check(run(engine, params, traces), expected)
    check_traces(traces, params, expected, "ouro")
    # The readouts differ: threshold 0.6 at depth 2 reads step 0 somewhere, weighted has
    # none, last reads depth - 1, threshold-approx both stops early and reads that step.
    assert 0 in [e["readout_step"] for e in traces[1]]
    assert all(e["readout_step"] is None for e in traces[2])
    assert all(set(e) == {"depth", "readout_step", "exit_probs"} for e in traces[3])
    assert all((e["depth"], e["readout_step"]) == (3, 2) for e in traces[3])
    assert any(e["depth"] < 6 and e["readout_step"] == e["depth"] - 1 for e in traces[4])
    # The distributions are not degenerate: the gate spreads mass over several steps.
    assert any(sum(p > 0.05 for p in e["exit_probs"]) >= 2 for t in traces[:5] if t
               for e in t)


@pytest.mark.parametrize("kind", ["huginn", "ouro"])
def test_masked_loop_of_the_graph_path_matches(kind, engines, refs, monkeypatch):
    """The fixed-trip-count loop a CUDA graph captures (every row runs the batch's max depth,
    rows past their depth keep their state; per-row readouts from static tensors) gives the
    same results, eagerly on CPU, and does no host read."""
    original = RecurrentBatch.from_batch.__func__

    def masked(cls, batch, layout, table):  # what CudaGraphRunner binds: no host-side rules
        rec = original(cls, batch, layout, table)
        rec.masked = True
        rec.exit_thr, rec.exit_weighted = rec.token_readout(table.device)
        rec.rules = None
        if kind == "ouro":  # the graph's static readout buffer (CudaGraphRunner)
            rec.readout_steps = torch.full((sum(rec.q_lens),), -7, device=table.device)
        return rec

    monkeypatch.setattr(RecurrentBatch, "from_batch", classmethod(masked))
    engine = engines[kind]
    # Graph-ready: the forward (attention included) never reads device values on the host
    # nor builds host tensors.
    forward = engine.runner.model.forward

    def no_host_reads(*args, **kwargs):
        def trap(*a, **k):
            raise AssertionError("host read or host tensor in the masked forward")

        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "nonzero"):
                m.setattr(torch.Tensor, name, trap)
            m.setattr(torch, "tensor", trap)
            return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", no_host_reads)
    engine.cache.radix.reset()
    depths = HUGINN_DEPTHS if kind == "huginn" else [d for d, _, _ in OURO_CASES]
    n = 3
    if kind == "huginn":
        expected = [refs[kind].generate(p, MAX_TOKENS, d) for p, d in zip(PROMPTS[:n], depths)]
        params = [sp(latent_budget=d, return_latent_trace=True) for d in depths[:n]]
    else:
        params = [sp(latent_budget=d, exit_criterion=c, exit_threshold=t,
                     return_latent_trace=True) for d, c, t in OURO_CASES[:n]]
        expected = _ouro_expected(refs)[:n]
    traces = []
    check(run(engine, params, traces), expected)
    check_traces(traces, params, expected, kind)
