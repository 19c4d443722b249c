"""The HTTP server: OpenAI (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``)
and Anthropic (``/v1/messages``) protocols, plus ``/tokenize``, ``/detokenize``,
``/health``, ``/version`` and ``/metrics``.

Design notes: docs/internals.md, "latentserve.server".
"""
