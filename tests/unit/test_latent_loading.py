"""Loading feedback latent checkpoints (COCONUT / CODI / SIM-CoT forms): key stripping, the
LoRA merge against PEFT, converter round trips, latent_config validation, the reference."""

import json
import shutil

import pytest
import torch

from latentserve.bench.baseline import latent_models as lm
from latentserve.bench.baseline.latent_reference import load_reference
from latentserve.cli.convert import add_args as add_convert_args
from latentserve.cli.convert import run as convert_main
from latentserve.latent import feedback as fb
from latentserve.latent.convert import convert_coconut
from tests.support.latent_reference import reference_generate

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def read_latent_config(model_dir) -> dict | None:
    """The validated ``model_dir/latent_config.json`` or None; ValueError naming the field."""
    cfg = fb.read_config_json(model_dir)
    return None if cfg is None else fb.validate_latent_config(cfg, model_dir)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("latent")
    return {k: lm.save_latent_tiny(root / k, k) for k in lm.LATENT_KINDS}


def _hf_from_prepared(model_dir):
    """An HF CausalLM holding ``prepare_latent_weights``' output (HF names and layouts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = read_latent_config(model_dir)
    weights, hf_cfg = fb.prepare_latent_weights(
        model_dir, AutoConfig.from_pretrained(model_dir, local_files_only=True), cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval(), cfg


def test_strip_keys_coconut_codi_and_simcot_extras():
    t = torch.zeros(1)
    sd = {"module.base_causallm.transformer.wte.weight": t, "base_causallm.lm_head.weight": t,
          "expainable_llm.lm_head.weight": t}
    assert set(fb.strip_keys(sd, "coconut")) == {"transformer.wte.weight", "lm_head.weight"}
    assert set(fb.strip_keys({"model.norm.weight": t}, "coconut")) == {"model.norm.weight"}
    sd = {"codi.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": t,
          "codi.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": t,
          "prj.1.weight": t, "decoder.lm_head.weight": t}
    assert set(fb.strip_keys(sd, "codi")) == {
        "model.layers.0.self_attn.q_proj.base_layer.weight",
        "model.layers.0.self_attn.q_proj.lora_A.default.weight"}


@pytest.mark.parametrize("kind", ["codi-gpt2", "codi-llama"])
def test_lora_merge_equals_peft(kind, dirs):
    ours, _ = _hf_from_prepared(dirs[kind])
    peft_model, _, _ = load_reference(str(dirs[kind]))  # peft's unmerged LoRA forward
    ids = torch.tensor([PROMPT + [49153, 49154]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, peft_model(ids).logits, atol=2e-5, rtol=0)
    # Our merge equals PEFT's own merge, and changes the weights (lora_B is nonzero).
    import copy

    from peft import PeftModel

    assert isinstance(peft_model, PeftModel)
    peft_merged = copy.deepcopy(peft_model).merge_and_unload()
    for name, p in peft_merged.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], p, atol=1e-6, rtol=0, msg=name)
    base = fb.strip_keys(fb.read_state_dict(dirs[kind] / read_latent_config(dirs[kind])
                                            ["checkpoint"]), "codi")
    w = next(k for k in base if k.endswith("base_layer.weight"))
    assert not torch.equal(base[w], ours.state_dict()[w.replace(".base_layer", "")])


def test_engine_model_loads_prepared_weights(dirs):
    from latentserve.latent.load import load_model

    for kind, d in dirs.items():
        model, hf_cfg = load_model(d, torch.float32, "cpu")
        assert hf_cfg.vocab_size == 49155
        spec = model.latent_spec
        assert spec.kind == "feedback" and spec.family == kind.split("-")[0]
        if kind.startswith("coconut"):
            assert (spec.start_ids, spec.end_ids, spec.latent_id) == ((49152,), (49153,), 49154)
            assert isinstance(model.latent_feedback, torch.nn.Identity)
        else:
            assert (spec.start_ids, spec.end_ids, spec.latent_id) == ((49153,), (49154,), 49152)
            _, _, prj = load_reference(str(d))
            h = torch.randn(4, 64)
            torch.testing.assert_close(model.latent_feedback(h), prj(h), atol=1e-6, rtol=0)


def test_coconut_tokenizer_gets_the_three_tokens_in_order(dirs):
    from latentserve.models.checkpoint import load_tokenizer

    tok = load_tokenizer(dirs["coconut-gpt2"])
    assert tok.convert_tokens_to_ids(["<|start-latent|>", "<|end-latent|>", "<|latent|>"]) == \
        [49152, 49153, 49154]
    assert len(load_tokenizer(dirs["codi-gpt2"])) == 49152  # CODI ids are raw rows only


def test_hand_written_directory_equals_converted(dirs, tmp_path):
    """The manual layout of docs/models.md (base files + upstream file + latent_config.json)
    loads the same weights as the converter's output."""
    for kind in ("coconut-llama", "codi-gpt2"):
        src, root = dirs[kind], dirs[kind].parent
        d = tmp_path / kind
        shutil.copytree(root / "base", d)
        (d / "model.safetensors").rename(d / "base-weights.safetensors")
        ckpt = next((root / "upstream").iterdir())
        shutil.copy(ckpt, d / ckpt.name)
        cfg = json.loads((src / "latent_config.json").read_text())
        cfg = {k: cfg[k] for k in ("family", "tokens", "checkpoint", "lora", "prj") if k in cfg}
        (d / "latent_config.json").write_text(json.dumps(cfg))
        from transformers import AutoConfig

        a, _ = fb.prepare_latent_weights(d, AutoConfig.from_pretrained(d), read_latent_config(d))
        b, _ = fb.prepare_latent_weights(src, AutoConfig.from_pretrained(src),
                                         read_latent_config(src))
        a, b = dict(a), dict(b)
        assert set(a) == set(b)
        for k in b:
            torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_converter_cli_and_base_weight_fallback(dirs, tmp_path):
    """A checkpoint lacking base weights gets them from base.safetensors (upstream loads the
    checkpoint over the pretrained base); the CLI entry point writes the same directory."""
    import argparse

    root = dirs["coconut-gpt2"].parent
    sd = torch.load(root / "upstream" / "checkpoint_7", weights_only=True)
    dropped = "base_causallm.transformer.h.1.mlp.c_fc.bias"
    sd.pop(dropped)
    torch.save(sd, tmp_path / "checkpoint_3")
    p = argparse.ArgumentParser()
    add_convert_args(p)
    args = p.parse_args(["coconut", "--base", str(root / "base"), "--checkpoint",
                         str(tmp_path / "checkpoint_3"), "--out", str(tmp_path / "m"),
                         "--default-budget", "4", "--variant", "sim-cot"])
    assert convert_main(args) == 0
    cfg = read_latent_config(tmp_path / "m")
    assert (cfg["default_budget"], cfg["variant"], cfg["checkpoint"]) == (4, "sim-cot",
                                                                          "checkpoint_3")
    assert (tmp_path / "m" / "base.safetensors").is_file()
    ours, _ = _hf_from_prepared(tmp_path / "m")
    ref, _ = _hf_from_prepared(dirs["coconut-gpt2"])
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, atol=0, rtol=0, msg=k)
    with pytest.raises(ValueError, match="not empty"):
        convert_coconut(root / "base", tmp_path / "checkpoint_3", tmp_path / "m")


def test_codi_converter_rejects_wrong_base_and_keep_eos_spec(dirs, tmp_path):
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.latent.convert import convert_codi

    root = dirs["codi-gpt2"].parent
    ckpt = root / "upstream" / "model.safetensors"
    other = save_tiny(tmp_path / "other", "gpt2", vocab_size=1000)
    with pytest.raises(ValueError, match="embedding rows"):
        convert_codi(other, ckpt, tmp_path / "bad")
    d = convert_codi(root / "base", ckpt, tmp_path / "keep", remove_eos=False, symlink=True)
    spec = fb.latent_spec_from_config(read_latent_config(d))
    assert (spec.start_ids, spec.end_ids) == ((2, 49153), (49154, 2))
    assert (d / "model.safetensors").is_symlink()


BAD = [
    (lambda c: c.update(family="pccot"), "'family'"),
    (lambda c: c.update(default_budget=-1), "'default_budget'"),
    (lambda c: c.update(default_budget=9, max_budget=8), "'default_budget'"),
    (lambda c: c["tokens"].pop("bot"), "'tokens.bot'"),
    (lambda c: c["tokens"].update(eot="x"), "'tokens.eot'"),
    (lambda c: c["tokens"].update(eot=49153), "'tokens'"),
    (lambda c: c.update(checkpoint="missing.bin"), "'checkpoint'"),
    (lambda c: c.update(checkpoint="../x"), "'checkpoint'"),
    (lambda c: c["lora"].update(alpha=0), "'lora.alpha'"),
    (lambda c: c["lora"].update(alpha=float("nan")), "'lora.alpha'"),  # NaN weights at load
    (lambda c: c["lora"].update(alpha=float("inf")), "'lora.alpha'"),
    (lambda c: c["prj"].update(eps=float("nan")), "'prj.eps'"),
    (lambda c: c["lora"].pop("r"), "'lora.r'"),
    (lambda c: c["prj"].update(dim="48"), "'prj.dim'"),
    (lambda c: c.update(remove_eos="yes"), "'remove_eos'"),
    (lambda c: (c.update(remove_eos=False), c["tokens"].pop("eos")), "'tokens.eos'"),
    (lambda c: c.update(vocab_size=49154), "'tokens'"),
    (lambda c: c.update(format_version=2), "'format_version'"),
]


@pytest.mark.parametrize("mutate,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_latent_config_names_the_field(mutate, field, dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(dirs["codi-gpt2"], d)
    cfg = json.loads((d / "latent_config.json").read_text())
    mutate(cfg)
    (d / "latent_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        read_latent_config(d)


def test_config_disagreeing_with_checkpoint_names_the_field(dirs, tmp_path):
    from transformers import AutoConfig

    d = tmp_path / "m"
    shutil.copytree(dirs["codi-gpt2"], d)
    cfg = read_latent_config(d)
    with pytest.raises(ValueError, match="'lora'"):
        fb.prepare_latent_weights(d, AutoConfig.from_pretrained(d), {**cfg, "lora": None})
    with pytest.raises(ValueError, match="'lora.r'"):
        fb.prepare_latent_weights(d, AutoConfig.from_pretrained(d),
                                  {**cfg, "lora": {**cfg["lora"], "r": 4}})
    with pytest.raises(ValueError, match="'vocab_size'"):
        fb.prepare_latent_weights(d, AutoConfig.from_pretrained(d), {**cfg, "vocab_size": 50000})
    with pytest.raises(ValueError, match="'prj'"):
        fb.attach_latent(torch.nn.Module(), d, AutoConfig.from_pretrained(d),
                         {**cfg, "prj": {**cfg["prj"], "dim": 32}}, torch.float32, "cpu")


def test_no_latent_config_means_none(tmp_path):
    assert read_latent_config(tmp_path) is None


# ----------------------------------------------------------------------------- reference

def _recompute_loop(model, cfg, prompt, budget, max_tokens, feedback):
    """Upstream COCONUT ``generate``'s shape: no KV cache, the whole embedded sequence is
    re-run for every position (independent of the cached reference loop)."""
    from latentserve.bench.baseline.latent_reference import _wrap_ids

    emb = model.get_input_embeddings()
    start, end = _wrap_ids(cfg)
    seq = emb(torch.tensor(prompt + start))

    def last(seq):
        out = model(inputs_embeds=seq[None], output_hidden_states=True)
        return out.logits[0, -1], out.hidden_states[-1][0, -1]

    for _ in range(budget):
        seq = torch.cat([seq, feedback(last(seq)[1])[None]])
    seq = torch.cat([seq, emb(torch.tensor(end))])
    toks = []
    for _ in range(max_tokens):
        logits = last(seq)[0]
        tok = int((logits[:-1] if cfg["family"] == "codi" else logits).argmax())
        toks.append(tok)
        if tok == 2:
            break
        seq = torch.cat([seq, emb(torch.tensor([tok]))])
    return toks


@pytest.mark.parametrize("kind", ["coconut-gpt2", "coconut-llama", "codi-gpt2", "codi-llama"])
def test_reference_equals_no_cache_recompute(kind, dirs):
    model, cfg, feedback = load_reference(str(dirs[kind]))
    with torch.no_grad():
        for budget in (0, 2, 5):
            got, _ = reference_generate(dirs[kind], PROMPT, budget, 6)
            assert got == _recompute_loop(model, cfg, PROMPT, budget, 6, feedback), budget


def test_reference_budget0_equals_hf_generate(dirs):
    model, _, _ = load_reference(str(dirs["coconut-gpt2"]))
    ids = torch.tensor([PROMPT + [49152, 49153]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=6, pad_token_id=0)
    got, _ = reference_generate(dirs["coconut-gpt2"], PROMPT, 0, 6)
    assert got == out[0, ids.shape[1]:].tolist()


def test_reference_without_peft_equals_with_peft(dirs, monkeypatch):
    import sys

    d = dirs["codi-gpt2"]
    with_peft = [reference_generate(d, PROMPT, b, 6) for b in (0, 3)]
    load_reference.cache_clear()
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    try:
        without = [reference_generate(d, PROMPT, b, 6) for b in (0, 3)]
    finally:
        load_reference.cache_clear()
    for (a, la), (b, lb) in zip(with_peft, without):
        assert a == b
        torch.testing.assert_close(la, lb, atol=2e-5, rtol=0)


def test_refused_conversion_creates_no_out_dir(dirs, tmp_path):
    """docs/models.md: bad flags and a wrong --base are refused before anything is written
    to --out (an empty --out directory was left behind)."""
    from latentserve.latent.convert import convert_coconut, convert_codi

    root = dirs["codi-gpt2"].parent
    ckpt = root / "upstream" / "model.safetensors"
    for call in (lambda out: convert_codi(root / "base", ckpt, out, lora_alpha=float("nan")),
                 lambda out: convert_codi(root / "base", ckpt, out, default_budget=-1),
                 lambda out: convert_coconut(dirs["coconut-llama"].parent / "base",
                                             dirs["coconut-gpt2"].parent / "upstream"
                                             / "checkpoint_7", out)):
        out = tmp_path / "out"
        with pytest.raises(ValueError):
            call(out)
        assert not out.exists()


def test_converter_refuses_a_result_the_loader_fails_on_and_leaves_out_as_it_was(
        dirs, tmp_path, monkeypatch):
    """Every converter loads what it wrote (latent.load.load_model) before moving it into
    --out; a failure there is refused with the loader's error and writes nothing."""
    from latentserve.latent import convert

    root = dirs["coconut-gpt2"].parent
    ckpt = root / "upstream" / "checkpoint_7"
    seen = []

    def failing_load(model_dir, *a, **kw):
        seen.append(sorted(p.name for p in model_dir.iterdir()))
        raise KeyError("unexpected weight 'transformer.x'")

    monkeypatch.setattr(convert, "load_model", failing_load)
    with pytest.raises(ValueError, match="would not serve: KeyError: .*unexpected weight"):
        convert_coconut(root / "base", ckpt, tmp_path / "out")
    assert "latent_config.json" in seen[0]  # the complete directory was loaded
    assert list(tmp_path.iterdir()) == []  # no --out, no temporary directory left


def test_in_place_conversion_keeps_the_checkpoint_and_stale_weights_are_refused(dirs,
                                                                                tmp_path):
    """A checkpoint inside --out (converted in place, --force) stays the same regular file;
    a weight file in --out that the conversion does not write is refused (the loader would
    read it too)."""
    root = dirs["coconut-gpt2"].parent
    out = tmp_path / "m"
    out.mkdir()
    shutil.copy2(root / "upstream" / "checkpoint_7", out / "checkpoint_7")
    data = (out / "checkpoint_7").read_bytes()
    convert_coconut(root / "base", out / "checkpoint_7", out, overwrite=True)
    assert not (out / "checkpoint_7").is_symlink()
    assert (out / "checkpoint_7").read_bytes() == data
    assert read_latent_config(out)["checkpoint"] == "checkpoint_7"
    (out / "old.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds \['old.safetensors'\]"):
        convert_coconut(root / "base", out / "checkpoint_7", out, overwrite=True)
