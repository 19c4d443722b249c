"""The OpenAI-compatible HTTP server.

Two processes (the mini-sglang / SGLang shape)::

    HTTP client ──> API process (FastAPI: protocol, chat template, tokenize, detokenize, SSE)
                        │ ZMQ: AddRequest / Abort in, batches of StepOutput out (messages.py)
                        v
                    engine process (engine_process.py: LLMEngine.step() loop)

Start it with :func:`latentserve.server.launch.run_server`.
"""
