"""The GPU benchmark of ``latentserve bench --suite gpu`` (``latentserve.bench.gpu``) with
a choice of shapes: ``python -m benchmarks.gpu [OUT.json] [shape,shape] [--no-hf]``."""

from __future__ import annotations

from benchmarks.common import parser, write_json
from latentserve.bench import gpu
from latentserve.bench.gpu import SHAPES
from latentserve.bench.suite import run_suite


def main(argv=None) -> int:
    p = parser("gpu", __doc__)
    p.add_argument("out", nargs="?", default="gpu_bench.json", help="JSON output path")
    p.add_argument("shapes", nargs="?", default=",".join(SHAPES),
                   help=f"comma list of {list(SHAPES)}")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    args = p.parse_args(argv)
    write_json(args.out, run_suite(gpu, tuple(args.shapes.split(",")),
                                   hf_baseline=not args.no_hf))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
