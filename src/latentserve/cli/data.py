"""``latentserve data multiplication``: write k x k multiplication training sets in the iCoT
format (``train/tasks.py``), excluding the evaluation sets' questions."""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("data", help="build training data")
    kinds = p.add_subparsers(dest="kind", required=True)
    m = kinds.add_parser("multiplication", help="k x k multiplication in the iCoT format")
    m.add_argument("--k", type=int, required=True, help="digits per operand")
    m.add_argument("--n", type=int, required=True, help="items to write")
    m.add_argument("--out", required=True, help="file to write (iCoT text lines)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--exclude", action="append", default=None,
                   help="iCoT files whose questions are left out (repeatable; default: "
                        "multiplication/{k}x{k}_test.txt and _valid.txt under $LATENTSERVE_DATA)")
    m.set_defaults(func=run_multiplication)


def run_multiplication(args) -> int:
    from latentserve.eval.datasets import data_root
    from latentserve.train.tasks import generate_multiplication, questions_of, write_icot

    if args.k < 1 or args.n < 0:
        raise ValueError(f"need --k >= 1 and --n >= 0, got --k {args.k}, --n {args.n}")
    if args.exclude is None:
        root = data_root() / "multiplication"
        args.exclude = [str(root / f"{args.k}x{args.k}_{s}.txt") for s in ("test", "valid")]
        missing = [p for p in args.exclude if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"evaluation sets to exclude not found: {missing}; set "
                                    "$LATENTSERVE_DATA or pass --exclude (--exclude "
                                    "/dev/null excludes nothing)")
    items = generate_multiplication(args.k, args.n, args.seed, questions_of(args.exclude))
    n = write_icot(items, args.out)
    print(json.dumps({"out": args.out, "n": n, "excluded_from": args.exclude}))
    return 0
