"""Host cost of the token masks of one overlapped decode step, on the CPU, without a model.

``--batch`` requests (SmolLM2's tokenizer, its vocabulary of 49,152) each walk a valid answer
token by token: a JSON object of ``bench_structured_gpu.SCHEMA`` (``json``) or lower-case
text for the regex ``[a-z ,.]+`` (``regex``). Each step does the engine's host work for the
masks of an overlapped step (``engine/overlap.py``): the grammars take the previous batch's
tokens, the ``[batch, 1536] int32`` bitmask is filled, the host buffer the device copy reads
is written, and finalizing the previous batch checks the grammars' end
(``Scheduler._finish_reason``). Prints one JSON object per kind: the median and mean step
in ms over the steps of ``--walks`` walks, and a breakdown (ms per step, from cProfile's
``tottime`` of a separate walk, so its total is inflated by the profiler). Then the same
with the grammar rows filled ahead (``mask_ahead.MasksAhead``, started when the tokens are
pending): the engine thread's part only (start, waiting for the worker, the bitmask from
the rows, the end check), with ``--between-ms`` of other host work between start and take
that sleeps, spins in Python with a torch op every 100 us, or spins in Python only
(``sleep``, ``torch``, ``python``: see ``_between``), and the time waited for the worker per
step.

    python scripts/bench_mask_host.py [--batch 64] [--walks 5] [--kinds json,regex]
        [--between sleep,torch,python] [--between-ms 5]
"""

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "tags": {"type": "array",
                                                    "items": {"type": "string"}}},
          "required": ["title", "tags"]}
REGEX = "[a-z ,.]+"
WORDS = [
    'alpha', 'beta', 'gamma', 'delta', 'river', 'stone', 'cloud', 'maple', 'orbit', 'quiet',
    'amber', 'cedar', 'north', 'signal', 'harbor', 'lantern', 'copper', 'meadow', 'ember',
    'violet', 'tundra', 'canyon']


def walks(tok, kind: str, batch: int, length: int) -> list[list[int]]:
    """Per request, the answer's tokens (``length`` long, EOS last for ``json``)."""
    out = []
    for i in range(batch):
        rng = random.Random(i)
        words = [rng.choice(WORDS) for _ in range(4 * length)]
        if kind == "json":
            title = " ".join(words[: length // 2])
            tags = words[length // 2 : length]
            text = json.dumps({"title": title, "tags": tags})
            while len(tok.encode(text, add_special_tokens=False)) > length - 1:
                tags = tags[:-1]
                text = json.dumps({"title": title, "tags": tags})
            out.append(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
        else:
            text = ", ".join(" ".join(words[k : k + 3]) for k in range(0, len(words), 3))
            out.append(tok.encode(text, add_special_tokens=False)[:length])
    return out


class Harness:
    """The engine's mask work for ``batch`` overlapped requests walking ``answers``."""

    def __init__(self, tok, kind: str, answers: list[list[int]]):
        from latentserve.core import Req
        from latentserve.sampling_params import SamplingParams
        from latentserve.structured import Grammars

        self.vocab = 49152
        self.eos = {tok.eos_token_id}
        self.grammars = Grammars(tok, self.vocab, self.eos)
        so = {"json": SCHEMA} if kind == "json" else {"regex": REGEX}
        self.params = SamplingParams(max_tokens=10_000, structured_outputs=so)
        self.answers = answers
        self.Req = Req

    def fresh(self):
        """New requests at the start of their answers, ``[Req]``."""
        from latentserve.token_masks import RequestMask

        reqs = []
        for i in range(len(self.answers)):
            r = self.Req(f"r{i}", [1, 2, 3], self.params)
            r.answer_start = 0
            r.constraint = RequestMask(self.params, self.vocab, self.eos, None,
                                       self.grammars.matcher(self.params.structured_outputs))
            reqs.append(r)
        return reqs

    def walk(self, reqs, steps: int, times: list[float] | None, ahead=None,
             between=None) -> None:
        """``ahead``: a ``MasksAhead`` started when the tokens are pending and taken by the
        bitmask (else the rows are filled in the timed part); ``between``: the rest of the
        host's step, run untimed between the two."""
        import torch

        from latentserve.engine import overlap
        from latentserve.engine.overlap import Launched
        from latentserve.scheduler.scheduler import PENDING_ID
        from latentserve.token_masks import batch_bitmask

        vocab = self.vocab
        host = torch.empty(len(reqs), dtype=torch.int64)
        staging = torch.empty(len(reqs), (vocab + 31) // 32, dtype=torch.int32)
        for s in range(steps):
            # the state at batch s+1's launch: batch s's tokens pending at index s
            for r in reqs:
                r.output_ids.append(PENDING_ID)
            host.copy_(torch.tensor([a[s] for a in self.answers]))
            prev = Launched(None, None, [(r, s, None, False) for r in reqs], host, host, None,
                            {}, {})
            t0 = time.perf_counter()
            if ahead is not None:  # overlap.step, after advance_launched
                ahead.start([(r, s) for r in reqs], host)
            t_between = time.perf_counter()
            if between is not None:
                between()
            t0 += time.perf_counter() - t_between  # untimed
            known = overlap._known(reqs, prev)
            filled = None if ahead is None else ahead.take()
            rows, mask = batch_bitmask(reqs, vocab, known, staging, filled)  # the pinned buffer
            # finalize batch s: the grammar's end check of Scheduler._finish_reason
            for r, tok in zip(reqs, host.tolist()):
                r.output_ids[s] = tok
                c = r.constraint
                c.sync(r.output_ids, r.answer_start, s + 1)
                _ = c.terminated  # timed: the end check the scheduler makes
            t1 = time.perf_counter()
            if times is not None:
                times.append(t1 - t0)
            if s + 1 < steps:  # the next token must be allowed by this step's mask
                nxt = [a[s + 1] for a in self.answers]
                ok = [(mask[i, t >> 5].item() >> (t & 31)) & 1 for i, t in enumerate(nxt)]
                assert all(ok), (s, ok)


def _between(kind: str, ms: float):
    """The rest of a step's host work, ``ms`` long: ``sleep`` (the GIL free, as in a wait for
    the device), ``torch`` (Python with a small torch op, which frees the GIL, every 100 us,
    as in building and launching a forward) or ``python`` (pure Python holding the GIL but
    for the interpreter's forced switches: the worker's worst case)."""
    import torch

    if kind == "sleep":
        return lambda: time.sleep(ms / 1e3)
    x = torch.zeros(4)

    def spin():
        end = time.perf_counter() + ms / 1e3
        op = time.perf_counter() + 1e-4
        while (now := time.perf_counter()) < end:
            if kind == "torch" and now >= op:
                x.add_(1)
                op = now + 1e-4

    return spin


def run(tok, kind: str, batch: int, n_walks: int, length: int, between: list[str],
        between_ms: float) -> dict:
    from latentserve.mask_ahead import MasksAhead

    answers = walks(tok, kind, batch, length)
    steps = min(len(a) for a in answers) - 1
    h = Harness(tok, kind, answers)
    h.walk(h.fresh(), steps, None)  # warm: the compiled grammar's cache
    ahead_ms = {}
    for b in between:  # the same steps with the rows filled ahead, around `b` of other work
        ahead, t = MasksAhead(h.vocab), []
        for _ in range(n_walks):
            h.walk(h.fresh(), steps, t, ahead, _between(b, between_ms))
        ahead_ms[b] = {"step_ms_median": round(statistics.median(t) * 1e3, 3),
                       "waited_ms_per_step": round(ahead.waited / len(t) * 1e3, 3)}
    times: list[float] = []
    for _ in range(n_walks):
        h.walk(h.fresh(), steps, times)
    prof = cProfile.Profile()
    reqs = h.fresh()
    prof.enable()
    h.walk(reqs, steps, None)
    prof.disable()
    st = pstats.Stats(prof).stats
    top = sorted(((v[2], f"{k[2]} ({k[0].rsplit('/', 1)[-1]}:{k[1]})") for k, v in st.items()),
                 reverse=True)[:10]
    return {"kind": kind, "batch": batch, "steps_per_walk": steps, "walks": n_walks,
            "step_ms_median": round(statistics.median(times) * 1e3, 3),
            "step_ms_mean": round(statistics.mean(times) * 1e3, 3),
            f"ahead_around_{between_ms:g}ms": ahead_ms,
            "profile_ms_per_step": {name: round(t / steps * 1e3, 3) for t, name in top}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--length", type=int, default=96)
    ap.add_argument("--kinds", default="json,regex")
    ap.add_argument("--between", default="sleep,torch,python",
                    help="what runs between a fill ahead's start and take (empty: none)")
    ap.add_argument("--between-ms", type=float, default=5.0)
    args = ap.parse_args()
    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    for kind in args.kinds.split(","):
        print(json.dumps(run(tok, kind, args.batch, args.walks, args.length,
                             [b for b in args.between.split(",") if b], args.between_ms),
                         indent=1), flush=True)


if __name__ == "__main__":
    main()
