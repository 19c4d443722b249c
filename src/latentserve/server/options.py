"""The HTTP server's own options (``latentserve serve`` and ``python -m
latentserve.server.launch``), each declared once with ``options.option``; CORS and the
front-end flags follow vLLM's (``vllm/entrypoints/openai/cli_args.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from latentserve.options import check, json_str_list, option
from latentserve.server.state import DEFAULT_MAX_REQUEST_OUTPUT_TOKENS
from latentserve.server.timeouts import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from latentserve.server.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "LATENTSERVE_API_KEY"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 30.0  # outlasts the clients' idle expiry (docs/server.md says why)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_WAIT = "503 + Retry-After (529 on /v1/messages); default: no limit"


@dataclass(slots=True, kw_only=True)
class ServerOptions:
    """How the server listens, what it allows and logs (each field's ``help``). ValueError
    naming the field and its allowed values."""

    host: str = option("127.0.0.1", "bind address")
    port: int = option(8000, "TCP port (0: any free port)", ge=0, le=65535)
    log_level: str = option("info", "latentserve's log level", choices=UVICORN_LOG_LEVELS)
    api_key: str | None = option(None, "require this key (Bearer or x-api-key) on the API "
                                 f"routes (default: ${API_KEY_ENV}, else no key)")
    max_request_body_bytes: int | None = option(
        None, "refuse larger request bodies with 413 (default 16 MiB)", ge=1)
    drain_timeout: float = option(DEFAULT_DRAIN_TIMEOUT_S, "seconds running requests may take "
                                  "to finish after SIGTERM", ge=0, metavar="SECONDS")
    max_request_output_tokens: int | None = option(
        None, "refuse a request whose prompts x n x max_tokens exceeds this (default "
        f"{DEFAULT_MAX_REQUEST_OUTPUT_TOKENS})", ge=1)
    max_waiting_requests: int | None = option(
        None, f"requests that may wait for a seat (beyond --max-num-seqs) before new ones get "
        f"{_WAIT}", ge=0)
    timeout_keep_alive: float = option(
        DEFAULT_KEEP_ALIVE_S, "close an idle keep-alive connection after this (the default "
        "outlasts clients' idle expiry)", ge=0, metavar="SECONDS")
    timeout_request_headers: float | None = option(
        DEFAULT_HEADER_TIMEOUT_S, "close a connection whose request headers are not complete "
        "this long after it opened (or after its last response; 0: no limit)", ge=0,
        metavar="SECONDS")
    timeout_request_body: float | None = option(
        DEFAULT_BODY_TIMEOUT_S, "close a connection whose request body is not complete this "
        "long after its headers (0: no limit)", ge=0, metavar="SECONDS")
    queue_timeout: float | None = option(
        None, f"a request that waits longer for a seat is aborted with {_WAIT}", gt=0,
        metavar="SECONDS")
    tool_call_parser: str | None = option(
        None, "parse tool calls out of chat answers in this format (tool_choice auto); "
        "default: none, calls stay text", choices=tuple(sorted(TOOL_PARSERS)))
    allowed_origins: list[str] = option(["*"], "CORS: origins allowed, a JSON list of strings",
                                        type=json_str_list)
    allowed_methods: list[str] = option(["*"], "CORS: methods allowed, a JSON list of strings",
                                        type=json_str_list)
    allowed_headers: list[str] = option(["*"], "CORS: request headers allowed, a JSON list "
                                        "of strings", type=json_str_list)
    allow_credentials: bool = option(False, "CORS: allow credentials (cookies, auth headers) "
                                     "cross-site")
    chat_template: str | None = option(
        None, "chat template for every model: a file, or the template itself (default: the "
        "tokenizer's)")
    trust_request_chat_template: bool = option(
        False, "use a request's chat_template field (a Jinja template the server runs); "
        "default: such requests get a 400")
    uvicorn_log_level: str | None = option(None, "uvicorn's log level (default: --log-level)",
                                           choices=UVICORN_LOG_LEVELS)
    log_requests: bool = option(
        False, "log each request's prompt, token ids and sampling parameters at INFO",
        flags=("--enable-log-requests",), off_flags=("--disable-log-requests",))
    max_log_len: int | None = option(
        None, "with --enable-log-requests: log at most this many prompt characters and "
        "token ids (default: all)", ge=1)

    def __post_init__(self) -> None:
        check(self)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")

    @property
    def cors(self) -> dict:
        """``CORSMiddleware``'s options."""
        return {"allow_origins": self.allowed_origins, "allow_methods": self.allowed_methods,
                "allow_headers": self.allowed_headers,
                "allow_credentials": self.allow_credentials}

