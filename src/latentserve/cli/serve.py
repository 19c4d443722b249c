"""``latentserve serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations


def register(sub) -> None:
    from latentserve.cli import add_engine_args

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    from latentserve.server.launch import add_server_args

    add_server_args(p)  # --api-key, --max-request-body-bytes, --drain-timeout
    p.set_defaults(func=run)


def run(args) -> int:
    from latentserve.cli import engine_config
    from latentserve.server.launch import run_server, server_kwargs

    run_server(engine_config(args), host=args.host, port=args.port, log_level=args.log_level,
               **server_kwargs(args))
    return 0
