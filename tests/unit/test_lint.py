"""The linters CI holds the line with (issue 33): ruff with the rule set in pyproject.toml
over src/, tests/, scripts/ and benchmarks/, and mypy over the core packages ``[tool.mypy] files``
names. A finding fails the suite with the tools' own report."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    out = _run(str(BIN / "ruff"), "check", "--no-cache", "src", "tests", "scripts", "benchmarks")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_finds_nothing_in_the_core():
    out = _run(str(BIN / "mypy"), "--no-incremental")
    assert out.returncode == 0, out.stdout + out.stderr
