"""The eager per-request reference for looped latent blocks (PCCoT, LOTUS): every pass
recomputes the whole sequence with HF transformers (no KV cache).

Design notes: docs/internals.md, "latentserve.bench.baseline.loop_reference".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from latentserve.models.checkpoint import load_tokenizer


@dataclass
class LoopReference:
    """A loaded looped model (``eos``, ``family``: tests/support/loop_reference.py's stop)."""

    model: object  # HF CausalLM (maybe a peft wrapper)
    prj: object  # callable [N, H] -> [N, H]
    start: list
    end: list
    latent: int
    block_size: int
    rule: str  # "jacobi" | "same"
    eos: set
    family: str = ""  # "pccot" | "lotus"


def _eos(model) -> set:
    e = model.config.eos_token_id
    return set(e if isinstance(e, list) else [e] if e is not None else [])


@lru_cache(maxsize=4)
def load_pccot_reference(base_dir: str, adapter_dir: str, device: str = "cpu",
                         dtype: str = "float32") -> LoopReference:
    """PCCoT from its upstream form (base + ``prj`` + ``PeftModel.from_pretrained``)."""
    from peft import PeftModel
    from torch import nn
    from transformers import AutoModelForCausalLM

    adapter = Path(adapter_dir)
    pc = json.loads((adapter / "config.json").read_text())
    args = json.loads((adapter / "pccot_args.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.resize_token_embeddings(pc["vocab_size"], mean_resizing=False)
    d = model.config.hidden_size
    if pc.get("use_projection"):
        model.prj = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.LayerNorm(d))
    peft_model = PeftModel.from_pretrained(model, str(adapter))
    dt = getattr(torch, dtype)
    peft_model = peft_model.to(device, dt).eval()
    inner = peft_model.base_model.model
    prj = inner.prj if pc.get("use_projection") else (lambda x: x)
    tok = load_tokenizer(adapter)
    prompt = tok.encode(args["answer_prompt"], add_special_tokens=False)
    return LoopReference(peft_model, prj, [args["bot_token_id"]],
                         [args["eot_token_id"], *prompt], args["latent_token_id"],
                         args["num_latent_tokens"], "jacobi", _eos(model), "pccot")


@torch.no_grad()
def reference_generate_loop(ref: LoopReference, prompt_ids: list[int], iterations: int,
                            max_tokens: int, passes: list | None = None):
    """Greedy answer for one request, exactly ``max_tokens`` (no EOS stop), each forward
    recomputing the sequence: ``(answer_ids, first_answer_logits [vocab] float32 CPU)``.
    ``passes``: gets each pass's block logits ``[block_size, vocab]``."""
    model, n = ref.model, ref.block_size
    emb = model.get_input_embeddings()
    dev = emb.weight.device
    prefix = emb(torch.tensor(prompt_ids + ref.start, device=dev))
    block = emb(torch.tensor([ref.latent] * n, device=dev))
    p = prefix.shape[0]

    def full(x):  # [L, H] -> (logits [L, V], post-final-norm hidden [L, H])
        out = model(inputs_embeds=x[None], output_hidden_states=True, use_cache=False)
        return out.logits[0].float(), out.hidden_states[-1][0]

    for _ in range(iterations):
        lg, h = full(torch.cat([prefix, block]))
        if passes is not None:
            passes.append(lg[p : p + n].cpu())
        src = h[p - 1 : p - 1 + n] if ref.rule == "jacobi" else h[p : p + n]
        block = ref.prj(src)
    tail = emb(torch.tensor(ref.end, device=dev)) if ref.end else prefix[:0]
    if passes is not None:  # the last pass: the block as the answer reads it (causal)
        passes.append(full(torch.cat([prefix, block]))[0][p : p + n].cpu())
    answer, first = [], None
    for _ in range(max_tokens):
        logits = full(torch.cat([prefix, block, tail]))[0][-1]
        if first is None:
            first = logits.cpu()
        tok = int(logits.argmax())
        answer.append(tok)
        tail = torch.cat([tail, emb(torch.tensor([tok], device=dev))])
    return answer, first
