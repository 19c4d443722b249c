"""Tiny CoLaR model directories (``latent/colar_head.py``) for tests: a random untied Llama
backbone with a word-level tokenizer that has CoLaR's prompt words and the ``###``
separator, ``colar_config.json`` and a random ``latent_policy.safetensors``.

On random weights the LM head would almost never pick ``###`` at a latent position, so the
policy's ``mean`` bias gets ``stop_push`` times the direction of the ``###`` row of the LM
head: each latent input then leans towards ``###``, and through the residual stream so does
the hidden state the LM head reads; with a moderate push the stop fires after a few latents,
at a step that depends on the prompt.
"""

from __future__ import annotations

from pathlib import Path

WORDS = ("###", "(", ")", ":", "Thinking", "speed", "Question", "Let's", "think", "step",
         "by", "Answer", "+", "=", *"0123456789")


# Chat renders the last user message as CoLaR's question part (latent.colar.QUESTION).
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}Question: "
                 "{{ m['content'] }} Let's think step by step:{% endif %}{% endfor %}")


def save_colar_word_tokenizer(out_dir: str | Path, vocab_size: int = 1024):
    """Write a word-level tokenizer into ``out_dir``: ids 0/1/2 ``<unk>``/``<s>``/``</s>``
    (eos), then :data:`WORDS` (``###`` is 3), then ``w{i}`` up to ``vocab_size``. Text is
    split on whitespace and around ``###``, parentheses and colons, so
    ``"(Thinking speed: 4)###"`` is 7 tokens; the chat template is :data:`CHAT_TEMPLATE`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab[w] = len(vocab)
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"###|[():]"), behavior="isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def save_colar_tiny(root: str | Path, seed: int = 0, vocab_size: int = 1024,
                    stop_push: float = 0.0, max_latent: int = 12, compression_factor: int = 2,
                    max_compression_factor: int = 5, deterministic: bool = False,
                    intermediate_size: int = 48, **overrides) -> Path:
    """Write a tiny CoLaR directory into ``root`` and return it: ``save_tiny``'s
    ``llama-untied`` (2 layers unless overridden) with :func:`save_colar_word_tokenizer`,
    ``colar_config.json`` (``embeds_std`` the embedding matrix's std) and a random policy
    whose ``mean`` bias leans ``stop_push`` towards the ``###`` row of the LM head."""
    import torch
    from safetensors.torch import load_file

    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.latent.colar import ColarConfig, LatentPolicy, save_colar

    d = save_tiny(Path(root), "llama-untied", seed=seed, word_tokenizer=True,
                  vocab_size=vocab_size, **overrides)
    save_colar_word_tokenizer(d, vocab_size)
    weights = load_file(str(d / "model.safetensors"))
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    hidden = emb.shape[1]
    cfg = ColarConfig(hidden_size=hidden, intermediate_size=intermediate_size,
                      embeds_std=float(emb.float().std()), deterministic=deterministic,
                      compression_factor=compression_factor,
                      max_compression_factor=max_compression_factor, max_latent=max_latent)
    torch.manual_seed(seed + 11)
    policy = LatentPolicy(hidden, intermediate_size, deterministic)
    sep = head[3].float()
    with torch.no_grad():
        policy.mean.bias.add_(stop_push * sep / sep.norm())
    save_colar(d, cfg, policy)
    return d
