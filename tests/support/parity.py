"""Parity helpers shared by the CPU and GPU tests: run an engine over a batch and record, per
request, the greedy tokens, the logits the first token was sampled from (the prefill logits;
for a latent model, ``run_budget_batch``: the first answer token's) and the prompt tokens
served from cache; and the HF transformers reference for one prompt."""
from latentserve.sampling_params import SamplingParams


def run_batch(engine, prompts, max_tokens, **params):
    runner, first_logits = engine.runner, {}
    original = runner.run

    def recording_run(batch, *args, **kwargs):
        logits, hidden = original(batch, *args, **kwargs)
        sampled = [r for r, s in zip(batch.reqs, batch.sample) if s]
        for req, row in zip(sampled, logits):
            if not req.output_ids:
                first_logits[req.rid] = row.float().cpu().clone()
        return logits, hidden

    runner.run = recording_run
    try:
        rids = [f"r{engine._arrivals + i}" for i in range(len(prompts))]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        for rid, p in zip(rids, prompts):
            engine.add_request(rid, p, sp)
        tokens, cached = {rid: [] for rid in rids}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.rid] += out.new_token_ids
                cached[out.rid] = out.num_cached_tokens
    finally:
        runner.run = original
    return ([tokens[r] for r in rids], [first_logits[r] for r in rids], [cached[r] for r in rids])


def run_budget_batch(engine, reqs, max_tokens: int, join_after: int | None = None):
    """Run ``reqs``, ``[(prompt ids, latent_budget)]``, greedy, queued at once, synchronously
    or under the overlap scheduler. Returns per request ``(answer ids, first-answer logits
    [vocab] float32 on the CPU, num_cached_tokens)``: the logits row of the forward that
    sampled the first answer token, the row sampled when the request had ``answer_start``
    output ids (its latent steps sample rows too, at fewer; under overlap a step's outputs are
    the previous forward's, so rows are matched by that count, not by step). With
    ``join_after``, the second half of ``reqs`` is queued after that many steps."""
    runner, rows, seen = engine.runner, {}, {}
    original = runner.run

    def recording_run(batch, *args, **kwargs):
        logits, hidden = original(batch, *args, **kwargs)
        for req, row in zip([r for r, s in zip(batch.reqs, batch.sample) if s], logits):
            seen[req.rid] = req  # a copy: on the CPU .cpu() may be a graph's static buffer
            rows.setdefault(req.rid, {})[len(req.output_ids)] = row.float().cpu().clone()
        return logits, hidden

    def add(todo):
        for rid, (prompt, budget) in todo:
            engine.add_request(rid, prompt, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, latent_budget=budget))

    rids = [f"q{engine._arrivals + i}" for i in range(len(reqs))]
    todo = list(zip(rids, reqs))
    split = len(todo) if join_after is None else len(todo) // 2
    add(todo[:split])
    rest = todo[split:]
    tokens, cached, steps = {r: [] for r in rids}, {}, 0
    runner.run = recording_run
    try:
        while engine.has_unfinished_requests() or rest:
            if rest and steps == join_after:
                add(rest)
                rest = []
            for out in engine.step():
                tokens[out.rid] += out.new_token_ids
                cached[out.rid] = out.num_cached_tokens
            steps += 1
    finally:
        runner.run = original
    first = {r: rows[r][seen[r].answer_start] for r in rids}
    return [(tokens[r], first[r], cached[r]) for r in rids]


def hf_reference(model, prompt, max_tokens):
    """HF transformers ``generate`` (greedy, batch 1) and the prompt's last-position logits."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist(), logits.cpu()


def shared_prefix_prompts():
    """Eight prompts of different lengths; five share a 48-token prefix, two share another."""
    base = [(37 * i + 11) % 4000 + 100 for i in range(48)]
    other = [(53 * i + 7) % 3000 + 900 for i in range(20)]
    return [
        base + [500, 501, 502],
        base + [600] * 9,
        base[:30],
        base + [700 + i for i in range(25)],
        [5, 6, 7],
        other + [11, 12],
        other + [13, 14, 15, 16, 17],
        base + [999],
    ]


CHAT_QUESTIONS = [
    "What is 12 + 30?",
    "Name three primary colors.",
    "A farmer has 5 cows and buys 7 more. How many cows does he have?",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "If a train travels 60 miles in 1 hour, how far does it go in 3 hours?",
    "Say hello.",
    "Tom has 3 apples and eats one. How many are left?",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    """``CHAT_QUESTIONS`` as single-turn chat prompts (token ids), generation prompt added."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True,
                                               tokenize=True)["input_ids"])
            for q in CHAT_QUESTIONS]
