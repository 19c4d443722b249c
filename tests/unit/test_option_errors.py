"""Bad option values, as a new user types them: each is refused before anything loads, on
one line naming the flag (or field) and what is allowed."""

import subprocess

import pytest

from latentserve.cli import build_parser, main
from latentserve.cli.config_file import expand_config_args
from latentserve.config import EngineConfig
from latentserve.server.launch import start_server
from latentserve.server.options import ServerOptions


@pytest.mark.parametrize("flag, value, allowed", [
    ("--port", "-1", "[0, 65535]"),
    ("--port", "70000", "[0, 65535]"),
    ("--drain-timeout", "-1", ">= 0"),
    ("--drain-timeout", "nan", ">= 0"),
    ("--timeout-keep-alive", "-5", ">= 0"),
    ("--timeout-keep-alive", "nan", ">= 0"),
    ("--log-level", "loud", "choose from"),
    ("--allowed-origins", "[1]", "JSON list of strings"),
    ("--allowed-methods", "GET", "JSON list of strings"),
    ("--data-parallel-size", "0", ">= 1"),
    ("--dp", "-2", ">= 1"),
    ("--seed", "-1", "[0, 9223372036854775807]"),
    ("--seed", str(2**64), "[0, 9223372036854775807]"),
])
def test_serve_flag_out_of_range_is_an_argparse_error(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["serve", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2
    assert flag in err and allowed in err, err


def test_generate_max_tokens_zero_is_refused_not_replaced_by_the_default(capsys, monkeypatch):
    import latentserve.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "LLMEngine", None)  # a model load would fail loudly
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "x", "--max-tokens", "0"])
    assert done.value.code == 2
    assert "argument --max-tokens: max_tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, words", [
    ("--exit-criterion", "bogus", "invalid choice: 'bogus' (choose from 'entropy-diff'"),
    ("--top-p", "2", "top_p must be in (0.0, 1.0], got 2.0"),
    ("--top-p", "0", "top_p must be in (0.0, 1.0], got 0.0"),
    ("--top-p", "nan", "top_p must be a finite number, got nan"),
    ("--temperature", "-1", "temperature must be in [0.0, "),
    ("--temperature", "inf", "temperature must be a finite number"),
    ("--top-k", "-2", "top_k must be >= -1, got -2"),
    ("--seed", "-2", "seed must be in [0, 9223372036854775807], got -2"),
    ("--latent-budget", "-1", "latent_budget must be >= 0, got -1"),
    ("--exit-threshold", "nan", "exit_threshold must be a finite number, got nan"),
    ("--exit-threshold", "-1", "exit_threshold must be >= 0.0, got -1.0"),
    ("--thinking", "maybe", "invalid choice: 'maybe'"),
    ("--max-latent", "-1", "max_latent must be >= 0, got -1"),
    ("--min-output-tokens", "-1", "min_output_tokens must be >= 0, got -1"),
    ("--device", "gpu", "device must be auto, cpu, cuda or cuda:N (N a GPU index), got 'gpu'"),
])
def test_generate_flag_out_of_range_is_an_argparse_error_naming_flag_and_field(
        capsys, flag, value, words):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["generate", "--prompt", "x", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2
    assert f"argument {flag}: {words}" in err, err


def test_generate_offers_every_exit_criterion_the_recurrent_families_take():
    from latentserve.latent.recurrent import HUGINN_AUTO_THRESHOLDS, OURO_CRITERIA

    for name in (*HUGINN_AUTO_THRESHOLDS, "none", *OURO_CRITERIA):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--exit-criterion",
                                          name])
        assert args.exit_criterion == name


def test_a_sampling_params_error_at_run_time_names_the_flag_and_the_field():
    from latentserve.cli.generate import _flag_error

    err = _flag_error(ValueError("top_p must be in (0.0, 1.0], got 2.0"))
    assert str(err) == "--top-p (top_p) must be in (0.0, 1.0], got 2.0"


@pytest.mark.parametrize("value", [0, 2])
def test_top_p_range_is_stated_the_same_on_either_side(value):
    from latentserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=rf"^top_p must be in \(0.0, 1.0\], got {value}$"):
        SamplingParams(top_p=value)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:12"])
def test_device_flag_takes_what_engine_config_takes(device):
    assert build_parser().parse_args(["serve", "--device", device]).device == device
    if device != "auto":  # auto resolves to cpu or cuda
        assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cpu:1", "auto:0", "CUDA"])
def test_bad_device_gets_the_same_text_from_the_flag_and_the_config(capsys, device):
    text = f"device must be auto, cpu, cuda or cuda:N (N a GPU index), got {device!r}"
    with pytest.raises(ValueError) as exc:
        EngineConfig(device=device)
    assert str(exc.value) == text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", device])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"argument --device: {text}")


@pytest.mark.parametrize("options, words", [
    ({"bogus": 1}, "LLM got unknown engine option(s) bogus;"),
    ({"max_num_seq": 4}, "max_num_seq (did you mean max_num_seqs?)"),
])
def test_llm_unknown_option_is_named_before_anything_loads(monkeypatch, options, words):
    import latentserve.engine.llm_engine as llm_engine
    from latentserve.entrypoints.llm import LLM

    monkeypatch.setattr(llm_engine, "LLMEngine", None)  # a model load would fail loudly
    with pytest.raises(TypeError) as exc:
        LLM(**options)
    assert words in str(exc.value) and "__init__" not in str(exc.value)


def _declared_floats():
    import dataclasses

    from latentserve.train.options import (
        ColarGRPOConfig,
        ColarTrainConfig,
        CotConfig,
        FinetuneOptions,
        HeadOptions,
    )

    for cls in (EngineConfig, ServerOptions, FinetuneOptions, CotConfig, ColarTrainConfig,
                ColarGRPOConfig, HeadOptions):
        for f in dataclasses.fields(cls):
            if "float" in str(f.type) and any(f.metadata.get(op) is not None
                                              for op in ("ge", "gt", "le", "lt")):
                yield pytest.param(f, id=f"{cls.__name__}.{f.name}")


@pytest.mark.parametrize("f", list(_declared_floats()))
def test_nan_is_refused_by_every_declared_float_range(f):
    from latentserve.options import check_value

    with pytest.raises(ValueError, match=rf"^{f.name} must be .*, got nan$"):
        check_value(f.name, float("nan"), f.metadata)


@pytest.fixture
def no_process(monkeypatch):
    def popen(*args, **kwargs):
        raise AssertionError("a server process was started")

    monkeypatch.setattr(subprocess, "Popen", popen)


@pytest.mark.parametrize("options, error, words", [
    ({"port": -1}, ValueError, "port must be in [0, 65535], got -1"),
    ({"drain_timeout": float("nan")}, ValueError, "drain_timeout must be >= 0"),
    ({"log_level": "loud"}, ValueError, "log_level must be one of"),
    ({"allowed_origins": "*"}, ValueError, "allowed_origins must be a list of strings"),
    ({"timeout": 0}, ValueError, "timeout must be > 0"),
    ({"bogus": 1}, TypeError, "unknown option(s) bogus"),
    ({"max_num_seqs": 4}, TypeError, "max_num_seqs: an EngineConfig field"),
])
def test_start_server_refuses_a_bad_option_before_starting(no_process, options, error, words):
    with pytest.raises(error) as exc:
        start_server(EngineConfig(device="cpu"), **options)
    assert words in str(exc.value)


def test_server_options_seed_range_text_shows_int_bounds_in_full():
    with pytest.raises(ValueError, match=r"seed must be in \[0, 9223372036854775807\], got -1"):
        EngineConfig(seed=-1)
    with pytest.raises(ValueError, match=r"port must be an integer in \[0, 65535\]"):
        ServerOptions(port="8000")


def _config_argv(tmp_path, text: str, command: str = "serve") -> list[str]:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    parser = build_parser()
    return expand_config_args(parser, [command, "--config", str(path)])


@pytest.mark.parametrize("text, words", [
    ("enforce-eager: yes-please\n", "'enforce-eager' is a switch: give true or false"),
    ("enforce-eager: 3\n", "'enforce-eager' is a switch"),
    ("port: [1, 2]\n", "'port' takes one value, got a list"),
    ("port: true\n", "'port' takes a value, got True"),
    ("help: true\n", "'help' is not a flag of this command"),
])
def test_config_file_value_of_the_wrong_shape_names_the_key(tmp_path, text, words):
    with pytest.raises(ValueError) as exc:
        _config_argv(tmp_path, text)
    assert words in str(exc.value)


def test_config_file_lists_and_false_switches_become_the_right_flags(tmp_path):
    argv = _config_argv(tmp_path, "overlap-schedule: false\nenable-prefix-caching: false\n"
                                  "model: [/a, /b]\nallowed-origins: [x, y]\n")
    args = build_parser().parse_args(argv)
    assert args.overlap_schedule is False  # --disable-overlap-schedule, not nothing
    assert args.enable_prefix_caching is False
    assert args.model == ["/a", "/b"]  # --model repeated, not a stray positional
    assert args.allowed_origins == ["x", "y"]


@pytest.mark.parametrize("flag, value, allowed", [
    ("--limit", "0", ">= 1"), ("--max-tokens", "0", ">= 1"),
    ("--compression-factor", "0", ">= 1"), ("--max-latent", "-1", ">= 0"),
    ("--min-latent", "-1", ">= 0"), ("--stop-threshold", "nan", "[0, 1]"),
    ("--stop-threshold", "-0.1", "[0, 1]"), ("--stop-threshold", "1.5", "[0, 1]"),
    ("--concurrency", "0", ">= 1"),
])
def test_eval_flag_out_of_range_is_an_argparse_error(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["eval", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2
    assert flag in err and allowed in err, err
