"""``latentserve data multiplication``: write k x k multiplication training sets in the iCoT
format (``train/tasks.py``), excluding the evaluation sets' questions."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MAX_K = 30  # digits per operand (iCoT's sets go to 20 x 20)


def register(sub) -> None:
    p = sub.add_parser("data", help="build training data")
    kinds = p.add_subparsers(dest="kind", required=True)
    m = kinds.add_parser("multiplication", help="k x k multiplication in the iCoT format")
    m.add_argument("--k", type=int, required=True,
                   help="digits per operand, in [1, 30] (the default --exclude has evaluation sets "
                        "for 4 and 5; another k needs --exclude)")
    m.add_argument("--n", type=int, required=True, help="items to write")
    m.add_argument("--out", required=True, help="file to write (iCoT text lines)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--exclude", action="append",
                   help="iCoT files whose questions are left out (repeatable; default: "
                        "multiplication/{k}x{k}_test.txt and _valid.txt, from --data-dir, "
                        "$LATENTSERVE_DATA or the package (4x4 and 5x5 ship))")
    m.add_argument("--data-dir", help="folder searched first for the default --exclude files")
    m.set_defaults(func=run_multiplication)


def run_multiplication(args) -> int:
    from latentserve.eval.datasets import data_dirs, find_data_file
    from latentserve.train.options import check_out
    from latentserve.train.tasks import generate_multiplication, questions_of, write_icot

    if not 1 <= args.k <= MAX_K or args.n < 0:
        raise ValueError(f"need --k in [1, {MAX_K}] and --n >= 0, got --k {args.k}, --n "
                         f"{args.n}")
    out = Path(args.out)
    check_out(out, "an iCoT data file", False, say=lambda m: print(m, file=sys.stderr))
    if args.exclude is None:
        try:
            args.exclude = [str(find_data_file(f"multiplication/{args.k}x{args.k}_{s}.txt",
                                               args.data_dir)) for s in ("test", "valid")]
        except FileNotFoundError:
            where = ", ".join(str(d) for d in data_dirs(args.data_dir))
            raise FileNotFoundError(
                f"--k {args.k}: no evaluation sets multiplication/{args.k}x{args.k}_test.txt "
                f"and _valid.txt to leave out in {where} (4x4 and 5x5 ship, from iCoT); pass "
                "--exclude FILE with the questions to leave out, or --exclude /dev/null for "
                "none") from None
    for path in args.exclude:  # /dev/null is the way to say none
        if path != os.devnull and not questions_of([path], args.k):
            raise ValueError(f"--exclude {path} holds no questions, so it would exclude "
                             f"nothing (--exclude {os.devnull} says none)")
    items = generate_multiplication(args.k, args.n, args.seed, questions_of(args.exclude, args.k))
    out.parent.mkdir(parents=True, exist_ok=True)
    n = write_icot(items, args.out)
    print(json.dumps({"out": args.out, "n": n, "excluded_from": args.exclude}))
    return 0
