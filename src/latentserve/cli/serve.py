"""``latentserve serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations


def register(sub) -> None:
    from latentserve.cli import add_engine_args

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (repeat --model "
                                      "to serve several models)")
    add_engine_args(p, several_models=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    from latentserve.server.launch import add_server_args

    add_server_args(p)  # --api-key, --max-request-body-bytes, --drain-timeout
    from latentserve.server.replicas import ROUTER_POLICIES

    p.add_argument("--data-parallel-size", "--dp", type=int, default=1,
                   help="N > 1: N replicas on free ports (printed) behind sglang-router on "
                        "--port (docs/scaling.md)")
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="sglang-router policy with --data-parallel-size (default cache_aware)")
    p.set_defaults(func=run)


def run(args) -> int:
    from latentserve.cli import engine_configs
    from latentserve.config import check_device
    from latentserve.server.launch import check_model_names, run_server, server_kwargs

    configs = engine_configs(args)
    for c in configs:
        check_device(c.device)  # before the engine starts: one line, not EngineStartupError
    check_model_names(configs)  # a name served twice fails before any engine starts
    if args.data_parallel_size != 1:
        if len(configs) != 1:
            raise ValueError("--data-parallel-size serves one model; give one --model")
        from latentserve.server.replicas import serve_replicas

        serve_replicas(configs[0], args.data_parallel_size, args.host, args.port,
                       args.router_policy, server_kwargs(args))
        return 0
    run_server(configs[0] if len(configs) == 1 else configs, host=args.host, port=args.port,
               log_level=args.log_level, **server_kwargs(args))
    return 0
