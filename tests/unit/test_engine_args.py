"""The engine flags generated from ``EngineConfig``'s declarations, the positional model,
the older flag names, and ``--config FILE.yaml`` with vLLM's semantics."""

import dataclasses

import pytest

from latentserve.cli import build_parser, main
from latentserve.cli.config_file import expand_config_args
from latentserve.cli.engine_args import engine_configs, finish_engine_args
from latentserve.config import EngineConfig


def configs(argv: list[str]) -> list[EngineConfig]:
    parser = build_parser()
    args = parser.parse_args(expand_config_args(parser, argv))
    finish_engine_args(args)
    return engine_configs(args)


def test_no_flags_is_the_default_config():
    assert configs(["serve"]) == [EngineConfig()]


def test_every_declared_field_has_a_flag_with_its_default():
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    for f in dataclasses.fields(EngineConfig):
        if f.metadata.get("cli", True) and f.name != "model":
            assert getattr(serve, f.name) == f.default, f.name


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"],
     "argument --gpu-memory-utilization: must be in (0, 1], got 1.5"),
    (["--max-model-len", "1"], "argument --max-model-len: must be >= 2, got 1"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--tp", "x"], "argument --tensor-parallel-size/--tp/-tp: invalid int value: 'x'"),
])
def test_a_value_out_of_range_is_refused_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        main(["serve", *argv])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_vllm_flags_and_the_older_names_set_the_same_fields():
    new = configs(["serve", "m", "--no-enable-prefix-caching", "--tensor-parallel-size", "2",
                   "--max-latent-budget", "3", "--disable-overlap-schedule", "--dtype", "half"])
    old = configs(["serve", "--model", "m", "--no-prefix-caching", "--tp", "2",
                   "--max-recurrence", "3", "--disable-overlap-schedule", "--dtype",
                   "float16"])
    assert new == old
    c = new[0]
    assert (c.model, c.enable_prefix_caching, c.tensor_parallel_size, c.max_latent_budget,
            c.overlap_schedule, c.dtype) == ("m", False, 2, 3, False, "float16")


def test_the_positional_model_comes_first_and_generate_takes_one(capsys):
    assert [c.model for c in configs(["serve", "a", "--model", "b"])] == ["a", "b"]
    assert main(["generate", "a", "--model", "b", "--prompt", "x"]) == 2
    assert "the model is given twice" in capsys.readouterr().err


def test_served_model_name_takes_several_names_for_one_model(capsys):
    assert configs(["serve", "m", "--served-model-name", "x", "y"])[0].served_model_name \
        == ("x", "y")
    assert main(["serve", "--model", "a", "--model", "b", "--served-model-name", "x"]) == 2
    assert "--served-model-name names one model" in capsys.readouterr().err


def test_config_file_keys_are_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: m\nmax-num-seqs: 8\nmax_model_len: 512\n"
                    "enable-prefix-caching: false\nenforce-eager: true\n"
                    "served-model-name: [x, y]\nseed: 3\n")
    c = configs(["serve", "--config", str(path), "--max-num-seqs", "16"])[0]
    assert (c.model, c.max_num_seqs, c.max_model_len, c.enable_prefix_caching,
            c.enforce_eager, c.served_model_name, c.seed) == ("m", 16, 512, False, True,
                                                               ("x", "y"), 3)
    # A positional model before --config is not taken by the file's flag of several values.
    path.write_text("served-model-name: [x, y]\n")
    c = configs(["serve", "p", "--config", str(path)])[0]
    assert (c.model, c.served_model_name) == ("p", ("x", "y"))


@pytest.mark.parametrize("text, message", [
    ("max-num-seqz: 8\n", "'max-num-seqz' is not a flag of this command"),
    ("- 1\n- 2\n", "the file must hold a mapping"),
    ("max-num-seqs: 0\n", "argument --max-num-seqs: must be >= 1, got 0"),
])
def test_a_bad_config_file_is_one_error_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) if "argument" in message else _no_raise():
        assert main(["serve", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_device_and_dtype_auto_resolve_on_construction(tmp_path, monkeypatch):
    import json

    from latentserve import config

    assert (EngineConfig().device, EngineConfig().dtype) in (("cpu", "float32"),
                                                              ("cuda", "bfloat16"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    monkeypatch.setattr(config, "_cuda_available", lambda: True)
    assert EngineConfig(model=str(model)).device == "cuda"
    assert EngineConfig(model=str(model)).dtype == "float16"  # the checkpoint's
    assert EngineConfig(model=str(model), device="cpu").dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"  # the embedded model


@pytest.mark.parametrize("text, value", [("1k", 1000), ("25.6k", 25600), ("4K", 4096),
                                         ("2048", 2048), ("1m", 10**6)])
def test_token_counts_take_vllms_human_readable_form(text, value):
    """vLLM's ``--max-model-len 32k`` (``human_readable_int``: k = 1000, K = 1024)."""
    (c,) = configs(["serve", "--max-model-len", text, "--max-num-batched-tokens", text,
                    "--kv-slots", text])
    assert c.max_model_len == c.max_num_batched_tokens == c.kv_slots == value


@pytest.mark.parametrize("text, message", [
    ("1.5K", "argument --max-model-len: decimals are not allowed with the binary suffix K"),
    ("1x", "argument --max-model-len: invalid int value: '1x'"),
    ("0k", "argument --max-model-len: must be >= 2, got 0"),
])
def test_a_bad_human_readable_count_is_refused_naming_the_flag(capsys, text, message):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--max-model-len", text])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--tokenizer", "/nonexistent/tok", "tokenizer must be a directory holding tokenizer "
                                        "files; '/nonexistent/tok' is not a directory"),
    ("--tokenizer", "EMPTY", "holds no tokenizer files"),
    ("--generation-config", "/nonexistent/gen", "generation_config must be 'auto', 'vllm' or "
                                                "a folder holding generation_config.json; "
                                                "there is no /nonexistent/gen/"),
    ("--generation-config", "EMPTY", "there is no"),
])
def test_a_bad_tokenizer_or_generation_config_path_fails_before_loading(
        tmp_path, capsys, monkeypatch, flag, value, message):
    """One error naming the flag's field, from the config: no engine is built (vLLM users
    get a mistyped path reported before the weights load)."""
    import latentserve.engine.llm_engine as llm_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_engine)
    value = str(tmp_path) if value == "EMPTY" else value
    assert main(["generate", "--prompt", "hi", flag, value]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["serve"],
                                  ["eval", "--dataset", "gsm8k", "--limit", "1"]])
def test_a_missing_latent_head_fails_before_loading(tmp_path, capsys, monkeypatch, argv):
    """--latent-head is checked with the other paths, before any model loads (it was found
    missing only once the weights had loaded); a directory must hold a bundle."""
    import latentserve.engine.llm_engine as llm_engine
    import latentserve.server.launch as launch

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_load)
    monkeypatch.setattr(launch, "run_server", no_load)
    missing = str(tmp_path / "head.safetensors")
    assert main([*argv, "--latent-head", missing]) == 2
    assert capsys.readouterr().err == (
        "latentserve: error: --latent-head (latent_head) must be a head bundle file "
        f"(.safetensors or .pt) or a model directory holding one; {missing!r} does not exist\n")
    assert main([*argv, "--latent-head", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"latentserve: error: --latent-head {tmp_path} is a directory without a head bundle "
        "(latent_reasoning_head.safetensors)\n")


def test_a_tokenizer_directory_and_a_generation_config_folder_are_taken(smollm2_dir):
    c = EngineConfig(tokenizer=str(smollm2_dir), generation_config=str(smollm2_dir))
    assert c.tokenizer == str(smollm2_dir)
