"""Constants and helpers shared by the server tests (imported by conftest.py and tests).

The scripted model: a tiny Llama whose next token is a fixed function of the current one
(``script()``), so tests can make it write exact text: multi-byte characters split over
tokens, and repeats for the penalties.
"""

import itertools
import math
import time

MAX_MODEL_LEN = 256
API_KEY = "test-key-123"
VOCAB = 49152
# A completion prompt on which the tiny CoLaR of ``colar_key_server`` stops after 4 latent
# steps (greedy): the stop fires, so a client sees the phase end with ``end: "stop"``.
COLAR_STOPS = "Question: w75 w76 w77 Let's think step by step:"
COLAR_STOP_STEPS = 4

# --- the scripted model --------------------------------------------------------------------
# next-token logits for the current token: {token: [(next token, logit), ...]}, others 0.
SCRIPT_START = 1000  # a prompt ending in this token makes the model write SCRIPT_TEXT
SCRIPT_TEXT = "héllo 😀 世界!"
SCRIPT_IDS = [88, 2756, 31394, 40303, 218, 216, 7906, 240, 178, 239, 230, 17]  # its tokens
EOS = 2
SCRIPT_LOGIT = 10.0
# A two-token loop with runners-up: A -> B (8) or X (7); B -> A (8) or Y (7).
A, B, X, Y = 3000, 3001, 3002, 3003
LOOP = {A: [(B, 8.0), (X, 7.0)], B: [(A, 8.0), (Y, 7.0)]}
RMS_EPS = 1e-6


class StandInClient:
    """The engine client's surface with nothing behind it (no model, no process): a test's
    subclass writes ``generate`` (and ``get_stats`` where the health check matters)."""

    dead_reason = None
    num_running = 0
    num_aborts_sent = 0
    last_stats = last_stats_at = None

    async def start(self):
        pass

    async def close(self):
        pass

    async def get_stats(self, timeout=5.0):
        return None

    def abort(self, rid):
        pass


class OneTokenClient(StandInClient):
    """A stand-in engine that answers every request with one token and ``length`` and passes
    every check: a request it sees got past the API process's checks."""

    async def generate(self, rid, prompt_ids, params):
        from latentserve.outputs import StepOutput

        yield StepOutput(rid, [28], True, "length")

    async def check(self, rid, prompt_ids, params, timeout=30.0):
        pass


def stand_in_app(tokenizer, model: str = "m"):
    """An in-process app (a ``TestClient``; use it in ``with``) serving ``model``, a plain
    model with ``tokenizer``, a 256-token context and a ``OneTokenClient``: fast checks of
    what the API refuses."""
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerState

    state = ServerState(OneTokenClient(), tokenizer, model, MAX_MODEL_LEN, VOCAB)
    return TestClient(create_app(state), raise_server_exceptions=False)


def script() -> dict[int, list[tuple[int, float]]]:
    chain = [SCRIPT_START, *SCRIPT_IDS, EOS]
    out = {cur: [(nxt, SCRIPT_LOGIT)] for cur, nxt in zip(chain, chain[1:])}
    out.update(LOOP)
    return out


def scripted_logit(logit: float, hidden: int = 64) -> float:
    """The logit the scripted model really produces for a scripted ``logit`` (RMSNorm's
    epsilon shrinks it a little)."""
    return logit / math.sqrt(hidden) / math.sqrt(1.0 / hidden + RMS_EPS)


def save_scripted(out_dir, table: dict[int, list[tuple[int, float]]], **overrides):
    """A tiny untied Llama whose logits depend only on the current token: attention and MLP
    outputs are zero, so the last hidden state is the token's embedding; token c (the d-th
    key of ``table``) embeds as the unit vector e_d, and lm_head row s holds
    ``logit / sqrt(hidden)`` in column d for each ``(s, logit)`` in ``table[c]``. Tokens
    outside ``table`` embed as zero (all logits 0). ``overrides`` go to the config
    (``vocab_size``)."""
    import torch
    import transformers as tf

    from latentserve.bench.baseline.tiny_models import save_tiny

    save_tiny(out_dir, "llama-untied", max_position_embeddings=MAX_MODEL_LEN,
              rms_norm_eps=RMS_EPS, **overrides)
    model = tf.LlamaForCausalLM.from_pretrained(out_dir)
    hidden = model.config.hidden_size
    assert len(table) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        for d, (cur, nexts) in enumerate(table.items()):
            emb[cur, d] = 1.0
            for nxt, logit in nexts:
                head[nxt, d] = logit / math.sqrt(hidden)
    model.save_pretrained(out_dir)
    return out_dir


def _entries(health: dict) -> list[dict]:
    """The per-model entries of a ``/health`` body (one per served model)."""
    return health.get("models") or [health]


def _idle(entry: dict) -> bool:
    engine = entry.get("engine") or {}
    return (entry.get("running") == 0 and engine.get("num_running") == 0
            and engine.get("num_waiting") == 0)


def wait_idle(http, timeout: float = 30.0) -> dict:
    """Poll ``/health`` until no request runs in the API process or any engine (every
    served model); return it."""
    deadline = time.monotonic() + timeout
    health = None
    while time.monotonic() < deadline:
        health = http.get("/health").json()
        if health.get("running") == 0 and all(_idle(e) for e in _entries(health)):
            return health
        time.sleep(0.05)
    raise AssertionError(f"requests still running: {health}")


def assert_slots_invariant(health: dict) -> None:
    """With nothing running, every KV slot of every served model's engine is free or held
    by the prefix cache."""
    for entry in _entries(health):
        assert entry["kv_slots_free"] + entry["kv_slots_cached"] == entry["kv_slots_total"], \
            entry


def engine_processes(server) -> list:
    """The engine processes (``psutil.Process``) of a ``ServerProcess``, in start order:
    its multiprocessing children other than the resource tracker."""
    import psutil

    children = psutil.Process(server.proc.pid).children(recursive=True)
    return [p for p in children if "spawn_main" in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())]



def scripted_chat(tokenizer, replies: dict[int, list[str]]) -> dict[int, list[tuple[int, float]]]:
    """A ``save_scripted`` table under which a prompt ending in token ``t`` is answered with
    the pieces of ``replies[t]``, then EOS. Each piece becomes a token of its own, added to
    ``tokenizer`` (ids from ``len(tokenizer)`` on; the model's vocabulary must reach them), so
    a reply may repeat any text: a scripted model's next token depends on this one only.

    Raises:
        ValueError: a piece given twice or already a token.
    """
    pieces = [p for reply in replies.values() for p in reply]
    if len(set(pieces)) != len(pieces) or any(p in tokenizer.get_vocab() for p in pieces):
        raise ValueError("each piece must be new and given once")
    tokenizer.add_tokens(pieces)
    vocab = tokenizer.get_vocab()
    table = {}
    for start, reply in replies.items():
        chain = [start, *(vocab[p] for p in reply), EOS]
        table.update({cur: [(nxt, SCRIPT_LOGIT)] for cur, nxt in itertools.pairwise(chain)})
    return table
