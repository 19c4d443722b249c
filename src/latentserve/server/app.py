"""The FastAPI application: routes, error handlers, and the engine client's lifetime."""

# NOTE: no ``from __future__ import annotations`` here: FastAPI reads the route functions'
# annotations, and the request models are imported inside create_app.

from collections.abc import Callable

from latentserve.server.state import ServerState


def create_app(state: ServerState, on_shutdown: Callable[[], None] | None = None):
    """Build the app around a (not yet started) engine client and the engine's facts.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
    ``GET /health`` (503 once the engine process is gone). The client is started and
    closed by the app's lifespan, inside uvicorn's event loop; ``on_shutdown`` runs last
    (uvicorn re-raises SIGTERM after its shutdown, so cleanup cannot wait until after
    ``uvicorn.run`` returns).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from latentserve.server.chat import create_chat_completion
    from latentserve.server.completions import create_completion
    from latentserve.server.errors import install_error_handlers
    from latentserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard
    from latentserve.server.protocol import ModelList

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

    def as_json(result):
        if isinstance(result, JSONResponse) or not hasattr(result, "model_dump"):
            return result  # a StreamingResponse
        return JSONResponse(result.model_dump(mode="json"))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return as_json(await create_chat_completion(body, request, state))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        return as_json(await create_completion(body, request, state))

    @app.get("/v1/models", response_model=None)
    async def models():
        card = ModelCard(id=state.model_name, max_model_len=state.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/health", response_model=None)
    async def health():
        if state.client.dead_reason is not None:
            return JSONResponse({"status": "error", "reason": state.client.dead_reason},
                                status_code=503)
        client = state.client
        return JSONResponse({"status": "ok", "running": client.num_running,
                             "aborts_sent": client.num_aborts_sent})

    return app
