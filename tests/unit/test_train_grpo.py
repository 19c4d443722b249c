"""GRPO of a compression head (train/grpo.py) and the engine's policy-sampling hook
(latent/head_loop.set_policy_sampling) on a tiny random Llama with a random bundle:
sampled latents are what the engine injects (the recorded anchors equal the HF hidden
states of the sequence fed with ``decode(z)``), group-relative advantages, the REINFORCE
step moves mu towards a rewarded z, and a GRPO step changes only the head's mu network,
leaving the backbone, stop head, decoder and target_proj as they were and no KV slot held."""

import json
import statistics

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.latent.head_loop import set_policy_sampling
from latentserve.sampling_params import SamplingParams
from tests.support.head_models import save_head_model


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, smollm2_dir):
    return save_head_model(tmp_path_factory.mktemp("grpo") / "m", source_layer=1, seed=5)


def _run_one(engine, prompt, **controls):
    engine.add_request(f"r{engine._arrivals}", prompt, SamplingParams(
        max_tokens=12, temperature=0.0, min_output_tokens=0, **controls))
    stats = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            stats = o.latent_stats if o.finished else stats
    return stats


def _slots_all_back(engine):
    c = engine.cache
    return c.allocator.num_free + c.radix.total_size() == c.allocator.num_total


def test_sampled_latents_are_injected_and_recorded(head_dir):
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineConfig(model=str(head_dir)))
    head = engine.runner.model.latent_head
    prompt = engine.tokenizer.encode("Three plus four is")
    assert "actions" not in _run_one(engine, prompt, max_latent=3, use_stop=False)

    set_policy_sampling(head, 0.5)
    torch.manual_seed(0)
    stats = _run_one(engine, prompt, max_latent=3, use_stop=False)
    acts = stats["actions"]
    assert len(acts) == stats["steps"] == 3
    anchors = torch.stack([a for a, _ in acts])
    z = torch.stack([z for _, z in acts])
    with torch.no_grad():
        mu = head.encode(anchors)
    assert (z - mu).abs().max() > 0.05  # sampled, not mu

    # Feed prompt + opening, then decode(z_1), decode(z_2) through HF: the source-layer
    # hidden at the last prompt position and at each latent position are the anchors.
    hf = AutoModelForCausalLM.from_pretrained(head_dir, dtype=torch.float32).eval()
    src = head.config.source_layer
    ids = torch.tensor(prompt + list(engine.latent_spec.start_ids))
    with torch.no_grad():
        emb = hf.get_input_embeddings()(ids)
        vecs = head.decode(z[:2])
        hs = hf(inputs_embeds=torch.cat([emb, vecs])[None],
                output_hidden_states=True).hidden_states[src + 1][0]
    torch.testing.assert_close(anchors, hs[-3:], atol=1e-4, rtol=1e-4)

    set_policy_sampling(head, None)
    assert "actions" not in _run_one(engine, prompt, max_latent=3, use_stop=False)
    with pytest.raises(ValueError, match="sigma"):
        set_policy_sampling(head, -0.1)


def test_group_advantages_are_normalised_within_each_group():
    from latentserve.train.grpo import group_advantages

    rows = [[1.0, 0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.3, 0.1, 0.9, 0.0, 0.2]]
    adv = group_advantages(torch.tensor(rows))
    for r, a in zip(rows, adv.tolist()):
        m, s = statistics.fmean(r), statistics.pstdev(r)
        assert a == pytest.approx([(x - m) / (s + 1e-6) for x in r], abs=1e-5)


def test_reinforce_step_moves_mu_towards_a_rewarded_latent(head_dir):
    import copy

    from latentserve.latent.bundle import read_bundle
    from latentserve.train.grpo import policy_loss

    policy = read_bundle(head_dir / "latent_reasoning_head.safetensors").build()
    ref = copy.deepcopy(policy)
    policy.reasoning_head.net.requires_grad_(True)
    torch.manual_seed(1)
    anchor = torch.randn(policy.config.hidden_size)
    with torch.no_grad():
        z = policy.encode(anchor[None])[0] + 0.5 * torch.randn(policy.config.latent_dim)
    opt = torch.optim.SGD(policy.reasoning_head.net.parameters(), lr=0.5)
    with torch.no_grad():
        dist0 = float((policy.encode(anchor[None])[0] - z).norm())
    loss, parts = policy_loss(policy, ref, [[(anchor, z)], []], torch.tensor([1.0, -1.0]),
                              sigma=0.5, kl_coef=0.0)
    loss.backward()
    opt.step()
    assert parts["latent_steps"] == 1
    with torch.no_grad():
        assert float((policy.encode(anchor[None])[0] - z).norm()) < dist0


def test_grpo_step_changes_only_the_heads_mu_network(head_dir, tmp_path):
    from latentserve.latent.bundle import read_bundle
    from latentserve.train.grpo import GRPOConfig, train_grpo

    rows = [{"question": f"What is {a} plus {a + 2}?", "answer": f"{a}+{a + 2}={2 * a + 2}\n"
             f"#### {2 * a + 2}"} for a in range(1, 5)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bundle = head_dir / "latent_reasoning_head.safetensors"
    engine = LLMEngine(EngineConfig(model=str(head_dir), latent_head=str(bundle)))
    backbone = {k: v.clone() for k, v in engine.runner.model.state_dict().items()
                if "latent_head" not in k}
    out = tmp_path / "grpo.safetensors"

    def reward(text, gold, stats):
        # The tiny random backbone answers the same whatever it is fed, so reward something
        # that varies across a group: the first sampled latent's first coordinate.
        return float(stats["actions"][0][1][0])

    torch.manual_seed(0)
    log = train_grpo(GRPOConfig(bundle=str(bundle), out=str(out), model=str(head_dir),
                                data=str(data), steps=1, questions_per_step=2, group_size=4,
                                max_latent=4, answer_tokens=4, lr=1e-2, progress=False),
                     reward_fn=reward, engine=engine)
    assert log["history"][0]["reward_std"] > 0  # else there would be nothing to learn
    before, after = read_bundle(bundle), read_bundle(out)
    changed = [k for k, v in after.reasoning_head.items()
               if not torch.equal(v, before.reasoning_head[k])]
    assert changed and all(k.startswith("net.") for k in changed)
    for part in ("decoder", "target_proj"):
        for k, v in getattr(after, part).items():
            assert torch.equal(v, getattr(before, part)[k]), f"{part}.{k} changed"
    for k, v in engine.runner.model.state_dict().items():
        if k in backbone:
            assert torch.equal(v, backbone[k]), f"backbone {k} changed"
    served = engine.runner.model.latent_head.reasoning_head.state_dict()
    for k, v in after.reasoning_head.items():  # the engine serves the trained weights
        assert torch.equal(served[k].cpu(), v)
    assert not engine.has_unfinished_requests() and _slots_all_back(engine)
    assert getattr(engine.runner.model.latent_head, "policy_sigma", None) is None


def test_a_non_finite_loss_stops_grpo_naming_the_step_and_writes_no_bundle(head_dir, tmp_path,
                                                                            monkeypatch):
    import latentserve.train.grpo as grpo

    real = grpo.policy_loss

    def nan_loss(*args):
        loss, parts = real(*args)
        return loss * float("nan"), parts

    monkeypatch.setattr(grpo, "policy_loss", nan_loss)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "What is 1 plus 3?", "answer": "1+3=4\n#### 4"})
                    + "\n")
    bundle = head_dir / "latent_reasoning_head.safetensors"
    out = tmp_path / "out" / "grpo.safetensors"
    with pytest.raises(FloatingPointError, match="NaN or inf at step 0: .*--lr than 0.01"):
        grpo.train_grpo(grpo.GRPOConfig(bundle=str(bundle), out=str(out), model=str(head_dir),
                                        data=str(data), steps=2, questions_per_step=1,
                                        group_size=2, max_latent=2, answer_tokens=2, lr=1e-2,
                                        progress=False))
    assert not out.parent.exists()


def test_grpo_config_rejects_bad_options():
    from latentserve.train.grpo import GRPOConfig

    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(bundle="b.safetensors", out="o.safetensors", group_size=1)
    with pytest.raises(ValueError, match="sigma"):
        GRPOConfig(bundle="b.safetensors", out="o.safetensors", sigma=0.0)
    with pytest.raises(ValueError, match="max_latent"):
        GRPOConfig(bundle="b.safetensors", out="o.safetensors", max_latent=-1)
    # lr: the optimizer helper no longer checks it (train.schedule went into train.sft), so
    # the option does; before, `train-head grpo --lr 0` trained silently with lr 0.
    with pytest.raises(ValueError, match="lr"):
        GRPOConfig(bundle="b.safetensors", out="o.safetensors", lr=0.0)


def test_chat_reward_is_exact_match_plus_a_closing_bonus():
    from latentserve.train.grpo import reward

    assert reward(" 1,200.", "1200", {"end": "stop"}, "chat", 0.1) == pytest.approx(1.1)
    assert reward(" 12 then 13", "12", {"end": "cap"}, "chat", 0.1) == 0.0
    assert reward("none", "5", {"end": "stop"}, "chat", 0.25) == pytest.approx(0.25)
