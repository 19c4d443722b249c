"""A minimal feedback-latent model for engine tests: a plain tiny checkpoint given a
``LatentSpec`` and identity feedback (COCONUT's rule: the post-norm last hidden is the next
input), plus its eager per-request reference over HF transformers (inputs_embeds +
past_key_values), written from arXiv 2412.06769's inference algorithm."""

from __future__ import annotations

import contextlib

import torch

from latentserve.latent.spec import LatentSpec

START, END, LATENT = 100, 101, 102
MOCK_SPEC = LatentSpec("feedback", "mock-coconut", default_budget=3, max_budget=16,
                       start_ids=(START,), end_ids=(END,), latent_id=LATENT)


@contextlib.contextmanager
def mock_latent_loading():
    """Within the block, every model ``LLMEngine`` loads gets ``MOCK_SPEC`` and identity
    feedback."""
    import latentserve.engine.tp_worker as tp_worker  # LLMEngine loads through it

    original = tp_worker.load_model

    def load(model_dir, dtype, device, **kwargs):
        model, cfg = original(model_dir, dtype, device, **kwargs)
        model.latent_spec = MOCK_SPEC
        model.latent_feedback = lambda hidden: hidden
        return model, cfg

    tp_worker.load_model = load
    try:
        yield
    finally:
        tp_worker.load_model = original


@torch.no_grad()
def mock_reference(hf_model, prompt: list[int], budget: int, max_tokens: int,
                   eos_id: int = 2) -> list[int]:
    """Greedy answer ids: prompt + [START], ``budget`` latent steps each fed the previous
    position's last hidden (post final norm), [END], then decoding with the KV cache."""
    dev = hf_model.device
    out = hf_model(torch.tensor([prompt + [START]], device=dev), use_cache=True,
                   output_hidden_states=True)
    for _ in range(budget):
        out = hf_model(inputs_embeds=out.hidden_states[-1][:, -1:],
                       past_key_values=out.past_key_values, use_cache=True,
                       output_hidden_states=True)
    out = hf_model(torch.tensor([[END]], device=dev), past_key_values=out.past_key_values,
                   use_cache=True)
    tokens = []
    for _ in range(max_tokens):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if tok == eos_id:
            break
        out = hf_model(torch.tensor([[tok]], device=dev), past_key_values=out.past_key_values,
                       use_cache=True)
    return tokens


def run_mixed_budgets(engine, prompts, budgets, max_tokens, tag=""):
    """Run every (prompt, budget) in one batch; returns (answers, latent_steps) per request."""
    from latentserve.sampling_params import SamplingParams

    rids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p, b in zip(rids, prompts, budgets):
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  latent_budget=b))
    answers, steps = {r: [] for r in rids}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers[out.rid] += out.new_token_ids
            if out.finished:
                steps[out.rid] = out.latent_steps
    return [answers[r] for r in rids], [steps[r] for r in rids]
