"""A PEFT LoRA adapter directory served by the engine (merged into its base at load) gives
the PEFT model's greedy tokens and its logits within 1e-5 in fp32: Llama (tied), Qwen2 (q/k/v
biases, untied), rsLoRA with rank/alpha patterns, a bf16-stored adapter, TP=2; and what cannot
be merged is refused with a message naming the cause."""

import json
import os
import shutil

import pytest
import torch

from latentserve.latent.load import load_model
from tests.support.parity import hf_reference, run_batch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [(37 * i + 11) % 4000 + 100
                                                      for i in range(40)]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bases(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.tiny_models import save_tiny

    root = tmp_path_factory.mktemp("lora-bases")
    return {k: save_tiny(root / k, k) for k in ("llama", "qwen2", "gpt2")}


def write_adapter(out, base_dir, *, bf16=False, seed=1, std=0.1, **lora_kw):
    """Wrap ``base_dir`` with ``get_peft_model``, give every lora_A/lora_B random values
    (normal, ``std``; rounded to bf16 first with ``bf16``, then stored in bf16 as ``train
    cot`` does), save it with PEFT into ``out`` with ``base_model_name_or_path`` relative to
    ``out`` ("../base").
    Returns ``(out, peft_model)`` (eval, fp32, LoRA unmerged)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "lora_dropout": 0.0, **lora_kw}
    peft_model = get_peft_model(model, LoraConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
                if bf16:
                    p.copy_(p.bfloat16().float())
    peft_model.save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = os.path.relpath(base_dir, out)
    (out / "adapter_config.json").write_text(json.dumps(config))
    if bf16:
        sd = load_file(out / "adapter_model.safetensors")
        save_file({k: v.bfloat16() for k, v in sd.items()}, str(out / "adapter_model.safetensors"))
    return out, peft_model.eval()


def _edit_config(adapter_dir, **changes):
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _assert_serves_like_peft(adapter_dir, peft_model, atol=1e-5, **engine_opts):
    from latentserve import LLM

    llm = LLM(model=str(adapter_dir), **engine_opts)
    tokens, logits, _ = run_batch(llm.engine, PROMPTS, MAX_TOKENS)
    for prompt, toks, lg in zip(PROMPTS, tokens, logits):
        ref_toks, ref_lg = hf_reference(peft_model, prompt, MAX_TOKENS)
        assert toks == ref_toks
        torch.testing.assert_close(lg, ref_lg, atol=atol, rtol=0)
    with torch.no_grad(), peft_model.disable_adapter():  # the adapter does change the model
        base_lg = peft_model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert (logits[0] - base_lg).abs().max() > 0.1
    return llm


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_adapter_serves_like_peft(kind, bases, tmp_path):
    shutil.copytree(bases[kind], tmp_path / "base")
    adapter, peft_model = write_adapter(tmp_path / "adapter", tmp_path / "base")
    llm = _assert_serves_like_peft(adapter, peft_model)
    # greedy text through the public API too (same tokens as the PEFT model's)
    from latentserve import SamplingParams

    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_reference(peft_model, PROMPTS[1], MAX_TOKENS)[0]


def test_rslora_with_rank_and_alpha_patterns_serves_like_peft(bases, tmp_path):
    shutil.copytree(bases["llama"], tmp_path / "base")
    adapter, peft_model = write_adapter(
        tmp_path / "adapter", tmp_path / "base", use_rslora=True,
        rank_pattern={"o_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
        alpha_pattern={"q_proj": 3})
    _assert_serves_like_peft(adapter, peft_model)


def test_bf16_stored_adapter_serves_like_peft_in_fp32(bases, tmp_path):
    shutil.copytree(bases["qwen2"], tmp_path / "base")
    adapter, peft_model = write_adapter(tmp_path / "adapter", tmp_path / "base", bf16=True)
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    _assert_serves_like_peft(adapter, peft_model)


def test_merged_weights_equal_peft_merge_and_unload(bases, tmp_path):
    import copy

    shutil.copytree(bases["qwen2"], tmp_path / "base")
    adapter, peft_model = write_adapter(tmp_path / "adapter", tmp_path / "base")
    model, hf_config = load_model(adapter, torch.float32, "cpu")
    assert hf_config.model_type == "qwen2"
    ours = dict(model.named_parameters())
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.0.self_attn.q_proj.bias"):
        assert torch.equal(ours[name], merged[name]), name


def test_tokenizer_and_eos_come_from_the_base_chat_template_from_the_adapter(bases, tmp_path):
    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    shutil.copytree(bases["llama"], tmp_path / "base")
    adapter, _ = write_adapter(tmp_path / "adapter", tmp_path / "base")
    assert resolve_model_dir(adapter) == adapter.resolve()
    base_tok = load_tokenizer(tmp_path / "base")
    tok = load_tokenizer(adapter)
    assert tok.get_vocab() == base_tok.get_vocab() and tok.chat_template == \
        base_tok.chat_template
    (adapter / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>"
                                                 "{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(adapter).apply_chat_template(msgs, tokenize=False) == "<hi>"
    from latentserve.engine.llm_engine import _eos_ids

    gen = json.loads((tmp_path / "base" / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]  # only the base's generation config has 7
    (tmp_path / "base" / "generation_config.json").write_text(json.dumps(gen))
    _, hf_config = load_model(adapter, torch.float32, "cpu")
    assert 7 in _eos_ids(adapter, tok, hf_config)


def test_adapter_with_tp2_matches_tp1(bases, tmp_path):
    """The merge runs on the full weights in every rank before sharding."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams
    from tests.support.tp_parity import assert_same, run_requests

    shutil.copytree(bases["qwen2"], tmp_path / "base")
    adapter, _ = write_adapter(tmp_path / "adapter", tmp_path / "base")
    cfg = {"model": str(adapter), "kv_slots": 1024, "max_model_len": 256}
    one = LLMEngine(EngineConfig(**cfg))
    two = LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))
    try:
        reqs = [(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                for p in PROMPTS]
        assert_same(run_requests(one, reqs), run_requests(two, reqs))
    finally:
        two.shutdown()


# ----------------------------------------------------------------------------- refusals

@pytest.fixture
def adapter(bases, tmp_path):
    shutil.copytree(bases["llama"], tmp_path / "base")
    return write_adapter(tmp_path / "adapter", tmp_path / "base")[0]


@pytest.mark.parametrize("base, match", [
    ("meta-llama/Llama-3.2-1B", "hub ids are never downloaded"),
    ("../nowhere", "no such local path"),
    (None, "must name the base model"),
])
def test_unresolvable_base_is_refused_naming_the_field(adapter, base, match):
    from latentserve.models.checkpoint import resolve_model_dir

    _edit_config(adapter, base_model_name_or_path=base)
    for load in (lambda: resolve_model_dir(adapter), lambda: load_model(adapter, torch.float32,
                                                                        "cpu")):
        with pytest.raises(ValueError, match=f"'base_model_name_or_path'.*{match}"):
            load()


def test_an_adapter_as_base_is_refused(adapter, tmp_path):
    shutil.copytree(adapter, tmp_path / "second")
    _edit_config(tmp_path / "second", base_model_name_or_path="../adapter")
    with pytest.raises(ValueError, match="stacked adapters"):
        load_model(tmp_path / "second", torch.float32, "cpu")


def test_dora_adapter_is_refused_by_field(adapter):
    _edit_config(adapter, use_dora=True)
    with pytest.raises(ValueError, match="field 'use_dora'.*DoRA"):
        load_model(adapter, torch.float32, "cpu")


def _edit_tensors(adapter, edit):
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    sd = load_file(path)
    edit(sd)
    save_file(sd, str(path))


def test_adapter_key_matching_no_base_weight_is_refused(adapter):
    def to_layer_9(sd):
        for k in [k for k in sd if ".layers.1.self_attn.q_proj." in k]:
            sd[k.replace(".layers.1.", ".layers.9.")] = sd.pop(k)

    _edit_tensors(adapter, to_layer_9)
    with pytest.raises(ValueError, match=r"match no base weight.*layers\.9\.self_attn\.q_proj"):
        load_model(adapter, torch.float32, "cpu")


def test_shape_mismatch_is_refused(adapter):
    key = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    _edit_tensors(adapter, lambda sd: sd.update({key: torch.zeros(4, 10)}))
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(128, 10\).*\(128, 64\)"):
        load_model(adapter, torch.float32, "cpu")


def test_rank_other_than_config_is_refused(adapter):
    _edit_config(adapter, r=8)
    with pytest.raises(ValueError, match="field 'r' gives rank 8"):
        load_model(adapter, torch.float32, "cpu")


def test_saved_module_tensor_is_refused(adapter):
    _edit_tensors(adapter, lambda sd: sd.update(
        {"base_model.model.model.norm.weight": torch.ones(64)}))
    with pytest.raises(ValueError, match="'base_model.model.model.norm.weight' is not a LoRA"):
        load_model(adapter, torch.float32, "cpu")


def test_lora_on_tied_lm_head_is_refused(bases, tmp_path):
    shutil.copytree(bases["llama"], tmp_path / "base")
    adapter, _ = write_adapter(tmp_path / "adapter", tmp_path / "base",
                               target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="'base_model.model.lm_head.base_layer.weight' is not"):
        load_model(adapter, torch.float32, "cpu")  # PEFT also saved the tied embedding
    _edit_tensors(adapter, lambda sd: [sd.pop(k) for k in list(sd) if ".lora_" not in k])
    with pytest.raises(ValueError, match="targets lm_head.*tie_word_embeddings"):
        load_model(adapter, torch.float32, "cpu")


def test_non_llama_family_base_is_refused(bases, tmp_path):
    shutil.copytree(bases["gpt2"], tmp_path / "base")
    adapter, _ = write_adapter(tmp_path / "adapter", tmp_path / "base",
                               target_modules=["c_attn"], fan_in_fan_out=True)
    _edit_config(adapter, fan_in_fan_out=False)  # past the config check, to the base's type
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model(adapter, torch.float32, "cpu")


@pytest.mark.slow
def test_adapter_over_the_embedded_smollm2_serves_like_peft(smollm2_dir, tmp_path):
    """``base_model_name_or_path`` as ``latentserve train cot`` writes it for the embedded
    model: the engine merges into the converted GGUF weights."""
    adapter, peft_model = write_adapter(tmp_path / "adapter", smollm2_dir, r=8, lora_alpha=16,
                                        seed=3, std=0.03)
    _edit_config(adapter, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    # 2e-4: on the plain SmolLM2 the engine's fp32 logits already differ from HF's by up to
    # 1.2e-4 (summation order over 30 layers); the merged weights themselves are exact:
    llm = _assert_serves_like_peft(adapter, peft_model, atol=2e-4, max_model_len=256,
                                   kv_slots=512)
    ours = dict(llm.engine.runner.model.named_parameters())
    hf = peft_model.base_model.model
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("base_layer.weight") and ".layers.29." in name:
                layer = hf.get_submodule(name.removesuffix(".base_layer.weight"))
                want = p + layer.get_delta_weight("default")  # PEFT's merge, in fp32
                assert torch.equal(ours[name.replace(".base_layer", "")], want), name
