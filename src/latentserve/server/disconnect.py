"""Notice an HTTP client that went away while its request is still generating."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


@asynccontextmanager
async def on_disconnect(request, callback: Callable[[], None]) -> AsyncIterator[None]:
    """Run ``callback()`` once if the client disconnects while the block runs (a task
    waits on ``receive()``, which only returns ``http.disconnect`` once the body is read)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                callback()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
