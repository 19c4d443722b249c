"""Upstream checkpoint forms on CUDA (run on the H200 with ``scripts/gpu_tests.sh``), served in
fp32 and checked against their eager references on the same GPU, in one batch per round, with
the prefix cache cold and then warm (CODI, PCCoT: every warm prompt hits the cache, never past
its latent start):

* CODI (GPT-2, Llama) with its base weights in bf16 and its LoRA and ``prj`` in float32,
  converted: the engine's default CUDA path (Triton attention, CUDA graphs), budgets 0 to 8
  in one batch, gives the greedy answers of ``bench.baseline.latent_reference`` (upstream's loop,
  unmerged LoRA over the same weights) and first-answer logits within 1e-4.
* PCCoT adapters saved as upstream ``run_ccot.py`` saves them (PEFT LoRA + trainable tokens;
  GPT-2, Llama with ``prj``, GPT-2 whose embedding needed no resize), converted: the default
  CUDA path, budgets 0, 1, 3, gives the greedy answers of the PEFT model
  (``bench.baseline.loop_reference``) and first-answer logits within 1e-4.
* Huginn with a zero initial state, the ``"engine"`` and ``"upstream"`` exit semantics mixed
  in one batch (the torch attention backend: ``"upstream"`` leaves keys out per slot, which
  the Triton backend cannot): the tokens of ``HuginnReference``, every sampled step's logits
  within 1e-5, the iterations of every token equal; warm, an ``"engine"`` prompt comes from
  the cache up to its last token and an ``"upstream"`` one (its K/V depends on its exit
  block) never."""

from collections import Counter

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.parity import run_budget_batch, shared_prefix_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"


def _serve_cold_and_warm(engine, reqs, expected, max_tokens, atol):
    """Run ``reqs`` (``[(prompt, budget)]``) twice; both rounds give ``expected``'s answers
    and first-answer logits within ``atol``; the warm round's prompts come from the cache up
    to the latent start at most."""
    start = len(engine.latent_spec.start_ids)
    for rnd in ("cold", "warm"):
        served = run_budget_batch(engine, reqs, max_tokens)
        for i, ((ans, logits, cached), (want, want_logits), (prompt, b)) in enumerate(
                zip(served, expected, reqs)):
            assert ans == want, f"{rnd} request {i} (budget {b}): {ans} != reference {want}"
            torch.testing.assert_close(logits, want_logits, atol=atol, rtol=0,
                                       msg=f"{rnd} request {i} (budget {b})")
            if rnd == "warm":
                assert 0 < cached <= len(prompt) + start, f"request {i}: {cached} cached"
        engine.cache.check_idle()
    assert engine.runner.num_graph_steps > 0


@pytest.mark.parametrize("base", ["gpt2", "llama"])
def test_codi_bf16_base_checkpoint_matches_reference(base, tmp_path, smollm2_dir):
    pytest.importorskip("peft")  # not at import: peft loads triton
    from safetensors.torch import load_file, save_file

    from latentserve.bench.baseline.latent_models import write_upstream_codi
    from latentserve.latent.convert import convert_codi
    from tests.support.latent_reference import reference_generate

    base_dir, ckpt = write_upstream_codi(tmp_path, base, "safetensors")
    sd = {k: v.bfloat16() if k.startswith("codi.") and ".lora_" not in k else v
          for k, v in load_file(ckpt).items()}
    save_file(sd, str(ckpt))
    model = convert_codi(base_dir, ckpt, tmp_path / "model", lora_alpha=16.0)
    prompts = shared_prefix_prompts()
    reqs = [(p, (0, 1, 3, 6, 8)[i % 5]) for i, p in enumerate(prompts)]
    reqs += [(prompts[0], b) for b in (0, 6, 8)]
    expected = [reference_generate(model, p, b, 10, device=DEVICE) for p, b in reqs]
    engine = LLMEngine(EngineConfig(model=str(model), device=DEVICE, dtype="float32",
                                    kv_slots=8192))
    _serve_cold_and_warm(engine, reqs, expected, 10, atol=1e-4)


# (base, use_projection, base overrides); the last has rows to spare: PEFT saves only deltas
PCCOT_FORMS = {"gpt2-tokens": ("gpt2", False, {}), "llama-tokens-prj": ("llama", True, {}),
               "gpt2-tokens-no-resize": ("gpt2", False, {"vocab_size": 49152 + 16})}


@pytest.mark.parametrize("kind", list(PCCOT_FORMS))
def test_pccot_trainable_token_adapter_matches_peft_model(kind, tmp_path, smollm2_dir):
    pytest.importorskip("peft")
    from latentserve.bench.baseline.loop_models import write_upstream_pccot
    from latentserve.bench.baseline.loop_reference import load_pccot_reference
    from latentserve.latent.loop_convert import convert_pccot
    from tests.support.loop_reference import reference_generate_loop

    base, prj, overrides = PCCOT_FORMS[kind]
    base_dir, adapter = write_upstream_pccot(tmp_path, base, block_size=3, iterations=2,
                                             use_projection=prj, embedding="trainable_tokens",
                                             **overrides)
    model = convert_pccot(base_dir, adapter, tmp_path / "model")
    ref = load_pccot_reference(str(base_dir), str(adapter), DEVICE)
    prompts = shared_prefix_prompts()[:4]
    reqs = [(p, (0, 1, 3)[i % 3]) for i, p in enumerate(prompts)]
    reqs += [(prompts[0], b) for b in (0, 1, 3)]
    expected = [reference_generate_loop(ref, p, b, 5) for p, b in reqs]
    engine = LLMEngine(EngineConfig(model=str(model), device=DEVICE, dtype="float32",
                                    kv_slots=8192))
    _serve_cold_and_warm(engine, reqs, expected, 5, atol=1e-4)


MIXED = ["engine", "upstream"] * 3


@pytest.mark.parametrize("semantics", [MIXED, MIXED[::-1]], ids=["eu", "ue"])
def test_huginn_mixed_exit_semantics_match_reference(semantics, tmp_path):
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from tests.support.recurrent_reference import HuginnReference
    from tests.support.recurrent_requests import HUGINN_EXITS, RECURRENT_PROMPTS
    from tests.support.tp_parity import run_requests

    huginn = write_huginn(tmp_path / "huginn", init_scale=0)
    ref = HuginnReference(huginn, device=DEVICE)
    expected = [ref.generate(p, 8, d, c, t, m, e, semantics=s)
                for p, (d, c, t, m, e), s in zip(RECURRENT_PROMPTS, HUGINN_EXITS, semantics)]
    engine = LLMEngine(EngineConfig(model=str(huginn), device=DEVICE, dtype="float32",
                                    attention_backend="torch", kv_slots=4096,
                                    max_model_len=256))
    reqs = [(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, latent_budget=d,
                               exit_criterion=c, exit_threshold=t, exit_min_steps=m,
                               exit_check_every=e, exit_semantics=s, return_latent_trace=True))
            for p, (d, c, t, m, e), s in zip(RECURRENT_PROMPTS, HUGINN_EXITS, semantics)]
    for rnd in ("cold", "warm"):
        for i, ((toks, logits, final), r, p, s) in enumerate(
                zip(run_requests(engine, reqs), expected, RECURRENT_PROMPTS, semantics)):
            assert toks == r["tokens"], f"{rnd} request {i}: {toks} != reference {r['tokens']}"
            assert len(logits) == len(r["logits"])
            for step, (a, b) in enumerate(zip(logits, r["logits"])):
                torch.testing.assert_close(a, b.cpu(), atol=1e-5, rtol=0,
                                           msg=f"{rnd} request {i} step {step}")
            assert [e["depth"] for e in final.latent_trace] == r["iterations"], f"request {i}"
            assert final.recurrence["histogram"] == dict(Counter(r["iterations"]))
            if rnd == "warm":
                assert final.num_cached_tokens == (len(p) - 1 if s == "engine" else 0)
