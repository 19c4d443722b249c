"""Run every shell command the README and docs/*.md document, bounded, on the CPU, and report
the ones that fail.

    python scripts/check_docs_commands.py                 # all of them (tens of minutes)
    python scripts/check_docs_commands.py --list          # what would run, and what is skipped
    python scripts/check_docs_commands.py --match 'data multiplication' --timeout 60

A command is a line (with its ``\\`` continuations) of a fenced code block that starts with
``latentserve``, ``python -m latentserve`` or ``python -m benchmarks``, or the
``latentserve ...`` after the last ``&&`` of a line (the README's install-and-run lines). A
usage line runs without its ``[optional]`` arguments (``latentserve serve [--port 8000]``
runs ``latentserve serve``).
Skipped, with the reason in the report:

* a block preceded by ``<!-- skip: REASON -->``, or a command whose trailing comment says
  ``skip: REASON`` (``# stage 0; skip: needs a GPU``);
* ``gpu``: a command that names ``cuda`` (``--device cuda``, ``--suite gpu``, a ``_gpu``
  benchmark module without ``--tiny``), since this check runs on the CPU;
* ``placeholder``: a command with an upper-case placeholder (``PATH``, ``MODEL_DIR``) or
  ``...``.

Each document's commands run in order in one scratch directory (with ``models/`` linked to
the repository's), so a file one command writes is there for the next. ``latentserve serve``
is started, checked with ``GET /health`` and stopped (a trailing ``&``: left running until the
document's commands end); a command that talks to a server (``bench serve``, ``--url``,
``--base-url`` on 127.0.0.1) gets one (the embedded model) when none runs. Ports are
rewritten to free ones. A command still running at ``--timeout`` seconds without an error is
``bounded`` (it started and ran; long trainings and sweeps end there), not a failure.
Exit status: 1 when any command failed.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_BLOCK = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->")
SKIP_LINE = re.compile(r"\s#.*?\bskip:\s*(.+)$")
PLACEHOLDER = re.compile(r"(?<![\w-])(?:[A-Z][A-Z0-9]*_)*(?:PATH|DIR|FILE|NAME|MODEL|BUNDLE|"
                         r"N|KEY|C|X)(?![\w.-])|\.\.\.")
URL = re.compile(r"http://127\.0\.0\.1:(\d+)")


@dataclass
class Command:
    """One documented command: ``doc`` (path), ``line`` (1-based), ``text`` (one line, the
    comment dropped), ``skip`` (the reason, or None), ``background`` (ended with ``&``)."""

    doc: str
    line: int
    text: str
    skip: str | None = None
    background: bool = False


@dataclass
class Result:
    command: Command
    status: str  # ok | bounded | failed | skipped
    seconds: float = 0.0
    detail: str = ""


def documents(root: Path = ROOT) -> list[Path]:
    """README.md, docs/*.md and docs/*/README.md."""
    return [root / "README.md", *sorted(Path(p) for p in glob.glob(str(root / "docs" / "*.md"))),
            *sorted(Path(p) for p in glob.glob(str(root / "docs" / "*" / "README.md")))]


def extract(path: Path) -> list[Command]:
    """The commands of one markdown file, with their skip reasons."""
    out, in_block, block_skip, pending, text, start = [], False, None, None, "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            in_block = not in_block
            block_skip, pending = (pending if in_block else None), None
            continue
        if not in_block:
            m = SKIP_BLOCK.search(raw)
            if m:
                pending = m.group(1)
            elif stripped:
                pending = None
            continue
        if not text:
            start = n
        text = f"{text} {stripped}" if text else stripped
        if text.endswith("\\"):
            text = text[:-1].rstrip()
            continue
        line, text = text, ""
        if "&& latentserve " in line:
            line = "latentserve " + line.rsplit("&& latentserve ", 1)[1]
        if not re.match(r"(latentserve|python3? -m (latentserve|benchmarks))\b", line):
            continue
        line_skip = SKIP_LINE.search(line)
        body = _without_optional(_drop_comment(line))
        background = body.endswith("&")
        body = body.rstrip("&").strip()
        doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        out.append(Command(doc, start, body,
                           block_skip or (line_skip.group(1) if line_skip else None)
                           or _auto_skip(body), background))
    return out


def _drop_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (outside quotes)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:
        return line
    if not tokens:
        return ""
    cut = line.find(" #")
    while cut >= 0:
        try:
            if shlex.split(line[:cut]) == tokens:
                return line[:cut].rstrip()
        except ValueError:
            pass
        cut = line.find(" #", cut + 1)
    return line.rstrip()


def _without_optional(text: str) -> str:
    """``text`` without its ``[optional]`` groups (nested ones too) outside quotes."""
    out, depth, quote = [], 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"" and depth == 0:
            quote = ch
        elif ch == "[" and (depth or not out or out[-1] == " "):
            depth += 1
            continue
        elif ch == "]" and depth:
            depth -= 1
            continue
        if depth == 0:
            out.append(ch)
    return re.sub(r"\s+", " ", "".join(out)).strip()


def _auto_skip(text: str) -> str | None:
    if "cuda" in text or "--suite gpu" in text or (
            re.search(r"bench\.\w+_gpu\b", text) and "--tiny" not in text):
        return "gpu"
    if PLACEHOLDER.search(text):
        return "placeholder"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(text: str) -> list[str]:
    """The command as an argv for this interpreter (``latentserve`` -> ``python -m
    latentserve.cli``)."""
    args = shlex.split(text)
    if args[0] == "latentserve":
        return [sys.executable, "-m", "latentserve.cli", *args[1:]]
    return [sys.executable, *args[1:]]


def _is_serve(args: list[str]) -> bool:
    return args[:4] == [sys.executable, "-m", "latentserve.cli", "serve"]


def _needs_server(text: str) -> bool:
    return bool(URL.search(text)) or re.match(r"latentserve bench serve\b", text) is not None


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Runner:
    """Runs one document's commands in ``cwd``; servers it started are stopped by
    :meth:`close`."""

    def __init__(self, cwd: Path, timeout: float, env: dict[str, str]):
        self.cwd, self.timeout, self.env = cwd, timeout, env
        self.servers: list[subprocess.Popen] = []
        self.ports: dict[int, int] = {}  # documented port -> the free port used for it

    def port_for(self, documented: int) -> int:
        if documented not in self.ports:
            self.ports[documented] = free_port()
        return self.ports[documented]

    def start_server(self, args: list[str], keep: bool) -> tuple[bool, str, subprocess.Popen]:
        port = int(args[args.index("--port") + 1])
        log_path = self.cwd / f"server-{port}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(args, cwd=self.cwd, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        ok = _wait_healthy(proc, port, self.timeout)
        if not ok or not keep:
            _stop(proc)
        else:
            self.servers.append(proc)
        return ok, log_path.read_text(errors="replace")[-1500:], proc

    def ensure_server(self, port: int) -> None:
        """The embedded model served on ``port`` (a free port standing for a documented
        one), unless a server this runner started already listens there."""
        if any(p.poll() is None and f"--port {port}" in " ".join(p.args) for p in self.servers):
            return
        args = [sys.executable, "-m", "latentserve.cli", "serve", "--port", str(port)]
        ok, log, _ = self.start_server(args, keep=True)
        if not ok:
            raise RuntimeError(f"the server for this command did not start: {log}")

    def run(self, cmd: Command) -> Result:
        text = cmd.text
        if _needs_server(text):
            if "bench serve" in text and "--base-url" not in text:
                text += " --base-url http://127.0.0.1:8000"
            for documented in {int(p) for p in URL.findall(text)}:
                port = self.port_for(documented)
                text = text.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{port}")
                self.ensure_server(port)
        args = _argv(text)
        start = time.monotonic()
        if _is_serve(args):
            documented = int(args[args.index("--port") + 1]) if "--port" in args else 8000
            if "--port" in args:
                args[args.index("--port") + 1] = str(self.port_for(documented))
            else:
                args += ["--port", str(self.port_for(documented))]
            ok, log, _ = self.start_server(args, keep=cmd.background)
            return Result(cmd, "ok" if ok else "failed", time.monotonic() - start,
                          "" if ok else log)
        proc = subprocess.Popen(args, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            out = proc.communicate()[0]
            return Result(cmd, "bounded", time.monotonic() - start, out[-300:])
        status = "ok" if proc.returncode == 0 else "failed"
        return Result(cmd, status, time.monotonic() - start,
                      "" if status == "ok" else f"exit {proc.returncode}: {out[-1500:]}")

    def close(self) -> None:
        for p in self.servers:
            _stop(p)
        self.servers = []


def check(docs: list[Path], timeout: float, match: str | None = None, report=print
          ) -> list[Result]:
    """Run (or skip) every command of ``docs`` whose text contains ``match``; each result is
    passed to ``report`` as it comes."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    results = []
    for doc in docs:
        cmds = [c for c in extract(doc) if match is None or match in c.text]
        if not cmds:
            continue
        with tempfile.TemporaryDirectory(prefix="docs-check-") as tmp:
            if (ROOT / "models").is_dir():
                os.symlink(ROOT / "models", Path(tmp) / "models")
            runner = Runner(Path(tmp), timeout, env)
            try:
                for c in cmds:
                    r = (Result(c, "skipped", detail=c.skip) if c.skip else _safe_run(runner, c))
                    results.append(r)
                    report(_line(r))
            finally:
                runner.close()
    return results


def _safe_run(runner: Runner, cmd: Command) -> Result:
    try:
        return runner.run(cmd)
    except Exception as e:  # noqa: BLE001 - one failed command, the others still run
        return Result(cmd, "failed", detail=f"{type(e).__name__}: {e}")


def _line(r: Result) -> str:
    c = r.command
    head = f"{r.status:8s} {r.seconds:6.1f}s {c.doc}:{c.line}: {c.text[:110]}"
    if r.status == "failed":
        return head + "\n" + "\n".join("    " + s for s in r.detail.strip().splitlines()[-15:])
    return head + (f"  ({r.detail})" if r.status == "skipped" else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds per command (a server: to become healthy); default 120")
    p.add_argument("--match", default=None, help="only commands whose text contains this")
    p.add_argument("--doc", action="append", default=None,
                   help="only these documents (repeatable; default: README.md, docs/*.md)")
    p.add_argument("--list", action="store_true", help="list the commands, run nothing")
    args = p.parse_args(argv)
    docs = [ROOT / d for d in args.doc] if args.doc else documents()
    if args.list:
        for d in docs:
            for c in extract(d):
                if args.match is None or args.match in c.text:
                    print(f"{'skip: ' + c.skip if c.skip else 'run':20s} {c.doc}:{c.line}: "
                          f"{c.text[:110]}")
        return 0
    results = check(docs, args.timeout, args.match)
    counts = {s: sum(r.status == s for r in results)
              for s in ("ok", "bounded", "failed", "skipped")}
    print(" ".join(f"{k} {v}" for k, v in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
