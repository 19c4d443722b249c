"""``latentserve serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations


def register(sub) -> None:
    from latentserve.cli import add_engine_args
    from latentserve.options import add_options, ranged
    from latentserve.server.options import ServerOptions
    from latentserve.server.replicas import ROUTER_POLICIES

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (repeat --model "
                                      "to serve several models)")
    add_engine_args(p, several_models=True)
    add_options(p, ServerOptions)  # --host, --port, --api-key, --drain-timeout, ...
    p.add_argument("--data-parallel-size", "--dp", type=ranged(int, "data_parallel_size", ge=1),
                   default=1,
                   help="N > 1: N replicas on free ports (printed) behind sglang-router on "
                        "--port (docs/scaling.md)")
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="sglang-router policy with --data-parallel-size (default cache_aware)")
    p.set_defaults(func=run)


def run(args) -> int:
    from latentserve.cli import engine_configs
    from latentserve.config import check_device
    from latentserve.options import options_of
    from latentserve.server.launch import run_server
    from latentserve.server.options import ServerOptions

    configs = engine_configs(args)
    options = options_of(ServerOptions, args)
    for c in configs:
        check_device(c.device)  # before the engine starts: one line, not EngineStartupError
    if args.data_parallel_size != 1:
        if len(configs) != 1:
            raise ValueError("--data-parallel-size serves one model; give one --model")
        from latentserve.server.replicas import serve_replicas

        serve_replicas(configs[0], args.data_parallel_size, options, args.router_policy)
    else:
        run_server(configs, options)
    return 0
