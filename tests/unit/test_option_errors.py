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
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1, got 0" in capsys.readouterr().err


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
    ("--min-latent", "-1", ">= 0"),
])
def test_eval_flag_out_of_range_is_an_argparse_error(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["eval", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2
    assert flag in err and allowed in err, err
