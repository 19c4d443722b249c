"""The FastAPI application: routes, error handlers, guards, and the engine client's lifetime."""

# NOTE: no ``from __future__ import annotations`` here: FastAPI reads the route functions'
# annotations when create_app defines them (``Request`` is imported there, with FastAPI).

import asyncio
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from pydantic_core import to_jsonable_python

import latentserve
from latentserve.models.checkpoint import NoTokenizer
from latentserve.server.anthropic_api import (
    CountTokensRequest,
    MessagesRequest,
    count_input_tokens,
    create_message,
)
from latentserve.server.chat import create_chat_completion
from latentserve.server.completions import create_completion
from latentserve.server.errors import APIError, install_error_handlers
from latentserve.server.latent_card import latent_card
from latentserve.server.latent_params import checked_template_thinking, thinking_kwargs
from latentserve.server.logprobs import token_texts
from latentserve.server.metrics import MetricsRegistry
from latentserve.server.openapi import declare_errors
from latentserve.server.options import ServerOptions
from latentserve.server.params import check_model as check_served_model
from latentserve.server.params import refuse_unsupported
from latentserve.server.prompts import chat_tools, templated_prompt_ids
from latentserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from latentserve.server.security import GuardMiddleware
from latentserve.server.state import ServedModels, ServerState
from latentserve.server.tokenize_pool import in_pool
from latentserve.server.tools import check_tools

STATS_TIMEOUT_S = 5.0
# /health waits this long for fresh engine stats, then answers with the last ones and their
# age (an engine busy with a long step must not make the health check time out).
HEALTH_STATS_WAIT_S = 0.25
# /tokenize fields that shape the chat template: refused beside a plain prompt.
_CHAT_ONLY = ("tools", "add_generation_prompt", "continue_final_message",
              "chat_template_kwargs", "chat_template")


def create_app(state: ServerState | list[ServerState],
               on_shutdown: Callable[[], None] | None = None, api_key: str | None = None,
               cors: dict | None = None):
    """The app around one ``ServerState`` per served model: the OpenAI and Anthropic APIs,
    ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``, ``/version``, ``/metrics``
    and ``/viewer/``. ``api_key`` None: open; ``cors``: options over ``ServerOptions().cors``. The
    lifespan starts and closes the clients, then runs ``on_shutdown``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    served = ServedModels(state)
    registry = MetricsRegistry(max(s.max_model_len for s in served.states))
    for s in served.states:
        s.metrics = registry.for_model(s.model_name, lambda s=s: s.client.last_stats)

    @asynccontextmanager
    async def lifespan(app):
        try:
            for s in served.states:
                await s.client.start()
            yield
        finally:  # closing a client that did not start is harmless
            for s in served.states:
                await s.client.close()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="latentserve", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key,
                       max_body_bytes=served.states[0].limits.max_request_body_bytes)
    from starlette.middleware.cors import CORSMiddleware

    # outermost: a browser's preflight (OPTIONS, no key) is answered before the key check
    app.add_middleware(CORSMiddleware, **{**ServerOptions().cors, **(cors or {})})

    def as_json(result):  # a dict (non-finite floats as null); a streaming response as it is
        if isinstance(result, dict):
            return JSONResponse(to_jsonable_python(result, inf_nan_mode="null"))
        return result

    def model_state(model: str | None) -> ServerState:
        """The state of the model a request names (checked even with one model)."""
        state = served.resolve(model)
        check_served_model(served.canonical(model), state.model_name)
        return state

    def routed(body) -> ServerState:
        """The state of ``body.model``, whose alias becomes the model's first name."""
        state = served.resolve(body.model)
        body.model = served.canonical(body.model)
        return state

    def cards(s: ServerState) -> list[dict]:
        """One ``/v1/models`` entry per name the model is served under (vLLM lists each),
        with vLLM's fields and ``latent`` (``server/latent_card.py``)."""
        latent = latent_card(s.latent_spec)
        return [{"id": name, "object": "model", "created": int(time.time()),
                 "owned_by": "latentserve", "root": s.root or s.model_name, "parent": None,
                 "max_model_len": s.max_model_len, "latent": latent}
                for name in (s.model_name, *s.aliases)]

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return as_json(await create_chat_completion(body, request, routed(body)))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        return as_json(await create_completion(body, request, routed(body)))

    @app.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request):
        return as_json(await create_message(body, request, routed(body)))

    @app.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(body: CountTokensRequest, request: Request):
        state = routed(body)
        return JSONResponse({"input_tokens": await count_input_tokens(body, request, state)})

    @app.get("/v1/models", response_model=None)
    async def models():
        data = [c for s in served.states for c in cards(s)]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str):
        return JSONResponse(next(c for c in cards(model_state(model_id)) if c["id"] == model_id))

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest):
        refuse_unsupported(body)
        state = model_state(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            sent = [k for k in _CHAT_ONLY if getattr(body, k) is not None
                    and k in body.model_fields_set]
            if sent:  # they shape a chat template, which a prompt does not go through
                raise APIError(f"{sent[0]} applies to messages only; with prompt it would do "
                               "nothing (leave it out)", param=sent[0])
            ids = list(await in_pool(
                state.tokenizer.encode, body.prompt,
                add_special_tokens=body.add_special_tokens is not False))
        else:
            check_tools(chat_tools(body.tools))
            kwargs = body.chat_template_kwargs  # thinking read and rendered as on the chat route
            kwargs = thinking_kwargs(kwargs, checked_template_thinking(kwargs))
            ids = await templated_prompt_ids(body, state, kwargs)
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.return_token_strs:
            texts = token_texts(state.tokenizer)
            out["token_strs"] = [texts.text(t) for t in ids]
        return JSONResponse(out)

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeRequest):
        refuse_unsupported(body)
        state = model_state(body.model)
        limit = state.vocab_size or len(state.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < limit]
        if bad:
            raise APIError(f"tokens must be in [0, {limit}), got {bad[0]}", param="tokens")
        if isinstance(state.tokenizer, NoTokenizer):
            raise APIError("this model directory has no tokenizer files; token ids have no "
                           "text", param="tokens")
        return JSONResponse({"prompt": await in_pool(state.tokenizer.decode, body.tokens)})

    async def model_health(s: ServerState) -> dict:
        client = s.client
        if client.dead_reason is not None:
            return {"model": s.model_name, "status": "error", "reason": client.dead_reason}
        stats = await client.get_stats(HEALTH_STATS_WAIT_S)
        age = (None if client.last_stats_at is None
               else round(time.monotonic() - client.last_stats_at, 3))
        kv = ("kv_slots_free", "kv_slots_cached", "kv_slots_total") if stats else ()
        return {"model": s.model_name, "status": "ok", "ready": True,
                "running": client.num_running, "aborts_sent": client.num_aborts_sent,
                "engine": stats, "engine_stats_age_s": age, **{k: stats[k] for k in kv}}

    @app.get("/health", response_model=None)
    async def health(model: str | None = None):
        """Every engine's health (``?model=NAME``: one); 503 when none is left."""
        states = [model_state(model)] if model is not None else served.states
        entries = list(await asyncio.gather(*(model_health(s) for s in states)))
        if len(entries) == 1:  # the entry's own keys, then "models"
            body = {k: v for k, v in entries[0].items() if k != "model"}
            return JSONResponse({**body, "models": entries},
                                status_code=200 if body["status"] == "ok" else 503)
        ok = [e for e in entries if e["status"] == "ok"]
        status = "ok" if len(ok) == len(entries) else "degraded" if ok else "error"
        body = {"status": status, "ready": bool(ok),
                "running": sum(e["running"] for e in ok),
                "aborts_sent": sum(e["aborts_sent"] for e in ok), "models": entries}
        return JSONResponse(body, status_code=200 if ok else 503)

    from fastapi.responses import RedirectResponse
    from fastapi.staticfiles import StaticFiles

    @app.get("/viewer", include_in_schema=False)
    async def viewer():
        return RedirectResponse("viewer/")  # relative: works behind a path prefix too

    app.mount("/viewer", StaticFiles(directory=Path(__file__).parent / "viewer", html=True),
              name="viewer")

    @app.get("/version", response_model=None)
    async def version():
        return JSONResponse({"version": latentserve.__version__})

    @app.get("/metrics", response_model=None)
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        await asyncio.gather(*(s.client.get_stats(STATS_TIMEOUT_S) for s in served.states))
        return Response(generate_latest(registry.registry), media_type=CONTENT_TYPE_LATEST)

    declare_errors(app)  # /openapi.json: the real error responses, no 422
    return app
