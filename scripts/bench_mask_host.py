"""Host cost of the token masks of one overlapped decode step, on the CPU, without a model.

``--batch`` requests (SmolLM2's tokenizer, its vocabulary of 49,152) each walk a valid answer
token by token: a JSON object of ``bench_structured_gpu.SCHEMA`` (``json``) or lower-case
text for the regex ``[a-z ,.]+`` (``regex``). Each step does the engine's host work for the
masks of an overlapped step (``engine/overlap.py``): the grammars take the previous batch's
tokens, the ``[batch, 1536] int32`` bitmask is filled, the host buffer the device copy reads
is written, and finalizing the previous batch checks the grammars' end
(``Scheduler._finish_reason``). Prints one JSON object per kind: the median and mean step
in ms over the steps of ``--walks`` walks, and a breakdown (ms per step, from cProfile's
``tottime`` of a separate walk, so its total is inflated by the profiler).

    python scripts/bench_mask_host.py [--batch 64] [--walks 5] [--kinds json,regex]
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
                if not tags and not title:
                    raise ValueError(f"--length {length} is too short for the JSON answer")
                # the tags go first, then the title's last words
                tags, title = (tags[:-1], title) if tags else ([], title.rpartition(" ")[0])
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

    def walk(self, reqs, steps: int, times: list[float] | None) -> None:
        """``steps`` overlapped steps of ``reqs``, each step's mask work timed into ``times``
        (s; None: untimed); asserts each next answer token is allowed by its step's mask."""
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
            known = overlap._known(reqs, prev)
            rows, mask = batch_bitmask(reqs, vocab, known, staging)  # the pinned buffer
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


def run(tok, kind: str, batch: int, n_walks: int, length: int) -> dict:
    answers = walks(tok, kind, batch, length)
    steps = min(len(a) for a in answers) - 1
    h = Harness(tok, kind, answers)
    h.walk(h.fresh(), steps, None)  # warm: the compiled grammar's cache
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
            "profile_ms_per_step": {name: round(t / steps * 1e3, 3) for t, name in top}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--length", type=int, default=96)
    ap.add_argument("--kinds", default="json,regex")
    args = ap.parse_args()
    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    for kind in args.kinds.split(","):
        print(json.dumps(run(tok, kind, args.batch, args.walks, args.length), indent=1),
              flush=True)


if __name__ == "__main__":
    main()
