"""The HTTP server: OpenAI (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``)
and Anthropic (``/v1/messages``) protocols, plus ``/tokenize``, ``/detokenize``,
``/health``, ``/version`` and ``/metrics``.

Two processes (the mini-sglang / SGLang shape)::

    HTTP client ──> API process (FastAPI: protocol, chat template, tokenize, detokenize, SSE,
                        │          API key and body limit, Prometheus metrics)
                        │ ZMQ: AddRequest / Abort / GetStats in,
                        │      StepOutputs / RequestFailed / EngineStats out (messages.py)
                        v
                    engine process (engine_process.py: warm-up, then the LLMEngine.step() loop)

A client request becomes one engine request per choice (``n``, and per prompt for a list of
completion prompts), with unique engine ids; a client that disconnects aborts all of them.
Start it with :func:`latentserve.server.launch.run_server` (or ``start_server`` for a
subprocess). Several models: one engine process each, chosen by the request's
``model`` (``state.ServedModels``; ``run_server`` / ``start_server`` take a list of configs).
"""
