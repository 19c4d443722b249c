"""CoLaR stage 1 (train/colar.py, ``latentserve train colar``) and the eager reference loop
(tests/support/colar_reference.py) on a tiny random Llama with a word-level tokenizer that has a
``###`` token: the batched loss equals upstream's algorithm run on each example alone, a
short run lowers the loss, the output directory loads with ``load_colar`` and PEFT, and a
toy model trained for it ends its latent phase after ceil(steps / c) latents."""

import dataclasses
import json
import math
import random

import pytest
import torch

from latentserve.latent import colar
from latentserve.train.colar import (
    ColarTrainConfig,
    colar_loss,
    compress_groups,
    draw_picks,
    train,
)
from latentserve.train.options import LORA_TARGETS, CotConfig, fresh_lora

WORDS = ["<unk>", "<s>", "</s>", "###", "Question", ":", "Let", "'s", "think", "step", "by",
         "(", "Thinking", "speed", ")", "Answer", "+", "=", *map(str, range(10))]


def _backbone(out):
    """A tiny random Llama (hidden 64) with a word-level tokenizer over ``WORDS``: the
    CoLaR templates tokenise into known words and ``###`` is one id."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from latentserve.bench.baseline.tiny_models import save_tiny

    save_tiny(out, "llama", word_tokenizer=True, vocab_size=len(WORDS))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"###|'s|[A-Za-z]+|\d|[^\sA-Za-z\d]"), behavior="isolated")])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return _backbone(tmp_path_factory.mktemp("colar") / "base")


@pytest.fixture(scope="module")
def toy_file(tmp_path_factory):
    """Sums below 10 in iCoT lines; the steps ``x + y = s`` are 5 tokens."""
    p = tmp_path_factory.mktemp("data") / "toy.txt"
    p.write_text("".join(f"{x} + {y}||{x} + {y} = {x + y} #### {x + y}\n"
                         for x in range(10) for y in range(10 - x)))
    return p


@pytest.fixture(scope="module")
def trained(backbone, toy_file, tmp_path_factory):
    """``(out_dir, log)`` of 600 steps at lr 3e-3 on the toy task, r in 1..2, a fresh LoRA,
    on one thread. 300 steps at lr 1e-2 learned the stop on one CPU and not on another (an
    Intel Xeon: the float rounding of another SIMD path); these settings learned it on 1 to
    3 threads, and at 450 or 800 steps."""
    out = tmp_path_factory.mktemp("run") / "colar"
    cfg = ColarTrainConfig(data=[str(toy_file)], out=str(out), base=str(backbone), lora_r=16,
                           steps=600, batch_size=16, lr=3e-3, warmup=5, log_every=1,
                           max_compression_factor=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg, progress=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    return out, json.loads((out / "train_log.json").read_text())


# ------------------------------------------------------------------ upstream, one example


def _upstream_one(lm, policy, prompt, steps, answer, r, pick, noise, embeds_std, kind,
                  compression="sqrt_mean"):
    """Upstream ``LitCoLaR.forward`` for a batch of one example, written out: ``(ce_sum,
    n_ce, embed_sum, n_embed)``. Steps part ``[pad]*(r-1) ### steps [pad]*`` grouped by r,
    pads zeroed, each group summed and divided by sqrt(count) + 1e-5 (r = 1: the plain
    embeddings), labels gathered from the groups; -100 on the question, HF's shifted CE;
    latent target = the next input embedding / embeds_std at every steps position. The
    all-pad group upstream puts before the separator when the steps fill their groups
    exactly is left out (a masked position; docs/training.md). ``compression="ramp"`` (ours):
    the group's token at place j weighted j + 1 instead, the sum over the weights' norm."""
    emb = lm.get_input_embeddings()
    sep = answer[0]
    ids = [sep, *steps]
    if r == 1:
        steps_embeds, steps_labels = emb(torch.tensor(ids)), ids
    else:
        left, right = r - 1, (-(r - 1 + len(ids))) % r
        mask = torch.tensor([0] * left + [1] * len(ids) + [0] * right)
        padded = torch.tensor([0] * left + ids + [0] * right)
        e = (emb(padded) * mask[:, None]).view(-1, r, emb.weight.shape[1])
        count = mask.view(-1, r).sum(1).float()
        steps_embeds = e.sum(1) / (count.sqrt()[:, None] + 1e-5)
        if compression == "ramp":
            w = torch.arange(1.0, r + 1).repeat(len(mask) // r) * mask  # the ### group: r
            e = e * w.view(-1, r, 1)
            steps_embeds = e.sum(1) / w.view(-1, r).square().sum(1).sqrt()[:, None]
        groups = padded.view(-1, r)
        steps_labels = [sep] + [int(groups[g + 1, p]) for g, p in enumerate(pick)]
    x = torch.cat([emb(torch.tensor(prompt)), steps_embeds, emb(torch.tensor(answer))])[None]
    labels = torch.tensor([-100] * len(prompt) + steps_labels + answer)[None]
    out = lm(inputs_embeds=x, labels=labels, output_hidden_states=True)
    n_ce = len(steps_labels) + len(answer)
    q, s = len(prompt), len(steps_embeds)
    dist = policy(out.hidden_states[-1][0, q:q + s])
    gold = x[0, q + 1:q + s + 1].detach() / embeds_std
    if kind == "mse":
        rows = torch.nn.functional.mse_loss(dist.mean + dist.stddev * noise, gold,
                                            reduction="none").mean(-1)
    else:
        rows = -dist.log_prob(gold).mean(-1)
    return out.loss * n_ce, n_ce, rows.sum(), s


def _lora_model(backbone):
    """The tiny backbone under a random (non-zero) LoRA, float32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(backbone, dtype=torch.float32),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                     init_lora_weights=False))


def _batch(r):
    """Five examples with 0, 1, r, r + 1 and 7 steps tokens (none, a short last group, exact
    fills); prompt lengths 3..7."""
    v, sep, eos = len(WORDS), 3, 2
    return [([4 + i % 5] * (3 + i), [(7 * i + j) % (v - 4) + 4 for j in n], [sep, 15, 5, 20, eos])
            for i, n in enumerate([range(0), range(1), range(r), range(r + 1), range(7)])]


@pytest.mark.parametrize("r,kind,compression", [
    (1, "mse", "sqrt_mean"), (3, "mse", "sqrt_mean"), (3, "nll", "sqrt_mean"),
    (4, "nll", "sqrt_mean"), (3, "mse", "ramp"), (1, "nll", "ramp")])
def test_batched_loss_equals_upstream_per_example(backbone, r, kind, compression):
    model = _lora_model(backbone)
    lm = model.get_base_model()
    policy = colar.LatentPolicy(64, 32)
    batch = _batch(r)
    picks = draw_picks([len(s) for _, s, _ in batch], r, random.Random(1))
    noise = [torch.randn(-(-len(s) // r) + 1, 64) for _, s, _ in batch]
    got = colar_loss(model, policy, batch, r, picks, 0.08, kind, noise=torch.cat(noise),
                     embed_weight=0.5, compression=compression)
    ref = [_upstream_one(lm, policy, *ex, r, pk, nz, 0.08, kind, compression)
           for ex, pk, nz in zip(batch, picks, noise)]
    ce = sum(x[0] for x in ref) / sum(x[1] for x in ref)
    embed = sum(x[2] for x in ref) / sum(x[3] for x in ref)
    assert got["n_ce"] == sum(x[1] for x in ref) and got["n_embed"] == sum(x[3] for x in ref)
    torch.testing.assert_close(got["ce"], ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["embed"], embed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["total"], ce + 0.5 * embed, rtol=1e-5, atol=1e-5)


def test_own_latent_prob_zero_is_the_plain_loss(backbone):
    """P = 0 is the loss without the option: one backbone forward, no random draw but the
    mse noise (``torch.randn`` here), and the value and gradients of upstream's algorithm
    run on each example alone."""
    model, policy = _lora_model(backbone), colar.LatentPolicy(64, 32)
    lm, batch, r = model.get_base_model(), _batch(3), 3
    picks = draw_picks([len(s) for _, s, _ in batch], r, random.Random(1))
    params = [p for p in model.parameters() if p.requires_grad] + list(policy.parameters())
    calls = []
    hook = lm.model.register_forward_pre_hook(lambda *_: calls.append(1))
    torch.manual_seed(5)
    try:
        got = colar_loss(model, policy, batch, r, picks, 0.08, own_latent_prob=0.0)
    finally:
        hook.remove()
    after = torch.get_rng_state()
    torch.manual_seed(5)
    noise = torch.randn(int(got["n_embed"]), 64).split([-(-len(s) // r) + 1 for _, s, _ in batch])
    assert len(calls) == 1 and torch.equal(after, torch.get_rng_state())
    ref = [_upstream_one(lm, policy, *ex, r, pk, nz, 0.08, "mse")
           for ex, pk, nz in zip(batch, picks, noise)]
    total = (sum(x[0] for x in ref) / sum(x[1] for x in ref)
             + sum(x[2] for x in ref) / sum(x[3] for x in ref))
    torch.testing.assert_close(got["total"], total, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got["total"], params), torch.autograd.grad(total, params),
                    strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_own_latent_prob_one_feeds_every_later_latent_the_policy_mean(backbone):
    """P = 1: the loss forward's input at each latent after the first is the policy mean
    x embeds_std from the previous position of a pass over the gold inputs (what the engine
    feeds at temperature 0); the first latent (``###``) and the text are the gold inputs;
    CE labels and latent targets stay gold."""
    import torch.nn.functional as F

    model, policy = _lora_model(backbone), colar.LatentPolicy(64, 32)
    lm, batch, r, std = model.get_base_model(), _batch(2), 2, 0.08
    picks = draw_picks([len(s) for _, s, _ in batch], r, random.Random(1))
    seen = []
    hook = lm.model.register_forward_pre_hook(
        lambda _, args, kw: seen.append(kw["inputs_embeds"].detach().clone()), with_kwargs=True)
    try:
        got = colar_loss(model, policy, batch, r, picks, std, "nll", own_latent_prob=1.0)
    finally:
        hook.remove()
    gold, fed = seen  # the no-grad pass, then the loss forward
    with torch.no_grad():
        hidden = lm.model(inputs_embeds=gold).last_hidden_state
        want = gold.clone()
        rows = []
        for b, (prompt, steps, _) in enumerate(batch):
            q, k = len(prompt), -(-len(steps) // r)
            rows += [(b, q + g) for g in range(k + 1)]
            for g in range(1, k + 1):
                want[b, q + g] = policy(hidden[b, q + g - 1]).mean * std
        replaced = (want != gold).any(-1)
        assert int(replaced.sum()) == sum(-(-len(s) // r) for _, s, _ in batch)
        torch.testing.assert_close(fed[replaced], want[replaced])
        assert torch.equal(fed[~replaced], gold[~replaced])
        # the loss is the gold-target loss of the mixed inputs
        h = lm.model(inputs_embeds=fed).last_hidden_state
        lb, lt = torch.tensor(rows).T
        dist = policy(h[lb, lt])
        embed = -dist.log_prob(gold[lb, lt + 1] / std).mean()
        ce_pos, labels = [], []
        for b, ((prompt, steps, answer), pick) in enumerate(zip(batch, picks)):
            ys = [answer[0]] + [steps[g * r + p] for g, p in enumerate(pick)] + answer
            ce_pos += [(b, len(prompt) - 1 + j) for j in range(len(ys))]
            labels += ys
        cb, ct = torch.tensor(ce_pos).T
        ce = F.cross_entropy(lm.lm_head(h[cb, ct]), torch.tensor(labels))
    torch.testing.assert_close(got["embed"], embed)
    torch.testing.assert_close(got["ce"], ce)


def test_own_latent_prob_outside_0_1_is_refused(tmp_path):
    from latentserve.cli import main

    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="own_latent_prob"):
            ColarTrainConfig(data=[], out="x", own_latent_prob=bad)
    with pytest.raises(SystemExit) as done:  # argparse's error, on the flag
        main(["train", "colar", "--data", "a.txt", "--out", str(tmp_path),
              "--own-latent-prob", "1.5"])
    assert done.value.code == 2


def test_training_with_own_latents_runs_and_saves(backbone, toy_file, tmp_path):
    out = tmp_path / "ss"
    train(ColarTrainConfig(data=[str(toy_file)], out=str(out), base=str(backbone), lora_r=4,
                           steps=3, batch_size=4, log_every=1, max_compression_factor=2,
                           train_factors=(2,), own_latent_prob=0.5), progress=lambda *_: None)
    log = json.loads((out / "train_log.json").read_text())
    assert len(log) == 3 and all(rec["loss"] == rec["loss"] for rec in log)  # not NaN
    assert json.loads((out / "train_config.json").read_text())["own_latent_prob"] == 0.5
    assert colar.load_colar(out) is not None


def test_ramp_compression_keeps_the_order_within_a_group_and_sqrt_mean_does_not():
    emb = torch.nn.Embedding(10, 8)
    swapped = torch.tensor([[1, 2, 3, 4], [2, 1, 3, 4], [5, 6, -1, -1]])
    with torch.no_grad():
        mean = compress_groups(emb, swapped)
        ramp = compress_groups(emb, swapped, "ramp")
        e = emb.weight
        torch.testing.assert_close(mean[0], mean[1])  # a sum carries no order
        assert not torch.allclose(ramp[0], ramp[1])
        torch.testing.assert_close(ramp[0], (e[1] + 2 * e[2] + 3 * e[3] + 4 * e[4]) / 30 ** 0.5)
        torch.testing.assert_close(ramp[2], (e[5] + 2 * e[6]) / 5 ** 0.5)  # pads weigh 0
        torch.testing.assert_close(mean[2], (e[5] + e[6]) / (2 ** 0.5 + 1e-5))
        one = torch.tensor([[7], [3]])  # r = 1: the plain embeddings either way
        assert torch.equal(compress_groups(emb, one, "ramp"), e[[7, 3]])
        assert torch.equal(compress_groups(emb, one), e[[7, 3]])
    with pytest.raises(ValueError, match="compression must be one of sqrt_mean, ramp"):
        compress_groups(emb, one, "mean")


def test_the_compression_is_recorded_and_checked_in_colar_config(backbone, toy_file, tmp_path):
    out = tmp_path / "ramp"
    train(ColarTrainConfig(data=[str(toy_file)], out=str(out), base=str(backbone), lora_r=4,
                           steps=2, batch_size=4, max_compression_factor=2,
                           compression="ramp"), progress=lambda *_: None)
    saved = json.loads((out / colar.COLAR_CONFIG).read_text())
    assert saved["compression"] == "ramp" and colar.load_colar(out)[0].compression == "ramp"
    with pytest.raises(ValueError, match="field 'compression' must be one of 'sqrt_mean', "
                                         "'ramp', got 'mean'"):
        colar.ColarConfig.from_dict({**saved, "compression": "mean"})
    with pytest.raises(ValueError, match="compression"):
        ColarTrainConfig(data=[str(toy_file)], out=str(out), compression="mean")


def test_group_labels_are_real_tokens_of_their_group():
    picks = draw_picks([0, 1, 5, 6], 3, random.Random(0))
    assert [len(p) for p in picks] == [0, 1, 2, 2]
    assert picks[1] == [0] and picks[2][1] in (0, 1) and all(p < 3 for p in picks[3])


# ------------------------------------------------------------------ a training run


def test_loss_falls_within_30_steps(trained):
    _, log = trained
    first = sum(r["loss"] for r in log[:5]) / 5
    later = sum(r["loss"] for r in log[25:30]) / 5
    assert later < 0.6 * first
    assert {"ce", "embed", "r"} <= set(log[0]) and {r["r"] for r in log} == {1, 2}


def test_output_directory_loads_with_load_colar_and_peft(trained, backbone):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = trained
    cfg, policy = colar.load_colar(out)
    base = AutoModelForCausalLM.from_pretrained(backbone, dtype=torch.float32)
    std = base.get_input_embeddings().weight.std().item()
    assert (cfg.hidden_size, cfg.intermediate_size) == (64, 64)
    assert cfg.embeds_std == pytest.approx(std, rel=1e-5)
    assert (cfg.compression_factor, cfg.max_compression_factor, cfg.max_latent) == (2, 2, 64)
    assert not policy.training and policy.mean.weight.shape == (64, 64)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(backbone.resolve())
    lora = load_file(out / "adapter_model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in lora.values())
    assert any("lora_B" in k and t.abs().max() > 0 for k, t in lora.items())
    PeftModel.from_pretrained(base, str(out))  # loads without missing keys
    assert json.loads((out / "train_config.json").read_text())["max_compression_factor"] == 2


def test_the_output_chats_in_the_question_format_the_engine_continues(trained, backbone):
    """``chat_template.jinja``: a chat renders the last user message as CoLaR's question part
    (the engine appends the thinking speed and ``###``), as the shipped CoLaR model's."""
    from transformers import AutoTokenizer

    from latentserve import LLM, SamplingParams
    from latentserve.train.cot import CHAT_TEMPLATES

    out, _ = trained
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATES["colar"]
    res = LLM(model=str(out)).chat([{"role": "user", "content": "3 + 4"}],
                                   SamplingParams(max_tokens=2), use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(backbone)
    assert res.prompt_token_ids == tok.encode(colar.QUESTION.format("3 + 4"),
                                              add_special_tokens=False)


def test_a_colar_directory_as_init_adapter_continues_its_policy(trained, toy_file, tmp_path):
    """Stage 1 resumed from its own output starts from the saved latent policy and
    ``embeds_std`` (not a fresh head): with a vanishing lr the policy comes back as saved."""
    out, _ = trained
    saved_cfg, saved = colar.load_colar(out)
    again = tmp_path / "again"
    train(ColarTrainConfig(data=[str(toy_file)], out=str(again), init_adapter=str(out),
                           steps=1, batch_size=4, lr=1e-12, warmup=0, max_compression_factor=2,
                           embeds_std=0.5), progress=lambda *_: None)
    cfg, policy = colar.load_colar(again)
    assert cfg.embeds_std == saved_cfg.embeds_std
    for (k, a), b in zip(saved.state_dict().items(), policy.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), k


def test_lora_r_0_from_a_colar_directory_merges_it_and_trains_every_weight(trained, toy_file,
                                                                           tmp_path):
    """``--init-adapter DIR --lora-r 0``: the adapter merged into the weights, all of them
    trained; the output is a whole model with its tokenizer and policy, which serves alone
    and (at a vanishing lr) answers as the LoRA directory does."""
    from latentserve import LLM, SamplingParams

    out, _ = trained
    full = tmp_path / "full"
    train(ColarTrainConfig(data=[str(toy_file)], out=str(full), init_adapter=str(out),
                           lora_r=0, steps=1, batch_size=4, lr=1e-12, warmup=0,
                           max_compression_factor=2), progress=lambda *_: None)
    names = {p.name for p in full.iterdir()}
    assert {"model.safetensors", "tokenizer.json", "latent_policy.safetensors"} <= names
    assert "adapter_config.json" not in names
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["Question : 3 + 4", "Question : 2 + 5"]
    want, got = (LLM(model=str(d)).generate(prompts, params) for d in (out, full))
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].latent_steps == w.outputs[0].latent_steps > 0


# ------------------------------------------------------------------ the reference loop


@pytest.fixture(scope="module")
def reference_model(trained):
    from tests.support.colar_reference import load_colar_reference

    return load_colar_reference(trained[0])


@pytest.mark.parametrize("c,latents", [(1, 5), (2, 3)])
def test_trained_toy_stops_after_ceil_steps_over_c_latents(reference_model, c, latents):
    from tests.support.colar_reference import colar_generate_reference

    model, tok, cfg, policy = reference_model
    for q in ("3 + 4", "1 + 2", "5 + 0"):
        out = colar_generate_reference(model, tok, policy, cfg, q, compression_factor=c,
                                       max_latent=10)
        assert out.n_latent == latents
        assert int(out.latent_logits[-1].argmax()) == tok.convert_tokens_to_ids("###")
        assert out.answer_ids[-1] == tok.eos_token_id
        assert tok.convert_ids_to_tokens(out.answer_ids[:2]) == ["Answer", ":"]


def test_reference_matches_a_full_recompute(reference_model):
    """The cached loop's logits equal one uncached pass over prompt, latents, ``###`` and
    the answer; a latent is the policy mean of the previous position times embeds_std."""
    from tests.support.colar_reference import colar_generate_reference

    model, tok, cfg, policy = reference_model
    out = colar_generate_reference(model, tok, policy, cfg, "2 + 5", compression_factor=2,
                                   max_latent=10)
    emb = model.get_input_embeddings()
    sep = tok.convert_tokens_to_ids("###")
    x = torch.cat([emb(torch.tensor(out.prompt_ids)), out.latents,
                   emb(torch.tensor([sep] + out.answer_ids[:-1]))])
    with torch.no_grad():
        hidden = model.model(inputs_embeds=x[None]).last_hidden_state[0]
        logits = model.lm_head(hidden)
        p, n = len(out.prompt_ids), out.n_latent
        torch.testing.assert_close(out.latent_logits, logits[p:p + n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.answer_logits, logits[p + n:], rtol=1e-4, atol=1e-4)
        mean = policy(hidden[p - 1:p + n - 1]).mean * cfg.embeds_std
        torch.testing.assert_close(out.latents, mean, rtol=1e-4, atol=1e-5)


def test_reference_caps_latents_and_samples_with_the_generator(reference_model):
    from tests.support.colar_reference import colar_generate_reference

    model, tok, cfg, policy = reference_model
    capped = colar_generate_reference(model, tok, policy, cfg, "3 + 4", compression_factor=1,
                                      max_latent=2)
    assert capped.n_latent == 2 and capped.latents.shape == (2, 64)
    none = colar_generate_reference(model, tok, policy, cfg, "3 + 4", max_latent=0)
    assert none.n_latent == 0 and none.latent_logits.shape == (0, len(WORDS))
    runs = [colar_generate_reference(model, tok, policy, cfg, "3 + 4", temperature=1.0,
                                     generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    greedy = colar_generate_reference(model, tok, policy, cfg, "3 + 4")
    torch.testing.assert_close(runs[0].latents, runs[1].latents)
    assert not torch.equal(runs[0].latents[0], greedy.latents[0])


def test_cli_train_colar_passes_its_options(monkeypatch, tmp_path):
    import latentserve.train.colar as train_colar
    from latentserve.cli import main

    seen = {}
    monkeypatch.setattr(train_colar, "train", lambda cfg: seen.setdefault("cfg", cfg) and {})
    main(["train", "colar", "--data", "a.txt", "--data", "b.jsonl", "--out", str(tmp_path),
          "--init-adapter", "stage0", "--max-compression-factor", "4",
          "--compression-factor", "3", "--embed-loss", "nll", "--embed-weight", "2",
          "--intermediate-size", "128", "--own-latent-prob", "0.25"])
    cfg = seen["cfg"]
    assert cfg.data == ["a.txt", "b.jsonl"] and cfg.init_adapter == "stage0"
    assert (cfg.max_compression_factor, cfg.compression_factor, cfg.embed_loss) == (4, 3, "nll")
    assert (cfg.embed_weight, cfg.intermediate_size, cfg.lr) == (2.0, 128, 1e-4)
    assert cfg.lora_r is None and cfg.lora_targets is None and cfg.own_latent_prob == 0.25


def test_lora_options_that_would_do_nothing_are_refused():
    """A fresh LoRA gets r 16, alpha 32 and every Llama linear unless sent; alpha and targets
    with a full fine-tune or a continued adapter (whose own config rules), and a rank > 0
    with a continued adapter, are refused naming the field."""
    fresh = ColarTrainConfig(data=[], out="x")
    assert fresh_lora(fresh) == (16, 32.0, LORA_TARGETS)
    sent = ColarTrainConfig(data=[], out="x", lora_r=4, lora_alpha=8.0, lora_targets=("q_proj",))
    assert fresh_lora(sent) == (4, 8.0, ("q_proj",))
    assert fresh_lora(ColarTrainConfig(data=[], out="x", init_adapter="a", lora_r=0)) is None
    assert fresh_lora(ColarTrainConfig(data=[], out="x", init_adapter="a")) is None
    # what was sent is kept, so a copy may turn to a full fine-tune or a continued adapter
    assert fresh_lora(dataclasses.replace(fresh, lora_r=0)) is None
    assert dataclasses.replace(fresh, init_adapter="a").lora_r is None
    for kw, field in ((dict(lora_r=0, lora_alpha=8.0), "lora_alpha"),
                      (dict(lora_r=0, lora_targets=("q_proj",)), "lora_targets"),
                      (dict(init_adapter="a", lora_alpha=8.0), "lora_alpha"),
                      (dict(init_adapter="a", lora_r=0, lora_targets=("q_proj",)), "lora_targets"),
                      (dict(init_adapter="a", lora_r=8), "lora_r")):
        with pytest.raises(ValueError, match=f"^{field} "):
            ColarTrainConfig(data=[], out="x", **kw)
        with pytest.raises(ValueError, match=f"^{field} "):
            CotConfig(data=[], out="x", **kw)


def test_train_factors_choose_each_batch_r(backbone, toy_file, tmp_path):
    """``train_factors`` replaces upstream's uniform 1..max draw: every step's r is one of
    them; a factor outside 1..max_compression_factor, or none, is refused."""
    train(ColarTrainConfig(data=[str(toy_file)], out=str(tmp_path / "o"), base=str(backbone),
                           lora_r=4, steps=6, batch_size=2, log_every=1,
                           max_compression_factor=3, train_factors=(3,)),
          progress=lambda *_: None)
    log = json.loads((tmp_path / "o" / "train_log.json").read_text())
    assert [rec["r"] for rec in log] == [3] * 6
    # the rate each step ran at: 1e-4 x (s + 1) / 100 warmup steps x the cosine of s / 6
    assert [rec["lr"] for rec in log] == pytest.approx(
        [1e-6 * (s + 1) * 0.5 * (1 + math.cos(math.pi * s / 6)) for s in range(6)])
    for bad in ((), (0,), (4,)):
        with pytest.raises(ValueError, match="train_factors"):
            ColarTrainConfig(data=[], out="x", max_compression_factor=3, train_factors=bad)


@pytest.mark.parametrize("flag,value", [
    ("--embed-weight", "-1"), ("--ce-weight", "-0.5"), ("--weight-decay", "-5"),
    ("--lora-alpha", "0"), ("--max-len", "0")])
def test_out_of_range_flags_are_refused_by_argparse_naming_them(tmp_path, capsys, flag, value):
    from latentserve.cli import main

    with pytest.raises(SystemExit) as done:
        main(["train", "colar", "--data", "a.txt", "--out", str(tmp_path), flag, value])
    assert done.value.code == 2 and flag in capsys.readouterr().err


def test_no_loss_at_all_is_refused():
    with pytest.raises(ValueError, match="ce_weight and embed_weight are both 0"):
        ColarTrainConfig(data=[], out="x", ce_weight=0, embed_weight=0)


@pytest.mark.skipif("torch.cuda.is_available()")
def test_device_cuda_without_cuda_is_refused_before_loading(tmp_path, capsys):
    from latentserve.cli import main

    (tmp_path / "t.jsonl").write_text("{}\n")
    for argv in (["train", "colar", "--data", "a.txt", "--out", str(tmp_path / "o")],
                 ["train-head", "sft", "--data", str(tmp_path / "t.jsonl"), "--out",
                  str(tmp_path / "o.safetensors")]):
        rc = main([*argv, "--device", "cuda"])
        assert rc == 2 and "device 'cuda': no CUDA device is available" in capsys.readouterr().err
        assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]
