"""``latentserve chat`` and ``latentserve complete`` (``cli/client.py``) against the session's
server: streamed turns, the conversation sent back each turn, ``--quick``, and one error
line for a wrong key, model or address; the reasoning's brackets on a scripted stream."""

import copy
import io
import types

import openai
import pytest
from server_testlib import API_KEY

from latentserve.cli import main


def _stdin(monkeypatch, text: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(text))


def _spy(monkeypatch, cls) -> list[dict]:
    """The keyword arguments of every ``cls.create`` call (the real call still runs)."""
    calls: list[dict] = []
    real = cls.create

    def create(self, **kw):
        calls.append(copy.deepcopy(kw))  # as sent: the client appends to its messages later
        return real(self, **kw)

    monkeypatch.setattr(cls, "create", create)
    return calls


def test_chat_streams_each_turn_and_sends_the_conversation_back(server, monkeypatch, capsys):
    from openai.resources.chat.completions import Completions

    calls = _spy(monkeypatch, Completions)
    _stdin(monkeypatch, "Hello there\n\nAnd then?\n")  # the blank line is no turn
    url = f"{server.base_url}/v1"
    assert main(["chat", "--url", url, "--api-key", API_KEY, "--max-tokens", "6",
                 "--system-prompt", "Be brief."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(calls) == 2 and len(lines) == 2
    assert all(c["stream"] and c["max_tokens"] == 6 for c in calls)
    assert calls[1]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": lines[0]}, {"role": "user", "content": "And then?"}]
    client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    assert calls[0]["model"] == model


def test_complete_quick_prints_one_completion_and_exits(server, monkeypatch, capsys):
    from openai.resources.completions import Completions

    calls = _spy(monkeypatch, Completions)
    _stdin(monkeypatch, "never read\n")
    assert main(["complete", "--url", f"{server.base_url}/v1", "--api-key", API_KEY,
                 "-q", "1, 2, 3,", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert [c["prompt"] for c in calls] == ["1, 2, 3,"] and out.endswith("\n")


@pytest.mark.parametrize("argv,message", [
    (["--api-key", "wrong"], "refused to list its models"),
    (["--api-key", API_KEY, "--model-name", "no-such-model"], "refused the request"),
])
def test_a_refused_quick_request_is_one_error_line(server, capsys, argv, message):
    url = f"{server.base_url}/v1"
    code = main(["chat", "--url", url, "-q", "Hi", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("latentserve: error:") and message in err, err
    assert len(err.splitlines()) == 1


def test_a_refused_turn_is_reported_and_the_session_goes_on(server, monkeypatch, capsys):
    """Interactive: a turn the server refuses (a prompt past the context) is one line on
    stderr, left out of the history; the next turn is answered."""
    from openai.resources.chat.completions import Completions

    calls = _spy(monkeypatch, Completions)
    _stdin(monkeypatch, "word " * 3000 + "\nHi\n")
    assert main(["chat", "--url", f"{server.base_url}/v1", "--api-key", API_KEY,
                 "--max-tokens", "3"]) == 0
    io_ = capsys.readouterr()
    assert io_.err.count("the server refused the request") == 1
    assert len(io_.out.splitlines()) == 1 and len(calls) == 2
    assert calls[1]["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("argv", [[], ["--model-name", "m"]])
def test_no_server_is_one_error_line_naming_the_address(capsys, argv):
    assert main(["complete", "--url", "http://127.0.0.1:9/v1", "-q", "Hi", *argv]) == 2
    assert "no server answers at http://127.0.0.1:9/v1" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["localhost:1/v1", "http://[::1", "ftp://host/v1"])
def test_a_url_that_is_no_http_address_is_refused_naming_the_flag(capsys, url):
    assert main(["chat", "--url", url, "-q", "Hi"]) == 2
    assert "--url" in capsys.readouterr().err


def test_reasoning_deltas_are_shown_in_brackets_before_the_answer(monkeypatch):
    """A stream with ``delta.reasoning_content`` (a ``<think>`` model's text, or a latent
    model's steps): printed in brackets, the answer after; only the answer is sent back."""
    from latentserve.cli import client

    def chunk(content=None, reasoning=None):
        delta = types.SimpleNamespace(content=content, reasoning_content=reasoning)
        return types.SimpleNamespace(choices=[types.SimpleNamespace(delta=delta)])

    sent: list[list] = []

    def create(**kw):
        sent.append(list(kw["messages"]))
        return iter([chunk(reasoning="[step 1: "), chunk(reasoning="\"7\"]"),
                     types.SimpleNamespace(choices=[]), chunk(content="42"), chunk("!")])

    fake = types.SimpleNamespace(chat=types.SimpleNamespace(
        completions=types.SimpleNamespace(create=create)))
    monkeypatch.setattr(client, "_connect", lambda args: (fake, "m"))
    _stdin(monkeypatch, "a\nb\n")
    out = io.StringIO()
    args = types.SimpleNamespace(quick=None, system_prompt=None, max_tokens=None, url="u")
    assert client.run_chat(args, out) == 0
    assert out.getvalue() == '[[step 1: "7"]] 42!\n' * 2
    assert sent[1][1] == {"role": "assistant", "content": "42!"}
