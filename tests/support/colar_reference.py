"""The eager single-request reference for CoLaR models, over HF transformers in float32.

Source: arXiv 2505.16552; upstream xiaomi-research/colar ``src/models/model_base.py``
``latent_generate`` for one request, with greedy choices where upstream samples:

1. prefill ``colar.prompt_ids(tok, [question], c)`` (question part, speed and the opening
   ``###``, each tokenised on its own, as the engine builds it);
2. latent step: the policy reads the last position's last-layer hidden state (after the
   final norm); the latent is ``mean * embeds_std`` at temperature 0, else ``(mean + std *
   temperature * eps) * embeds_std`` with ``eps = torch.randn(H, generator=generator)``,
   one draw per latent in order (upstream samples at ``latent_temperature`` 1); it is fed
   as the next input embedding. After its forward, the
   phase ends when the argmax of its logits is the ``###`` id (upstream samples that token
   at ``eol_temperature`` 1) or when ``max_latent`` latents were fed;
3. the ``###`` embedding is fed and the answer decoded greedily until EOS (kept) or
   ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from latentserve.latent import colar


@dataclass(slots=True)
class ColarReferenceOutput:
    """One request's run. ``prompt_ids``: the prefilled ids; ``latents``: [n_latent, H]
    float32, the input embeddings fed; ``latent_logits``: [n_latent, V] float32, the logits
    after each latent (the stop test reads their argmax); ``answer_ids``: the greedy answer
    (EOS included when reached); ``answer_logits``: [len(answer_ids), V] float32, the
    logits each answer token was chosen from (the first after the closing ``###``)."""

    prompt_ids: list[int]
    n_latent: int
    latents: torch.Tensor
    latent_logits: torch.Tensor
    answer_ids: list[int]
    answer_logits: torch.Tensor


def load_colar_reference(model_dir: str | Path, device: str = "cpu"):
    """``(model, tokenizer, ColarConfig, LatentPolicy)`` of a ``train colar`` output: the
    base named by its ``adapter_config.json`` (the embedded SmolLM2 for its hub name) with
    the LoRA merged, or the whole model of a full fine-tune (no adapter), float32, eval
    mode, on ``device``. Raises ValueError when the directory has no ``colar_config.json``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir
    from latentserve.train.colar import adapter_base

    d = Path(model_dir)
    loaded = colar.load_colar(d)
    if loaded is None:
        raise ValueError(f"{d} has no {colar.COLAR_CONFIG}")
    if not (d / "adapter_config.json").is_file():  # a full fine-tune: the model itself
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        cfg, policy = loaded
        return model.to(device).eval(), load_tokenizer(d), cfg, policy.to(device)
    base_dir = resolve_model_dir(adapter_base(str(d)))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(d)).merge_and_unload()
    cfg, policy = loaded
    return model.to(device).eval(), load_tokenizer(base_dir), cfg, policy.to(device)


@torch.no_grad()
def colar_generate_reference(model, tok, policy: colar.LatentPolicy, cfg: colar.ColarConfig,
                             question: str, compression_factor: int | None = None,
                             max_latent: int | None = None, max_new_tokens: int = 16,
                             temperature: float = 0.0,
                             generator: torch.Generator | None = None) -> ColarReferenceOutput:
    """Run one request (see the module docstring). ``model``: an HF ``*ForCausalLM`` in
    float32 (PEFT LoRA merged or not); ``compression_factor`` / ``max_latent`` default to
    ``cfg``'s; ``generator`` (on the model's device) is required when ``temperature > 0``.
    Raises ValueError for a bad argument."""
    c = cfg.compression_factor if compression_factor is None else compression_factor
    cap = cfg.max_latent if max_latent is None else max_latent
    if cap < 0 or max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"need max_latent >= 0, max_new_tokens >= 1 and temperature >= 0, got "
                         f"{cap}, {max_new_tokens}, {temperature}")
    if temperature > 0 and generator is None:
        raise ValueError("temperature > 0 needs a torch.Generator")
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb = lm.get_input_embeddings()
    device = emb.weight.device
    sep = tok.convert_tokens_to_ids(colar.SEPARATOR)
    prompt = colar.prompt_ids(tok, [question], c)[0]
    cache = None

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [n, H] fed after the cache -> (last hidden [H], last logits [V])."""
        nonlocal cache
        out = lm.model(inputs_embeds=x[None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        h = out.last_hidden_state[0, -1]
        return h, lm.lm_head(h).float()

    h, _ = forward(emb(torch.tensor(prompt, device=device)))
    latents, latent_logits = [], []
    while len(latents) < cap:
        dist = policy(h.float(), temperature=temperature or 1.0)  # std unused at 0
        z = dist.mean
        if temperature > 0:
            z = z + dist.stddev * torch.randn(z.shape, generator=generator, device=z.device)
        z = z * cfg.embeds_std
        latents.append(z)
        h, logits = forward(z[None].to(emb.weight.dtype))
        latent_logits.append(logits)
        if int(logits.argmax()) == sep:
            break
    h, logits = forward(emb(torch.tensor([sep], device=device)))
    answer, answer_logits = [], []
    while len(answer) < max_new_tokens:
        answer_logits.append(logits)
        answer.append(int(logits.argmax()))
        if answer[-1] == tok.eos_token_id:
            break
        h, logits = forward(emb(torch.tensor(answer[-1:], device=device)))
    hdim, vocab = emb.weight.shape[1], logits.shape[-1]
    return ColarReferenceOutput(
        prompt_ids=prompt, n_latent=len(latents),
        latents=torch.stack(latents).float() if latents else torch.zeros(0, hdim),
        latent_logits=torch.stack(latent_logits) if latents else torch.zeros(0, vocab),
        answer_ids=answer, answer_logits=torch.stack(answer_logits))


def run_colar_batch(engine, cases, max_tokens: int, **extra) -> list[tuple]:
    """Run ``[(question or prompt ids, compression_factor, max_latent)]`` through ``engine``
    (an ``LLMEngine`` serving a CoLaR directory) as one greedy batch; a question gets the
    question part ``colar.QUESTION`` (the engine appends speed and ``###``). ``extra``: more
    ``SamplingParams`` fields. Returns per case ``(answer token ids, final StepOutput, the
    first answer token's logits [V] float32 CPU)``."""
    from latentserve.sampling_params import SamplingParams

    first, real = {}, engine.runner.run

    def spy(batch, *args, **kwargs):  # the logits of each request's first answer token
        logits, hidden = real(batch, *args, **kwargs)
        for req, row in zip([r for r, s in zip(batch.reqs, batch.sample) if s], logits):
            if req.answer_start == len(req.output_ids) and req.rid not in first:
                first[req.rid] = row.float().cpu().clone()
        return logits, hidden

    engine.runner.run = spy
    base = engine._arrivals
    rids = [f"c{base + i}" for i in range(len(cases))]
    try:
        for rid, (q, c, cap) in zip(rids, cases):
            prompt = (engine.tokenizer.encode(colar.QUESTION.format(q), add_special_tokens=False)
                      if isinstance(q, str) else q)
            engine.add_request(rid, prompt, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, compression_factor=c, max_latent=cap,
                **extra))
        toks, final = {r: [] for r in rids}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.rid] += o.new_token_ids
                if o.finished:
                    final[o.rid] = o
    finally:
        engine.runner.run = real
    return [(toks[r], final[r], first[r]) for r in rids]
