"""Compression-head training on CUDA (run on the H200 with ``scripts/gpu_tests.sh``): on a
tiny random Llama, ``train-head sft --device cuda`` lowers every loss term and writes a
bundle the CUDA engine serves; one GRPO step on CUDA (rollouts through the engine with CUDA
graphs) changes only the head's mu network."""

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rows(n=16):
    return [{"question": f"Sam has {a} coins and finds {a + 3}. How many coins?",
             "answer": f"{a}+{a + 3} = <<{a}+{a + 3}={2 * a + 3}>>{2 * a + 3} coins.\n"
                       f"#### {2 * a + 3}"} for a in range(2, 2 + n)]


def test_sft_then_grpo_on_cuda(tmp_path, smollm2_dir):
    """The rollout engine's pool is given (``kv_slots``): sized from memory it would count
    what other processes hold on the GPU (``engine/kv_sizing.py``)."""
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.cli import main
    from latentserve.latent.bundle import read_bundle
    from latentserve.train.grpo import GRPOConfig, train_grpo

    model = save_tiny(tmp_path / "m", "llama", num_hidden_layers=3)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    sft = tmp_path / "sft.safetensors"
    assert main(["train-head", "sft", "--device", "cuda", "--model", str(model), "--data",
                 str(data), "--steps", "40", "--batch-size", "64", "--latent-dim", "16",
                 "--source-layer", "1", "--lr", "3e-3", "--no-progress",
                 "--out", str(sft)]) == 0
    log = json.loads((tmp_path / "sft.safetensors.log.json").read_text())
    for term in ("loss", "soft_mse", "recon", "stop"):
        assert log["loss_after"][term] < log["loss_before"][term], term

    out = tmp_path / "grpo.safetensors"
    glog = train_grpo(GRPOConfig(bundle=str(sft), out=str(out), model=str(model),
                                 data=str(data), steps=1, questions_per_step=2, group_size=4,
                                 max_latent=4, answer_tokens=4, lr=1e-2, device="cuda",
                                 kv_slots=4096, progress=False),
                      reward_fn=lambda text, gold, stats: float(stats["actions"][0][1][0]))
    assert glog["history"][0]["latent_steps"] > 0
    before, after = read_bundle(sft), read_bundle(out)
    changed = {k for k, v in after.reasoning_head.items()
               if not torch.equal(v, before.reasoning_head[k])}
    assert changed and all(k.startswith("net.") for k in changed)
    assert all(torch.equal(v, before.decoder[k]) for k, v in after.decoder.items())
