"""The shared LoRA merge (``models.lora``): float32 arithmetic kept in float32, PEFT key
parsing, ``adapter_config.json`` checks, and CODI's merge through the same helper no longer
rounding a bf16 base back to bf16."""

import json

import pytest
import torch

from latentserve.models import lora


def _plain_config(**changes):
    """adapter_config.json as PEFT 0.21 writes it for a plain LoRA (every field present)."""
    from peft import LoraConfig

    cfg = json.loads(json.dumps(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
                                .to_dict(), default=list))
    return {**cfg, **changes}


def test_merged_weight_is_float32_sum_of_bf16_inputs():
    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=g).bfloat16() for s in ((6, 5), (3, 5), (6, 3)))
    out = lora.merged_weight(w, a, b, 0.7)
    assert out.dtype == torch.float32
    assert torch.equal(out, w.float() + (b.float() @ a.float()) * 0.7)
    assert not torch.equal(out, out.bfloat16().float())  # not rounded to the base's dtype


def test_merged_weight_transposes_for_conv1d_and_names_a_shape_mismatch():
    w, a, b = torch.zeros(5, 6), torch.ones(2, 5), torch.ones(6, 2)
    assert torch.equal(lora.merged_weight(w, a, b, 1.0, transpose=True), torch.full((5, 6), 2.))
    with pytest.raises(ValueError, match=r"'x.weight'.*\(6, 5\).*\(5, 6\)"):
        lora.merged_weight(w, a, b, 1.0, name="x.weight")
    with pytest.raises(ValueError, match="does not fit together"):
        lora.merged_weight(w, a, torch.ones(6, 3), 1.0)


def test_lora_scale_plain_and_rslora():
    assert lora.lora_scale(16, 4) == 4.0
    assert lora.lora_scale(16, 4, use_rslora=True) == 8.0


def test_split_lora_key_accepts_a_b_weights_and_refuses_other_peft_tensors():
    m = "base_model.model.model.layers.0.self_attn.q_proj"
    assert lora.split_lora_key(f"{m}.lora_A.weight") == (m, "A")
    assert lora.split_lora_key(f"{m}.lora_B.default.weight") == (m, "B")
    assert lora.split_lora_key(f"{m}.base_layer.weight") is None
    for bad in (f"{m}.lora_B.bias", f"{m}.lora_magnitude_vector", "x.lora_embedding_A"):
        with pytest.raises(ValueError, match="unsupported PEFT tensor"):
            lora.split_lora_key(bad)


def test_plain_peft_config_is_accepted_with_defaults():
    cfg = lora.check_adapter_config(_plain_config(use_rslora=True))
    assert cfg == {"r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {},
                   "alpha_pattern": {}}


@pytest.mark.parametrize("changes, field", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    ({"lora_bias": True}, "lora_bias"),
    ({"trainable_token_indices": [5]}, "trainable_token_indices"),
    ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"init_lora_weights": "olora"}, "init_lora_weights"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 0}, "r"),
    ({"lora_alpha": float("nan")}, "lora_alpha"),
    ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern.q_proj"),
    ({"a_future_peft_field": {"on": True}}, "a_future_peft_field"),
])
def test_adapter_config_refusals_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"adapter_config.json: field '{field}'"):
        lora.check_adapter_config(_plain_config(**changes))


def test_codi_bf16_checkpoint_merges_in_fp32_not_rounded_to_bf16(tmp_path, smollm2_dir):
    """CODI keeps its base weights in bf16; served in fp32 the merged weight is the exact
    float32 sum, not that sum rounded back to bf16 (the old ``.to(w.dtype)``)."""
    from safetensors.torch import load_file, save_file

    from latentserve.bench.baseline.latent_models import write_upstream_codi
    from latentserve.latent.convert import convert_codi
    from latentserve.latent.load import load_model

    base_dir, ckpt = write_upstream_codi(tmp_path, "llama", "safetensors")
    sd = {k: v.bfloat16() for k, v in load_file(ckpt).items()}
    save_file(sd, str(ckpt))
    model, _ = load_model(convert_codi(base_dir, ckpt, tmp_path / "model", lora_alpha=16.0),
                          torch.float32, "cpu")
    m = "codi.base_model.model.model.layers.0.self_attn.q_proj"
    w, a, b = (sd[f"{m}.{k}"] for k in ("base_layer.weight", "lora_A.default.weight",
                                         "lora_B.default.weight"))
    want = w.float() + (b.float() @ a.float()) * (16.0 / a.shape[0])
    got = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(got, want)
    assert not torch.equal(got, want.bfloat16().float())


@pytest.mark.parametrize("model_type", ["huginn_raven", "ouro", "gpt2"])
def test_adapter_over_a_base_it_cannot_merge_into_is_refused_by_name(tmp_path, model_type):
    """An adapter whose base is a recurrent-depth model (whose config transformers cannot
    read) or GPT-2 gets our message naming the model types adapters merge into, before any
    weight is read."""
    from safetensors.torch import save_file

    from latentserve.latent.load import load_model

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": model_type}))
    (adapter / "adapter_config.json").write_text(json.dumps(
        _plain_config(base_model_name_or_path=str(base))))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(4, 8), key.format("B"): torch.zeros(8, 4)},
              str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=rf"LoRA adapters are merged into .*model_type "
                                         rf"'{model_type}'"):
        load_model(adapter, torch.float32, "cpu")
