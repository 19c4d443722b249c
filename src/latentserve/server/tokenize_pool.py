"""Tokenization and chat templating off the event loop, in a bounded pool of threads.
Design notes: docs/internals.md, "latentserve.server.tokenize_pool"."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from latentserve.server.serving import overloaded

TOKENIZER_WORKERS = 4
MAX_PENDING_JOBS = 64


class TokenizerPool:
    """``workers`` threads, at most ``max_pending`` jobs; ValueError for either below 1."""

    def __init__(self, workers: int = TOKENIZER_WORKERS, max_pending: int = MAX_PENDING_JOBS):
        if workers < 1 or max_pending < 1:
            raise ValueError(f"workers and max_pending must be >= 1, got {workers}, "
                             f"{max_pending}")
        self.max_pending = max_pending
        self.pending = 0  # jobs queued or running
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")  # lazy threads

    async def run(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` in a worker thread; 503 ``overloaded`` past ``max_pending``."""
        with self._lock:
            if self.pending >= self.max_pending:
                raise overloaded(f"the server is overloaded ({self.pending} prompts are being "
                                 f"tokenized, at most {self.max_pending}); retry later")
            self.pending += 1
        try:
            future = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)  # on completion, or when cancelled unstarted
        return await asyncio.wrap_future(future)

    def _done(self, _future) -> None:
        with self._lock:
            self.pending -= 1


in_pool = TokenizerPool().run  # the server's one tokenizer pool
