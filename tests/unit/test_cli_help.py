"""The CLI's help surface (issue 29): ``--version``, every ``convert`` form and ``bench``
suite named in ``--help``."""

import pytest

from latentserve import __version__
from latentserve.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"latentserve {__version__}"


@pytest.mark.parametrize("argv, words", [
    (["--help"], ["COCONUT / CODI / PCCoT"]),
    (["convert", "--help"], ["coconut", "codi", "pccot"]),
    (["bench", "--help"], ["serve", "offline:", "gpu:", "latent:", "loop:"]),
])
def test_help_names_every_form(capsys, argv, words):
    with pytest.raises(SystemExit):
        main(argv)
    text = " ".join(capsys.readouterr().out.split())
    for word in words:
        assert word in text, (argv, word)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x"], ["serve"],
                                  ["bench", "--suite", "latent"]])
def test_device_cuda_without_one_is_a_clear_error_before_loading(capsys, monkeypatch, argv):
    """One line, the same for generate and serve (serve's used to come from the engine
    process as an EngineStartupError, after the server logged its config)."""
    import torch

    import latentserve.server.launch as launch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")

    def no_server(*args, **kwargs):
        raise AssertionError("the server was started")

    monkeypatch.setattr(launch, "run_server", no_server)
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == (f"latentserve: error: device 'cuda': no CUDA device is available here "
                   f"(torch {torch.__version__}); use --device cpu\n")


def test_the_parser_is_built_without_importing_torch():
    """``latentserve --help`` answers at once: building the parser imports no torch."""
    import subprocess
    import sys

    code = ("import sys; from latentserve.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_train_head_checks_its_data_before_importing_torch(tmp_path):
    """A missing ``--data`` is reported at once, before torch loads (seconds on a busy
    machine)."""
    import subprocess
    import sys

    code = ("import sys; from latentserve.cli import main; "
            f"rc = main(['train-head', 'sft', '--model', 'unused', '--data', "
            f"{str(tmp_path / 'missing.jsonl')!r}, '--out', 'unused']); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert "missing.jsonl does not exist" in r.stderr


@pytest.mark.parametrize("value,words", [
    ("0,a", "must be comma-separated int values, got '0,a'"),
    ("2,0", "(must be >= 1, got 0)"), (",", "must name at least one value")])
def test_bench_concurrency_is_checked_on_the_flag(capsys, value, words):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--concurrency", value])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "argument --concurrency: " in err and words in err


@pytest.mark.parametrize("argv,words", [
    (["--suite", "gpu", "--device", "cpu"], "--suite gpu runs on CUDA, and torch sees no CUDA"),
    (["--concurrency", "4"], "--concurrency sets the gpu, latent, loop and families suites"),
    (["--suite", "latent", "--families", "plain"], "--families needs --suite families"),
    (["--suite", "families", "--families", "plain,xyz"], "--families: unknown family 'xyz'; "
                                                          "the families are plain, feedback")])
def test_bench_refuses_flags_its_suite_would_ignore_or_cannot_run(capsys, argv, words):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert main(["bench", *argv]) == 2
    assert words in capsys.readouterr().err
