"""The HTTP server: the OpenAI and Anthropic protocols over one engine process per model.
Design notes: docs/internals.md, "latentserve.server"."""
