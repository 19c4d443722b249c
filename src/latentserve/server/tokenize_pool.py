"""Tokenization and chat templating off the event loop, in a pool of threads.
Design notes: docs/internals.md, "latentserve.server.tokenize_pool"."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

TOKENIZER_WORKERS = 4


class TokenizerPool:
    """``workers`` threads taking jobs in arrival order; ValueError for ``workers`` below 1.
    The pool sets no bound of its own: ``--max-waiting-requests`` counts a request before it
    gets here (``server/admission.py``)."""

    def __init__(self, workers: int = TOKENIZER_WORKERS):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")  # lazy threads

    async def run(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` in a worker thread. A caller cancelled before its job
        started (a client that hung up) drops the job; a started one runs to its end."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args, **kwargs))


in_pool = TokenizerPool().run  # the server's one tokenizer pool
