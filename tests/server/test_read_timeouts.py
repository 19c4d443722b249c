"""Connection read timeouts (issue 28, ``server/timeouts.py``): a client that opens a
connection and sends nothing, stalls in its headers, or stalls in its body is disconnected
within the bound, while the server keeps answering others; an idle keep-alive connection
is closed after ``--timeout-keep-alive``."""

import socket
import time

import httpx
import pytest

BOUND_S = 1.0
SLACK_S = 2.0  # the bound plus scheduling noise on a busy CI machine


@pytest.fixture(scope="module")
def timed_server(scripted_model_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=2),
                       timeout=300, timeout_keep_alive=BOUND_S,
                       timeout_request_headers=BOUND_S, timeout_request_body=BOUND_S)
    yield srv
    srv.stop()


def _closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``sock`` (reads until EOF), at most ``limit``."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return float("inf")
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def _connect(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


@pytest.mark.parametrize("sent", [
    b"",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
], ids=["nothing", "half-headers", "half-body"])
def test_a_stalled_client_is_disconnected_within_the_bound(timed_server, sent):
    with _connect(timed_server) as sock:
        sock.sendall(sent)
        assert _closed_after(sock, BOUND_S + 10) < BOUND_S + SLACK_S


def test_headers_a_byte_at_a_time_are_cut_at_the_bound(timed_server):
    """Each byte would reset a per-read timer; the bound is on the whole headers."""
    head = b"GET /version HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    with _connect(timed_server) as sock:
        start = time.monotonic()
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - start < BOUND_S + SLACK_S


def test_server_stays_responsive_while_clients_stall(timed_server):
    stalled = [_connect(timed_server) for _ in range(50)]
    try:
        for sock in stalled:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        r = httpx.get(f"{timed_server.base_url}/version", timeout=10)
        assert r.status_code == 200 and time.monotonic() - start < 1.0
    finally:
        for sock in stalled:
            sock.close()


def test_idle_keep_alive_connection_is_closed(timed_server):
    with _connect(timed_server) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        assert _closed_after(sock, BOUND_S + 10) < BOUND_S + SLACK_S


def test_a_slow_request_within_the_bound_is_served(timed_server):
    """Headers and body each just inside the bound: a 200, and a generation that takes
    longer than the bound is not cut (no timer runs while the app answers)."""
    model = httpx.get(f"{timed_server.base_url}/v1/models").json()["data"][0]["id"]
    body = (b'{"model": "%s", "prompt": [3000], "max_tokens": 100, "ignore_eos": true}'
            % model.encode())
    with _connect(timed_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(BOUND_S / 3)
        sock.sendall(b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n" % len(body))
        sock.sendall(body[:10])
        time.sleep(BOUND_S / 3)
        sock.sendall(body[10:])
        sock.settimeout(60)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":100' in reply


def test_default_keep_alive_outlives_the_sdks_idle_expiry():
    """The server's idle keep-alive timeout is longer than the connection pools' idle expiry
    of the ``openai`` and ``anthropic`` SDKs, so that the client drops an idle connection
    first (equal timeouts race: a request sent as the server closes gets a reset)."""
    import argparse

    import anthropic._base_client
    import openai._base_client

    from latentserve.options import add_options
    from latentserve.server.options import DEFAULT_KEEP_ALIVE_S, ServerOptions

    parser = argparse.ArgumentParser()
    add_options(parser, ServerOptions)
    assert parser.parse_args([]).timeout_keep_alive == DEFAULT_KEEP_ALIVE_S
    for sdk in (openai._base_client, anthropic._base_client):
        assert sdk.DEFAULT_CONNECTION_LIMITS.keepalive_expiry < DEFAULT_KEEP_ALIVE_S
