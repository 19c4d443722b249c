"""PCCoT adapters as upstream's ``run_ccot.py`` saves them (PEFT LoRA + trainable tokens for
the new special tokens, tiny GPT-2 and Llama bases trained a few steps and saved with
``save_pretrained``), and as older setups save them (``modules_to_save`` on the embedding):
``latentserve convert pccot`` folds the trained rows into the embedding, and the converted
directory serves as the PEFT model does (``bench.baseline.loop_reference``, unmerged LoRA): tokens
exact and first-answer logits within 1e-5 in float32, one batch of mixed budgets, prefix
cache cold and warm. Every converter loads what it wrote before moving it into ``--out`` and
refuses, leaving ``--out`` untouched, a result that would not serve."""

import json

import pytest
import torch

from latentserve.bench.baseline.loop_reference import load_pccot_reference
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.latent.loop_convert import convert_pccot
from tests.support.loop_reference import reference_generate_loop
from tests.support.parity import run_budget_batch, shared_prefix_prompts

# (base, embedding form, use_projection, base overrides)
KINDS = {"gpt2-tokens": ("gpt2", "trainable_tokens", False, {}),
         "llama-tokens-prj": ("llama", "trainable_tokens", True, {}),
         "llama-modules-to-save": ("llama", "modules_to_save", False, {}),
         # rows to spare for the new tokens: no resize, so PEFT saves only the deltas
         "gpt2-tokens-no-resize": ("gpt2", "trainable_tokens", False,
                                   {"vocab_size": 49152 + 16})}
BUDGETS = (0, 1, 3)
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, smollm2_dir):
    """kind -> (base dir, adapter dir, converted model dir)."""
    pytest.importorskip("peft")  # not at import: peft loads triton before tests/unit's interpreter
    from latentserve.bench.baseline.loop_models import write_upstream_pccot

    root = tmp_path_factory.mktemp("pccot-forms")
    out = {}
    for kind, (base, form, prj, overrides) in KINDS.items():
        b, a = write_upstream_pccot(root / kind, base, block_size=3, iterations=2,
                                    use_projection=prj, embedding=form, **overrides)
        out[kind] = (b, a, convert_pccot(b, a, root / kind / "model"))
    return out


def _adapter_tensors(adapter_dir) -> dict:
    from safetensors.torch import load_file

    return {k.removeprefix("base_model.model."): v
            for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}


def test_upstream_form_saves_trained_rows_apart_from_the_base_rows(upstream):
    """The fixture is what run_ccot.py writes: trainable_token_indices names the special
    tokens, and their trained rows differ from the resized base rows saved beside them (a
    converter that kept the base rows would serve other embeddings)."""
    _, adapter, _ = upstream["gpt2-tokens"]
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    args = json.loads((adapter / "pccot_args.json").read_text())
    ids = cfg["trainable_token_indices"]["wte"]
    assert ids[:3] == [args["bot_token_id"], args["eot_token_id"], args["latent_token_id"]]
    t = _adapter_tensors(adapter)
    base = t["transformer.wte.token_adapter.base_layer.weight"]
    delta = t["transformer.wte.token_adapter.trainable_tokens_delta"]
    assert delta.shape == (len(ids), base.shape[1])
    assert (delta - base[ids]).abs().amax(dim=1).min() > 1e-3


def test_convert_folds_the_trainable_token_rows_into_the_embedding(upstream):
    from safetensors.torch import load_file

    _, adapter, model = upstream["gpt2-tokens"]
    t = _adapter_tensors(adapter)
    base = t["transformer.wte.token_adapter.base_layer.weight"]
    delta = t["transformer.wte.token_adapter.trainable_tokens_delta"]
    ids = json.loads((adapter / "adapter_config.json").read_text())[
        "trainable_token_indices"]["wte"]
    written = load_file(str(model / "adapter_model.safetensors"))
    assert not [k for k in written if "token_adapter" in k or k.startswith("lm_head.")]
    expected = base.clone()
    expected[ids] = delta
    assert torch.equal(written["transformer.wte.weight"], expected)
    assert json.loads((model / "config.json").read_text())["vocab_size"] == base.shape[0]


def test_adapter_without_resized_rows_takes_the_base_rows(upstream):
    """Without a resize PEFT saves only the trained rows; the converter replaces them in the
    base's embedding."""
    from safetensors.torch import load_file

    base, adapter, model = upstream["gpt2-tokens-no-resize"]
    t = _adapter_tensors(adapter)
    assert not [k for k in t if "base_layer" in k or k.endswith("wte.weight")]
    delta = t["transformer.wte.token_adapter.trainable_tokens_delta"]
    ids = json.loads((adapter / "adapter_config.json").read_text())[
        "trainable_token_indices"]["wte"]
    expected = load_file(str(base / "model.safetensors"))["transformer.wte.weight"].clone()
    expected[ids] = delta
    written = load_file(str(model / "adapter_model.safetensors"))
    assert torch.equal(written["transformer.wte.weight"], expected)


def test_modules_to_save_on_a_tied_llama_serves_untied(upstream):
    """PEFT trains the modules_to_save copy of a tied embedding and leaves lm_head at the
    original rows: the converted config unties them."""
    _, _, model = upstream["llama-modules-to-save"]
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is False


def _requests():
    prompts = shared_prefix_prompts()[:4]
    return [(p, BUDGETS[i % len(BUDGETS)]) for i, p in enumerate(prompts)] + \
        [(prompts[0], b) for b in BUDGETS]


@pytest.mark.parametrize("kind", list(KINDS))
def test_converted_upstream_adapter_serves_as_the_peft_model(kind, upstream):
    base, adapter, model = upstream[kind]
    ref = load_pccot_reference(str(base), str(adapter))
    reqs = _requests()
    expected = [reference_generate_loop(ref, p, b, MAX_TOKENS) for p, b in reqs]
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32"))
    for warm in (False, True):
        served = run_budget_batch(engine, reqs, MAX_TOKENS)
        for (ans, logits, _cached), (ref_ans, ref_logits) in zip(served, expected):
            assert ans == ref_ans
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        if warm:
            assert sum(c for _, _, c in run_budget_batch(engine, reqs[:1], MAX_TOKENS)) > 0
    engine.cache.check_idle()


def test_gpt2_embedding_trained_apart_from_its_tied_head_is_refused(upstream, tmp_path):
    """modules_to_save on GPT-2's wte: PEFT's lm_head keeps the original rows, which the
    engine's always-tied GPT-2 cannot serve; refused naming why, nothing written."""
    from latentserve.bench.baseline.loop_models import write_upstream_pccot

    base, _, _ = upstream["gpt2-tokens"]
    _, adapter = write_upstream_pccot(tmp_path, "gpt2", block_size=3, iterations=2,
                                      base_dir=base, embedding="modules_to_save")
    with pytest.raises(ValueError, match="lm_head rows differ from its embedding"):
        convert_pccot(base, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_directory_that_would_not_serve_before_writing(upstream, tmp_path):
    """A token id the embedding cannot hold: the conversion loads its result, refuses it
    with the loader's error, and leaves --out (here an earlier conversion) as it was."""
    base, adapter, _ = upstream["gpt2-tokens"]
    broken = tmp_path / "adapter"
    broken.mkdir()
    for f in adapter.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    args = json.loads((broken / "pccot_args.json").read_text())
    rows = json.loads((broken / "config.json").read_text())["vocab_size"]
    (broken / "pccot_args.json").write_text(json.dumps({**args, "bot_token_id": rows + 7}))
    out = tmp_path / "out"
    convert_pccot(base, adapter, out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with pytest.raises(ValueError, match=r"would not serve: .*do not fit the embedding"):
        convert_pccot(base, broken, out, overwrite=True)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
