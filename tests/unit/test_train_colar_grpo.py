"""CoLaR stage 2 (train/colar_grpo.py, ``latentserve train colar-grpo``) on a tiny random
stage-1 directory (a LoRA adapter over ``save_colar_tiny``'s Llama, whose policy leans
towards ``###``): the recomputed log-probs of a rollout are those of the latents the engine
drew (its noise comes back out of them) and of its answer tokens under the reference loop;
the loss is upstream's GRPOLoss on a hand-made batch; group advantages and the zero-variance
share; the engine serves exactly the trainer's weights after a push (fused projections
too); a few steps with a length penalty shorten the latent phase and a reward on the answer
token raises it; the saved directory serves like the engine it trained."""

import json
import math

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.latent import colar
from latentserve.latent.head_loop import set_policy_sampling
from latentserve.sampling_params import SamplingParams
from latentserve.train import colar_grpo as cg
from latentserve.train.cot import CHAT_TEMPLATES

SEP = 3  # "###" in save_colar_word_tokenizer
DIGITS = range(17, 27)  # "0".."9"
QUESTIONS = ["1 + 2", "3 + 4", "w40 w41 w42", "5 + 0 w33"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: tiny ops on a shared 2-core machine run ~50x faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A stage-1 directory: random LoRA (r 4, all linear layers, B scaled to 0.1) over a
    tiny CoLaR Llama (vocab 64, max_latent 8, speed 2), its config and policy beside it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.support.colar_models import save_colar_tiny

    root = tmp_path_factory.mktemp("colar-grpo")
    base = save_colar_tiny(root / "base", stop_push=12.0, vocab_size=64, max_latent=8,
                           compression_factor=2)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                      init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.1)
    out = root / "stage1"
    model.save_pretrained(out)
    colar.save_colar(out, *colar.load_colar(base))
    return out


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "toy.txt"
    p.write_text("".join(f"{x} + {y}||{x} + {y} = {x + y} #### {x + y}\n"
                         for x in range(10) for y in range(10 - x)))
    return p


def _trainable(stage1):
    """``(PEFT model, tokenizer, ColarConfig, policy)`` as ``train`` loads them."""
    from types import SimpleNamespace

    from latentserve.models.checkpoint import load_tokenizer
    from latentserve.train.colar import adapter_base
    from latentserve.train.cot import load_backbone

    base = adapter_base(str(stage1))
    model, _, _ = load_backbone(base, "cpu", SimpleNamespace(init_adapter=str(stage1), lora_r=1))
    ccfg, policy = colar.load_colar(stage1)
    return model.eval(), load_tokenizer(base), ccfg, policy


def _prompts(engine, questions=QUESTIONS):
    return [engine.tokenizer.encode(colar.QUESTION.format(q), add_special_tokens=False)
            for q in questions]


def _greedy(engine, questions, c=2):
    """``(answer ids, latent steps)`` per question, greedy, latent temperature 0."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, compression_factor=c)
    rolls = cg.run_rollouts(engine, _prompts(engine, questions), sp, 1, torch.float32)
    return [(r.answer_ids[1:], r.n_latent) for r in rolls]


# ------------------------------------------------------------------ log-probs of a rollout


def test_recomputed_logprobs_are_those_of_the_engine_draws(stage1):
    """Seeded rollouts with greedy tokens (the request's generator then draws only the
    latents): ``(latent / embeds_std - mean) / (std * t)`` of the recomputed policy is the
    generator's noise, the latent log-probs are that Normal's, the answer log-probs are the
    reference loop's logits at the positions that chose them (``###`` at the last latent),
    and recomputing with gradients gives the same values (ratio 1 before an update)."""
    from tests.support.colar_reference import colar_generate_reference

    model, tok, ccfg, policy = _trainable(stage1)
    engine = LLMEngine(EngineConfig(model=str(stage1)))
    cg.EngineSync(engine, model).push(policy)
    set_policy_sampling(engine.runner.model.latent_head, record=True)
    t = 0.7
    sp = SamplingParams(max_tokens=5, temperature=0.0, latent_temperature=t, seed=11)
    rolls = cg.run_rollouts(engine, _prompts(engine), sp, 1, torch.float32)
    with torch.no_grad():
        lat, ans = cg.rollout_logprobs(model, policy, rolls, ccfg.embeds_std, t, 1.0)
    new_lat, new_ans = cg.rollout_logprobs(model, policy, rolls, ccfg.embeds_std, t, 1.0)
    for q, r, lp, alp, nl, na in zip(QUESTIONS, rolls, lat, ans, new_lat, new_ans):
        assert torch.equal(lp, nl.detach()) and torch.equal(alp, na.detach())
        gen = torch.Generator().manual_seed(11)
        eps = torch.stack([torch.randn(ccfg.hidden_size, generator=gen)
                           for _ in range(r.n_latent)])
        x = r.latents / ccfg.embeds_std
        ref = colar_generate_reference(model, tok, policy, ccfg, q, 2, 8, 5, temperature=t,
                                       generator=torch.Generator().manual_seed(11))
        torch.testing.assert_close(r.latents, ref.latents, atol=1e-5, rtol=1e-5)
        assert r.answer_ids == [SEP, *ref.answer_ids]
        with torch.no_grad():
            lm = model.get_base_model()
            emb = lm.get_input_embeddings()
            seq = torch.cat([emb(torch.tensor(r.prompt_ids)), r.latents])
            h = lm.model(inputs_embeds=seq[None]).last_hidden_state[0]
            d = policy(h[len(r.prompt_ids) - 1:-1], temperature=t)
        torch.testing.assert_close((x - d.mean) / d.stddev, eps, atol=2e-4, rtol=1e-4)
        # log N(x | m, s) averaged over dims = mean(-eps^2 / 2 - log s) - log(2 pi) / 2
        want = (-eps ** 2 / 2 - d.stddev.log()).mean(-1) - math.log(2 * math.pi) / 2
        torch.testing.assert_close(lp, want, atol=1e-4, rtol=1e-4)
        logits = torch.cat([ref.latent_logits[-1:], ref.answer_logits])
        want_ans = logits.log_softmax(-1).gather(-1, torch.tensor(r.answer_ids)[:, None])[:, 0]
        torch.testing.assert_close(alp, want_ans, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ loss and advantages


def _log(ratios):
    return torch.tensor(ratios).log()


def test_loss_is_upstreams_grpo_loss_on_a_hand_made_batch():
    """Two rollouts, advantages +1 and -2, ratios chosen so that clipping bites (clip 0.2):
    per token ``-min(r A, clip(r) A)``: latent rows (-1.2, -0.9) and (1.6); answer rows
    (-1.1, -0.5, -1.0) and (2.6, 1.6). "sum" (colar.yaml): row sums / 32, mean over rows;
    "mean": row means, mean over rows. Clipped tokens get no gradient."""
    new = ([_log([1.5, 0.9]).requires_grad_(), _log([0.7])],
           [_log([1.1, 0.5, 1.0]), _log([1.3, 0.6])])
    old = ([torch.zeros(2), torch.zeros(1)], [torch.zeros(3), torch.zeros(2)])
    adv = torch.tensor([1.0, -2.0])
    got = cg.grpo_loss(new, old, adv, 0.2, "sum")
    assert got["latent"].item() == pytest.approx((-2.1 / 32 + 1.6 / 32) / 2)
    assert got["answer"].item() == pytest.approx((-2.6 / 32 + 4.2 / 32) / 2)
    assert got["total"].item() == pytest.approx(0.0171875)
    got["total"].backward()
    grad = new[0][0].grad
    assert grad[0] == 0 and grad[1] == pytest.approx(-0.9 / 32 / 2)  # d(-r A)/dlogp = -r A
    mean = cg.grpo_loss(new, old, adv, 0.2, "mean")
    assert mean["latent"].item() == pytest.approx((-2.1 / 2 + 1.6) / 2)
    assert mean["answer"].item() == pytest.approx((-2.6 / 3 + 4.2 / 2) / 2)
    off = cg.grpo_loss(new, old, adv, 0.2, "sum", use_latent=False)
    assert off["latent"].item() == 0 and off["total"].item() == pytest.approx(1.6 / 64)


def test_max_log_ratio_keeps_an_overflowing_ratio_finite():
    """A latent whose log-prob rose by 1000 nats since the rollout (a near-deterministic
    policy after an update): upstream's loss is NaN for a zero advantage (``inf * 0``) and its
    gradient non-finite for a negative one; clamped at 20 both are finite, the clamped
    tokens get no gradient and the in-range token keeps upstream's value and gradient."""
    old = ([torch.zeros(2), torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
    adv = torch.tensor([0.0, -1.0])

    def run(m):
        lat = [torch.tensor([1000.0, 0.1]).requires_grad_(), torch.tensor([1000.0])
               .requires_grad_()]
        got = cg.grpo_loss((lat, [torch.zeros(1), torch.zeros(1)]), old, adv, 0.2, "sum",
                           max_log_ratio=m)
        got["total"].backward()
        return got["latent"], [t.grad for t in lat]

    loss, _ = run(None)
    assert loss.isnan()
    loss, (g0, g1) = run(20.0)
    assert loss.item() == pytest.approx(math.exp(20) / 64)  # -(e^20 * -1) / 32, mean of 2 rows
    assert torch.equal(g0, torch.zeros(2)) and torch.equal(g1, torch.zeros(1))
    lat = [torch.tensor([0.1]).requires_grad_()]
    one = (lat, [torch.zeros(1)])
    ref = cg.grpo_loss(one, ([torch.zeros(1)], [torch.zeros(1)]), torch.tensor([-1.0]))
    clamped = cg.grpo_loss(one, ([torch.zeros(1)], [torch.zeros(1)]), torch.tensor([-1.0]),
                           max_log_ratio=20.0)
    assert clamped["latent"].item() == ref["latent"].item()


def test_group_advantages_use_the_sample_std_and_zero_variance_groups_are_counted():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.25]])
    adv = cg.group_advantages(rewards, unbiased=True, eps=1e-8)
    s = math.sqrt(1 / 3)  # torch.std of (0, 1, 0)
    torch.testing.assert_close(adv[1], torch.tensor([-1 / 3, 2 / 3, -1 / 3]) / (s + 1e-8))
    assert adv[0].abs().max() == 0 and adv[2].abs().max() == 0
    st = cg.reward_stats(rewards)
    assert st["zero_var_groups"] == 0.5
    assert st["reward"] == pytest.approx(rewards.mean().item())
    assert st["reward_var"] == pytest.approx(rewards.var(unbiased=False).item())
    assert st["group_reward_var"] == pytest.approx((2 / 9 + 0.25 ** 2 * 2 / 9) / 4)


def test_rewards_follow_answers_match_and_the_length_terms(toy_data):
    def roll(text, n):
        return cg.Rollout([5], torch.zeros(n, 4), [SEP], text, "stop")

    rolls = [roll("Answer:7", 2), roll("Answer: 7.", 4), roll("w3 7", 4), roll("8", 1)]
    golds = ["7", "7", "7", "8"]
    cfg = cg.ColarGRPOConfig(model="m", data=[str(toy_data)], out="o")
    r, acc = cg.rewards_of(rolls, golds, cfg, 8)
    assert acc.tolist() == [1, 1, 0, 1] and r.tolist() == [1, 1, 0, 1]
    cfg.punish_latent_length, cfg.length_penalty = True, 0.5
    r, _ = cg.rewards_of(rolls, golds, cfg, 8)
    torch.testing.assert_close(r, torch.tensor([1 / 2 - 1 / 8, 1 / 4 - 1 / 4, -1 / 4,
                                                1 - 1 / 16]))


# ------------------------------------------------------------------ engine weights


def test_engine_after_a_push_serves_the_updated_trainer_like_the_reference(stage1):
    """LoRA and policy moved by hand, pushed: the engine's greedy answers and latent counts
    are those of the reference loop on the updated PEFT model and policy (and differ from
    before the update); a warm prefix cache from the old weights is not reused."""
    from tests.support.colar_reference import colar_generate_reference

    model, tok, ccfg, policy = _trainable(stage1)
    engine = LLMEngine(EngineConfig(model=str(stage1)))
    set_policy_sampling(engine.runner.model.latent_head, record=True)
    before = _greedy(engine, QUESTIONS)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in [*model.named_parameters(), *policy.named_parameters()]:
            if "lora_" in n or not n.startswith("base_model"):
                p.add_(torch.randn_like(p) * 0.1)
    cg.EngineSync(engine, model).push(policy)
    after = _greedy(engine, QUESTIONS)
    refs = [colar_generate_reference(model, tok, policy, ccfg, q, 2, 8, 6) for q in QUESTIONS]
    assert after == [(r.answer_ids, r.n_latent) for r in refs]
    assert after != before


def test_fused_projections_take_their_rows_of_the_merged_weights(stage1):
    """On the fast path's merged q/k/v and gate/up GEMMs a push writes each adapted weight
    into its rows (q, k, v; gate, up), equal to base + B A * scale."""
    from latentserve.models.lora import merged_weight

    model, _, _, policy = _trainable(stage1)
    engine = LLMEngine(EngineConfig(model=str(stage1)))
    for layer in engine.runner.model.model.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()
    cg.EngineSync(engine, model).push(policy)

    def merged(name):
        m = model.get_submodule("base_model.model." + name)
        return merged_weight(m.get_base_layer().weight, m.lora_A["default"].weight,
                             m.lora_B["default"].weight, m.scaling["default"])

    layer = engine.runner.model.model.layers[1]
    p = "model.layers.1."
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, torch.cat(
        [merged(p + f"self_attn.{x}_proj") for x in "qkv"]), rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, torch.cat(
        [merged(p + "mlp.gate_proj"), merged(p + "mlp.up_proj")]), rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.down_proj.weight, merged(p + "mlp.down_proj"),
                               rtol=0, atol=0)


# ------------------------------------------------------------------ training runs


def _train(stage1, data, out, reward_fn=None, engine=None, **kw):
    opts = {"steps": 10, "questions_per_step": 4, "group_size": 8, "exp_batch_size": 16,
            "lr": 1e-2, "answer_tokens": 2}
    cfg = cg.ColarGRPOConfig(model=str(stage1), data=[str(data)], out=str(out),
                             **{**opts, **kw})
    log = []
    cg.train(cfg, progress=lambda s: log.append(json.loads(s)) if s.startswith("{") else None,
             engine=engine, reward_fn=reward_fn)
    return log


def test_a_length_penalty_shortens_the_latent_phase(stage1, toy_data, tmp_path):
    """Reward = -latent steps / max_latent (a zero base reward and ``length_penalty`` 1):
    twelve steps at lr 3e-3 bring the mean latent count down (by 1.4 to 2.6 over seeds 0-3)
    and the reward up; the log has every per-step field."""
    log = _train(stage1, toy_data, tmp_path / "out", reward_fn=lambda r, g: 0.0,
                 length_penalty=1.0, steps=12, lr=3e-3)
    first = sum(r["latent_steps"] for r in log[:3]) / 3
    last = sum(r["latent_steps"] for r in log[-3:]) / 3
    assert last < first - 1.0
    assert sum(r["reward"] for r in log[-3:]) > sum(r["reward"] for r in log[:3])
    assert {"reward", "accuracy", "latent_steps", "reward_var", "group_reward_var",
            "zero_var_groups", "loss", "latent_loss", "answer_loss", "grad_norm",
            "seconds"} <= set(log[0])


def test_a_reward_on_the_answer_token_raises_it_and_the_output_serves_as_trained(
        stage1, toy_data, tmp_path):
    """Reward 1 when the first answer token is a digit (about 1 in 5 at first): ten steps
    at lr 1e-2 raise the mean reward (by 0.28 to 0.54 over seeds 0-3). The engine ends with
    the trained weights, and the written directory (float32 adapter, policy, config) serves
    the same greedy outputs."""
    from safetensors.torch import load_file

    engine = LLMEngine(EngineConfig(model=str(stage1)))
    log = _train(stage1, toy_data, tmp_path / "out", engine=engine,
                 reward_fn=lambda r, g: float(r.answer_ids[1] in DIGITS))
    assert sum(r["reward"] for r in log[-3:]) / 3 > sum(r["reward"] for r in log[:3]) / 3 + 0.2
    out = tmp_path / "out"
    assert all(t.dtype == torch.float32
               for t in load_file(out / "adapter_model.safetensors").values())
    assert colar.load_colar(out)[0] == colar.load_colar(stage1)[0]
    assert len(json.loads((out / "train_log.json").read_text())) == 10
    assert engine.runner.model.latent_head.record_latents is False  # recording switched off
    served = LLMEngine(EngineConfig(model=str(out)))
    # chat prompts render CoLaR's question part, as stage 1's and the shipped model's
    assert served.tokenizer.chat_template == CHAT_TEMPLATES["colar"]
    for e in (engine, served):
        set_policy_sampling(e.runner.model.latent_head, record=True)
    assert _greedy(served, QUESTIONS) == _greedy(engine, QUESTIONS)


def test_an_update_with_a_non_finite_gradient_is_skipped_and_counted(
        stage1, toy_data, tmp_path, monkeypatch):
    """A NaN loss never reaches the weights: its update is skipped and the step's log
    counts it; the written adapter equals the stage-1 one."""
    from safetensors.torch import load_file

    real = cg.grpo_loss

    def nan_loss(*args, **kw):
        parts = real(*args, **kw)
        return {**parts, "total": parts["total"] * float("nan")}

    monkeypatch.setattr(cg, "grpo_loss", nan_loss)
    log = _train(stage1, toy_data, tmp_path / "out", steps=2, questions_per_step=2,
                 group_size=2, exp_batch_size=2, reward_fn=lambda r, g: float(len(r.text)))
    assert [r["skipped_updates"] for r in log] == [2, 2]
    before = load_file(stage1 / "adapter_model.safetensors")
    after = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        torch.testing.assert_close(after[k].float(), before[k].float(), rtol=0, atol=0)


def test_with_max_log_ratio_every_minibatch_update_of_a_step_is_applied(
        stage1, toy_data, tmp_path):
    """Latents drawn at temperature 50, log-probs at 1 (upstream): the old log-probs lie far
    below the density's peak, so after the first minibatch's update the later ones' ratios
    overflow (upstream: non-finite gradients, updates skipped, as on the H200 with a
    near-deterministic policy); clamped at 20 all four updates of each step are applied."""
    reward = lambda r, g: float(len(r.text) % 2)  # noqa: E731 - varied rewards
    kw = dict(steps=2, questions_per_step=2, group_size=4, exp_batch_size=2,
              latent_temperature=50.0, reward_fn=reward)
    upstream = _train(stage1, toy_data, tmp_path / "up", **kw)
    assert sum(r["skipped_updates"] for r in upstream) > 0
    clamped = _train(stage1, toy_data, tmp_path / "clamped", max_log_ratio=20.0, **kw)
    assert [r["skipped_updates"] for r in clamped] == [0, 0]
    assert all(r["max_latent_logratio"] > 20 for r in clamped)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in clamped)


def test_latent_log_ratios_move_only_after_an_update_within_the_step(stage1, toy_data, tmp_path):
    """``max_latent_logratio``: with one minibatch a step the update is on-policy (new
    log-probs equal the old ones exactly: ratio 1); with several, the minibatches after the
    first see the weights the first one moved, so their latent log-probs differ."""
    reward = lambda r, g: float(len(r.text) % 2)  # noqa: E731 - varied rewards: non-zero advantages
    one = _train(stage1, toy_data, tmp_path / "one", steps=2, questions_per_step=2,
                 group_size=4, exp_batch_size=8, reward_fn=reward)
    assert [r["max_latent_logratio"] for r in one] == [0.0, 0.0]
    several = _train(stage1, toy_data, tmp_path / "several", steps=2, questions_per_step=2,
                     group_size=4, exp_batch_size=2, reward_fn=reward)
    assert max(r["max_latent_logratio"] for r in several) > 1e-3


# ------------------------------------------------------------------ options


def test_record_refuses_a_sigma_and_recording_off_keeps_no_actions(stage1):
    engine = LLMEngine(EngineConfig(model=str(stage1)))
    head = engine.runner.model.latent_head
    with pytest.raises(ValueError, match="record"):
        set_policy_sampling(head, 0.3, record=True)
    engine.add_request("a", _prompts(engine)[0], SamplingParams(max_tokens=2))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert "actions" not in final.latent_stats


@pytest.mark.parametrize("field,value,match", [
    ("group_size", 1, "group_size"), ("latent_temperature", 0.0, "latent_temperature"),
    ("loss_average", "token", "loss_average"), ("answer_top_p", 0.0, "answer_top_p"),
    ("max_log_ratio", 0.0, "max_log_ratio")])
def test_bad_options_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        cg.ColarGRPOConfig(model="m", data=["d"], out="o", **{field: value})


def test_a_directory_without_an_adapter_is_refused(toy_data, tmp_path):
    from tests.support.colar_models import save_colar_tiny

    full = save_colar_tiny(tmp_path / "full", vocab_size=64)
    with pytest.raises(ValueError, match="LoRA adapter"):
        cg.train(cg.ColarGRPOConfig(model=str(full), data=[str(toy_data)], out=str(tmp_path)))


def test_cli_passes_its_options(monkeypatch, tmp_path):
    from latentserve.cli import main

    seen = {}
    monkeypatch.setattr(cg, "train", lambda cfg: seen.setdefault("cfg", cfg) and {})
    main(["train", "colar-grpo", "--model", "stage1", "--data", "a.txt", "--out",
          str(tmp_path), "--group-size", "4", "--latent-temperature", "0.5",
          "--answer-temperature", "0", "--compression-factor", "3", "--length-penalty", "0.1",
          "--punish-latent-length", "--no-answer-loss", "--loss-average", "mean",
          "--max-log-ratio", "20", "--tempered-logprobs"])
    cfg = seen["cfg"]
    assert (cfg.model, cfg.data, cfg.group_size) == ("stage1", ["a.txt"], 4)
    assert (cfg.latent_temperature, cfg.answer_temperature, cfg.answer_top_p) == (0.5, 0.0, 0.9)
    assert (cfg.compression_factor, cfg.length_penalty, cfg.punish_latent_length) == (3, 0.1, True)
    assert (cfg.use_answer_loss, cfg.use_latent_loss, cfg.loss_average) == (False, True, "mean")
    assert (cfg.lr, cfg.clip_eps, cfg.exp_batch_size) == (1e-6, 0.2, 8)
    assert (cfg.max_log_ratio, cfg.tempered_logprobs) == (20.0, True)
