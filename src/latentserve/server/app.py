"""The FastAPI application: routes, error handlers, guards, and the engine client's lifetime."""

# NOTE: no ``from __future__ import annotations`` here: FastAPI reads the route functions'
# annotations, and the request models are imported inside create_app.

from collections.abc import Callable

from latentserve.server.state import ServerState

STATS_TIMEOUT_S = 5.0


def create_app(state: ServerState, on_shutdown: Callable[[], None] | None = None,
               api_key: str | None = None):
    """Build the app around a (not yet started) engine client and the engine's facts.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages``
    (Anthropic), ``POST /v1/messages/count_tokens``, ``GET /v1/models``, ``POST /tokenize``,
    ``POST /detokenize``, ``GET /health`` (the engine's live stats, including
    ``kv_slots_free`` / ``kv_slots_cached`` / ``kv_slots_total``; 503 once the engine
    process is gone), ``GET /version``, ``GET /metrics`` (Prometheus). ``api_key`` (None: no
    authentication) and ``state.limits.max_request_body_bytes`` are enforced by
    ``security.GuardMiddleware``. The client is started and closed by the app's lifespan,
    inside uvicorn's event loop; ``on_shutdown`` runs last (uvicorn re-raises SIGTERM after
    its shutdown, so cleanup cannot wait until after ``uvicorn.run`` returns).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    import latentserve
    from latentserve.server.anthropic_api import (
        CountTokensRequest,
        MessagesRequest,
        create_message,
    )
    from latentserve.server.chat import create_chat_completion
    from latentserve.server.completions import create_completion
    from latentserve.server.errors import APIError, install_error_handlers
    from latentserve.server.logprobs import token_texts
    from latentserve.server.metrics import ServerMetrics
    from latentserve.server.params import check_model as check_served_model
    from latentserve.server.prompts import chat_prompt_ids
    from latentserve.server.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
        ModelCard,
        ModelList,
        TokenizeRequest,
    )
    from latentserve.server.security import GuardMiddleware

    if state.metrics is None:
        state.metrics = ServerMetrics(state.model_name, lambda: state.client.last_stats)

    @asynccontextmanager
    async def lifespan(app):
        await state.client.start()
        try:
            yield
        finally:
            await state.client.close()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="latentserve", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key,
                       max_body_bytes=state.limits.max_request_body_bytes)

    def as_json(result):
        if isinstance(result, (JSONResponse, dict)) or not hasattr(result, "model_dump"):
            return JSONResponse(result) if isinstance(result, dict) else result
        return JSONResponse(result.model_dump(mode="json"))

    def check_model(model):
        check_served_model(model, state.model_name)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return as_json(await create_chat_completion(body, request, state))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        return as_json(await create_completion(body, request, state))

    @app.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request):
        return as_json(await create_message(body, request, state))

    @app.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(body: CountTokensRequest):
        from latentserve.server.anthropic_api import _conversation
        from latentserve.server.prompts import render_chat

        conversation = _conversation(body)
        ids = render_chat(state.tokenizer, conversation,
                          continue_final_message=conversation[-1]["role"] == "assistant")
        return JSONResponse({"input_tokens": len(ids)})

    @app.get("/v1/models", response_model=None)
    async def models():
        card = ModelCard(id=state.model_name, max_model_len=state.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str):
        check_model(model_id)
        card = ModelCard(id=state.model_name, max_model_len=state.max_model_len)
        return JSONResponse(card.model_dump(mode="json"))

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            ids = list(state.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens is not False))
        else:
            ids = chat_prompt_ids(state.tokenizer, body.messages,
                                  template_kwargs=body.chat_template_kwargs,
                                  add_generation_prompt=body.add_generation_prompt is not False,
                                  continue_final_message=bool(body.continue_final_message))
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if body.return_token_strs:
            texts = token_texts(state.tokenizer)
            out["token_strs"] = [texts.text(t) for t in ids]
        return JSONResponse(out)

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        limit = state.vocab_size or len(state.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < limit]
        if bad:
            raise APIError(f"tokens must be in [0, {limit}), got {bad[0]}", param="tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    @app.get("/health", response_model=None)
    async def health():
        client = state.client
        if client.dead_reason is not None:
            return JSONResponse({"status": "error", "reason": client.dead_reason},
                                status_code=503)
        stats = await client.get_stats(STATS_TIMEOUT_S)
        body = {"status": "ok", "ready": True, "running": client.num_running,
                "aborts_sent": client.num_aborts_sent, "engine": stats}
        if stats:
            for key in ("kv_slots_free", "kv_slots_cached", "kv_slots_total"):
                body[key] = stats[key]
        return JSONResponse(body)

    @app.get("/version", response_model=None)
    async def version():
        return JSONResponse({"version": latentserve.__version__})

    @app.get("/metrics", response_model=None)
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        await state.client.get_stats(STATS_TIMEOUT_S)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
