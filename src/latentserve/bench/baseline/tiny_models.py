"""Tiny random checkpoints in the exact Hugging Face formats (written by transformers' own
model classes), for tests and benchmarks; tokenizer SmolLM2's (vocab 49152)."""

from __future__ import annotations

from pathlib import Path

from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

VOCAB = 49152


def save_tiny(out_dir: str | Path, kind: str, seed: int = 0, word_tokenizer: bool = False,
              **overrides) -> Path:
    """Write a tiny random checkpoint of ``kind`` into ``out_dir`` and return the path.

    Kinds: ``llama`` (GQA 4/2 heads, tied embeddings), ``llama-untied``, ``qwen2`` (q/k/v
    bias), ``gpt2``; ``overrides`` go into the transformers config; ``word_tokenizer``: the
    ``save_word_tokenizer`` one. Raises ValueError for an unknown kind."""
    import torch
    import transformers as tf

    out = Path(out_dir)
    llama = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                 tie_word_embeddings=False)
    gpt2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)
    kinds = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {**llama, "tie_word_embeddings": True}),
             "llama-untied": (tf.LlamaConfig, tf.LlamaForCausalLM, llama),
             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, llama),
             "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, gpt2)}
    if kind not in kinds:
        raise ValueError(f"kind must be one of {', '.join(kinds)}; got {kind!r}")
    config_cls, cls, shape = kinds[kind]
    cfg = config_cls(**{"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, **shape,
                        **overrides})
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger-than-default weights so greedy paths are not degenerate
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(out)
    if word_tokenizer:
        save_word_tokenizer(out, cfg.vocab_size)
    else:
        load_tokenizer(resolve_model_dir(None)).save_pretrained(out)
    return out


def save_word_tokenizer(out_dir: str | Path, vocab_size: int = 1024):
    """Write a word-level tokenizer into ``out_dir`` (no GGUF needed): ids 0/1/2 are
    ``<unk>``/``<s>``/``</s>`` (eos), the rest ``w3 .. w{vocab_size-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out_dir)
    return fast
