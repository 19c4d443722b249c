"""Stage-0 data and training (train/tasks.py, train/cot.py): the multiplication generator
writes the iCoT format exactly and never a held-out question; GSM8K steps are its
calculator annotations; a short LoRA run on a tiny Llama lowers the loss and writes a PEFT
adapter that reproduces the trained model and chats in its prompt format. The shared loop
(``optimise``) logs the rate each step used and stops a diverged run before anything is
saved; non-finite options, an ``--out`` that cannot be written and a NaN adapter are
refused."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from latentserve.eval.datasets import data_dirs
from latentserve.latent import colar
from latentserve.train.tasks import (
    generate_multiplication,
    gsm8k_train_items,
    icot_line,
    multiplication_item,
    questions_of,
)

MULT = data_dirs()[0] / "multiplication"
MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """8 2x2 multiplications in iCoT lines."""
    from latentserve.train.tasks import write_icot

    p = tmp_path_factory.mktemp("cot-data") / "train.txt"
    write_icot(generate_multiplication(2, 8, seed=0), p)
    return p


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory, tiny_dirs, tiny_data):
    """A LoRA (r 4) after 2 steps over the tiny Llama (SmolLM2's tokenizer and template)."""
    from latentserve.train.cot import CotConfig, train

    out = tmp_path_factory.mktemp("cot") / "adapter"
    train(CotConfig(data=[str(tiny_data)], out=str(out), base=str(tiny_dirs["llama"]),
                    lora_r=4, steps=2, batch_size=4, warmup=0), progress=lambda s: None)
    return out


def test_multiplication_item_matches_the_icot_line():
    line = ("7 6 9 2 * 1 6 3 6||7 6 9 2 0 + 0 2 0 8 7 1 ( 7 8 9 0 8 1 ) + 0 0 1 0 9 8 0 "
            "( 7 8 0 1 7 0 1 ) + 0 0 0 2 0 8 7 1 #### 7 8 0 3 7 8 8 1")
    assert icot_line(multiplication_item(2967, 6361, 4)) == line


@pytest.mark.skipif(not MULT.is_dir(), reason="shared/data not present")
@pytest.mark.parametrize("name,k", [("4x4_test.txt", 4), ("5x5_valid.txt", 5)])
def test_generator_reproduces_every_line_of_the_shared_sets(name, k):
    for line in (MULT / name).read_text().splitlines():
        a, b = (int("".join(reversed(x.split()))) for x in line.partition("||")[0].split(" * "))
        assert icot_line(multiplication_item(a, b, k)) == line


@pytest.mark.skipif(not MULT.is_dir(), reason="shared/data not present")
def test_generated_training_set_excludes_test_and_valid():
    held_out = questions_of([MULT / "4x4_test.txt", MULT / "4x4_valid.txt"])
    # 2-digit operands have few questions: exclusion is what makes the set deterministic.
    items = generate_multiplication(4, 3000, seed=1, exclude=held_out)
    qs = [it.question for it in items]
    assert len(set(qs)) == 3000 and not set(qs) & held_out


def test_generator_refuses_impossible_requests():
    with pytest.raises(ValueError, match="more than half"):
        generate_multiplication(1, 50)
    # exclusions count: 81 1x1 questions less 60 excluded leave 21, so 11 is too many
    taken = [it.question for it in generate_multiplication(1, 40, seed=0)]
    taken += [it.question for it in generate_multiplication(1, 20, seed=1, exclude=taken)]
    assert len(set(taken)) == 60
    assert len(generate_multiplication(1, 10, seed=2, exclude=taken)) == 10
    with pytest.raises(ValueError, match=r"less the 60 excluded \(21\)"):
        generate_multiplication(1, 11, seed=2, exclude=taken)
    with pytest.raises(ValueError, match="2 digits"):
        multiplication_item(5, 12, 2)


def test_gsm8k_steps_are_the_calculator_annotations(tmp_path):
    row = {"question": "Q?", "answer": "He has 3+4 = <<3+4=7>>7.\nThen 7*2 = <<7*2=14>>14.\n"
                                       "#### 1,014"}
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps(row) + "\n")
    (it,) = gsm8k_train_items(p)
    assert (it.steps, it.gold) == ("<<3+4=7>> <<7*2=14>>", "1014")


def test_encode_example_separator_is_one_token(smollm2_tokenizer):
    from latentserve.train.cot import encode_examples

    it = multiplication_item(12, 34, 2)
    sep = smollm2_tokenizer.convert_tokens_to_ids("###")
    prompt, target = encode_examples(smollm2_tokenizer, [it])[0]
    assert smollm2_tokenizer.decode(prompt).endswith("(Thinking speed: 1)")
    assert target[0] == sep and target.count(sep) == 2 and target[-1] == 2  # eos
    _, nocot = encode_examples(smollm2_tokenizer, [it], "nocot")[0]
    assert nocot[:2] == [sep, sep] and smollm2_tokenizer.decode(nocot[2:-1]) == "Answer:" + it.gold


def test_lora_run_lowers_loss_and_adapter_reproduces_model(tmp_path, tiny_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from latentserve.train.cot import CotConfig, train
    from latentserve.train.tasks import write_icot

    data = tmp_path / "train.txt"
    write_icot(generate_multiplication(2, 16, seed=0), data)
    out = tmp_path / "adapter"
    cfg = CotConfig(data=[str(data)], out=str(out), base=str(tiny_dirs["llama"]), lora_r=4,
                    lora_alpha=8, steps=30, batch_size=8, lr=1e-2, warmup=2, log_every=5)
    last = train(cfg, progress=lambda s: None)
    log = json.loads((out / "train_log.json").read_text())
    assert last["loss"] < 0.8 * log[0]["loss"]
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 4 and Path(conf["base_model_name_or_path"]) == tiny_dirs["llama"]
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    ids = torch.tensor([[5, 17, 300, 4000, 12]])
    plain = base(ids).logits
    tuned = PeftModel.from_pretrained(base, str(out))(ids).logits
    assert not torch.allclose(plain, tuned, atol=1e-3)  # the adapter changes the model


def test_a_full_fine_tune_writes_a_model_that_serves_alone(tmp_path, tiny_dirs):
    """``lora_r=0``: every weight trained, the whole model and its tokenizer written, so
    ``LLM(model=out)`` loads it with no base beside it."""
    from latentserve import LLM, SamplingParams
    from latentserve.train.cot import CotConfig, train
    from latentserve.train.tasks import write_icot

    data = tmp_path / "train.txt"
    write_icot(generate_multiplication(2, 8, seed=0), data)
    out = tmp_path / "full"
    train(CotConfig(data=[str(data)], out=str(out), base=str(tiny_dirs["llama"]), lora_r=0,
                    steps=2, batch_size=4, lr=1e-3, warmup=0), progress=lambda s: None)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    llm = LLM(model=str(out))
    out_ = llm.generate([[5, 17, 300]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out_[0].outputs[0].token_ids) == 3
    # the base's chat template, which the tokenizer files carry, is replaced by the trained one
    chat = llm.chat([{"role": "user", "content": "1 2 * 3 4"}], SamplingParams(max_tokens=1),
                    use_tqdm=False)
    assert chat[0].prompt == colar.prompt_text("1 2 * 3 4")


def test_a_trained_adapter_chats_in_the_prompt_format_it_was_trained_on(tiny_adapter):
    """``chat_template.jinja`` beside the adapter: a chat (a system turn too) renders the
    last user message as the CoLaR prompt at speed 1, not as SmolLM2's chat turns."""
    from latentserve import LLM, SamplingParams

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 2 * 3 4"}]
    out = LLM(model=str(tiny_adapter)).chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt == colar.prompt_text("1 2 * 3 4")


@pytest.mark.skipif(not MODELS.is_dir(), reason="models/ not present (a wheel install)")
@pytest.mark.parametrize("kind,model", [("cot", "smollm2-mult-cot"),
                                        ("colar", "smollm2-mult-colar")])
def test_the_written_templates_are_those_of_the_shipped_models(kind, model):
    from latentserve.train.cot import CHAT_TEMPLATES

    assert CHAT_TEMPLATES[kind] == (MODELS / model / "chat_template.jinja").read_text()


def test_an_adapter_with_a_nan_weight_is_refused_naming_file_and_tensor(tiny_adapter,
                                                                        tmp_path):
    from safetensors.torch import load_file, save_file

    from latentserve.models.lora import read_adapter

    bad = shutil.copytree(tiny_adapter, tmp_path / "bad")
    weights = bad / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = sorted(tensors)[3]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"{weights}: tensor '{key}' holds non-finite"):
        read_adapter(bad)
    assert read_adapter(tiny_adapter).pairs  # the trained one loads


def _loop_cfg(**kw):
    return SimpleNamespace(**{"lr": 1e-4, "weight_decay": 0.0, "device": "cpu", "steps": 2,
                              "warmup": 0, "max_seconds": 0.0, "log_every": 1,
                              "save_every": 0, **kw})


def test_the_log_records_the_rate_each_step_used():
    """No warmup, 2 steps: step 1 runs at lr, step 2 at half of it (the cosine's midpoint);
    the log said 5e-05 and 0.0, the rates after each step."""
    from latentserve.train.cot import optimise

    w = torch.nn.Parameter(torch.ones(3))
    log = optimise(_loop_cfg(), [w], lambda: ((w ** 2).sum(), {}), lambda log: None,
                   progress=lambda s: None)
    assert [rec["lr"] for rec in log] == pytest.approx([1e-4, 5e-5])


def test_a_non_finite_loss_stops_the_loop_naming_its_step_before_a_checkpoint():
    """The loss turns NaN at step 3 of 6 (logged: 1 and 6; checkpoint at 4): the run stops at
    step 4 naming step 3 and ``--lr``, and no checkpoint is written."""
    from latentserve.train.cot import optimise

    w = torch.nn.Parameter(torch.ones(3))
    steps, saved, lines = iter(range(1, 7)), [], []

    def step_loss():
        return (w ** 2).sum() * (float("nan") if next(steps) == 3 else 1.0), {}

    with pytest.raises(FloatingPointError, match=r"NaN or inf at step 3: .*--lr than 0.0001"):
        optimise(_loop_cfg(steps=6, log_every=50, save_every=4), [w], step_loss, saved.append,
                 progress=lines.append)
    assert saved == [] and len(lines) == 1 and next(steps) == 5


def test_a_diverging_run_exits_non_zero_naming_the_step_and_writes_nothing(
        tmp_path, tiny_dirs, tiny_data, capsys):
    """``--lr 1e30``: the first update blows the LoRA up, step 2's loss is NaN."""
    from latentserve.cli import main

    out = tmp_path / "cot"
    rc = main(["train", "cot", "--data", str(tiny_data), "--out", str(out), "--model",
               str(tiny_dirs["llama"]), "--lora-r", "4", "--steps", "3", "--batch-size", "2",
               "--lr", "1e30", "--warmup", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "the training loss is NaN or inf at step 2" in err, err
    assert not out.exists()


def test_save_refuses_a_non_finite_weight_and_writes_nothing(tmp_path, tiny_dirs):
    from transformers import AutoModelForCausalLM

    from latentserve.train.cot import CotConfig, save

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    out = tmp_path / "full"
    with pytest.raises(FloatingPointError, match="'model.layers.0.mlp.up_proj.weight' holds"):
        save(model, "base", CotConfig(data=[], out=str(out), lora_r=0), [])
    assert not out.exists()


@pytest.mark.parametrize("argv,flag", [
    (["train", "cot", "--lr", "inf"], "--lr"),
    (["train", "cot", "--lr", "1e999"], "--lr"),
    (["train", "colar", "--lr", "inf"], "--lr"),
    (["train", "colar", "--max-seconds", "inf"], "--max-seconds"),
    (["train", "colar-grpo", "--model", "m", "--lr", "inf"], "--lr"),
    (["train", "colar-grpo", "--model", "m", "--latent-temperature", "inf"],
     "--latent-temperature"),
    (["train-head", "sft", "--lr", "inf"], "--lr"),
    (["train-head", "dagger", "--bundle", "b", "--sigma", "inf"], "--sigma"),
    (["train-head", "grpo", "--bundle", "b", "--kl-coef", "inf"], "--kl-coef"),
    (["train-head", "grpo", "--bundle", "b", "--close-bonus", "nan"], "--close-bonus")])
def test_non_finite_float_options_are_refused_naming_the_flag(argv, flag, capsys):
    from latentserve.cli import main

    out = "h.safetensors" if argv[0] == "train-head" else "o"
    with pytest.raises(SystemExit) as done:
        main([*argv, "--data", "a.txt", "--out", out])
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"argument {flag}: must be in " in err, err
    assert ", inf), got " in err


def test_a_non_finite_lr_is_refused_by_the_options():
    from latentserve.train.options import ColarGRPOConfig, CotConfig, GRPOConfig

    with pytest.raises(ValueError, match=r"^lr must be in \(0, inf\), got inf"):
        CotConfig(data=[], out="o", lr=float("inf"))
    with pytest.raises(ValueError, match="^lr must be in"):
        ColarGRPOConfig(model="m", data=[], out="o", lr=float("inf"))
    with pytest.raises(ValueError, match="^sigma must be in"):
        GRPOConfig(bundle="b", out="o.pt", sigma=float("inf"))


@pytest.mark.parametrize("stage,module,extra", [
    ("cot", "cot", []), ("colar", "colar", []), ("colar-grpo", "colar_grpo", ["--model", "m"])])
def test_an_out_that_cannot_be_a_model_directory_is_refused_before_loading(
        tmp_path, tiny_data, capsys, monkeypatch, stage, module, extra):
    """An existing file, or a path below one: an error naming ``--out`` before the backbone
    loads (the run wrote its output at the end: FileExistsError after training)."""
    import importlib

    from latentserve.cli import main

    def refuse(*args):
        pytest.fail("the backbone loaded before --out was checked")

    trainer = importlib.import_module(f"latentserve.train.{module}")
    monkeypatch.setattr(trainer, "load_backbone", refuse)
    afile = tmp_path / "afile.txt"
    afile.write_text("not a directory\n")
    for out, why in ((afile, "is an existing file, but it names a model directory"),
                     (afile / "sub", f"{afile} is a file, not a folder")):
        rc = main(["train", stage, *extra, "--data", str(tiny_data), "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and f"error: --out {out}" in err and why in err, err
    assert afile.read_text() == "not a directory\n"


def test_check_out_names_what_it_overwrites_and_creates_nothing(tmp_path):
    from latentserve.train.options import check_out

    lines = []
    check_out(tmp_path / "new" / "model", "a model directory", True, lines.append)
    check_out(tmp_path / "new" / "h.safetensors", "a bundle file", False, lines.append)
    assert lines == [] and not (tmp_path / "new").exists()  # missing folders: made at save
    model = tmp_path / "model"
    model.mkdir()
    check_out(model, "a model directory", True, lines.append)  # empty: nothing to overwrite
    (model / "adapter_config.json").write_text("{}")
    check_out(model, "a model directory", True, lines.append)
    (tmp_path / "h.pt").write_text("")
    check_out(tmp_path / "h.pt", "a bundle file", False, lines.append)
    assert lines == [f"--out {model} exists: the files written there are overwritten",
                     f"--out {tmp_path / 'h.pt'} exists: it is overwritten"]
    with pytest.raises(ValueError, match=r"^--out .* is an existing directory, but it names a "
                                         "bundle file: give a new path or a file"):
        check_out(model, "a bundle file", False)


def test_cli_refuses_bad_sizes_before_loading_anything(tmp_path, capsys):
    from latentserve.cli import main

    assert main(["data", "multiplication", "--k", "0", "--n", "3", "--out",
                 str(tmp_path / "m.txt")]) != 0
    assert "need --k in [1, 30]" in capsys.readouterr().err
    data = tmp_path / "d.txt"
    data.write_text("1 * 2||2 #### 2\n")
    with pytest.raises(SystemExit) as exit_:  # refused as the command line is read
        main(["eval", "--model", str(tmp_path), "--prompt-format", "colar",
              "--dataset-file", str(data), "--limit", "-3"])
    assert exit_.value.code == 2
    assert "argument --limit: must be >= 1, got -3" in capsys.readouterr().err
