"""``latentserve convert``: an upstream COCONUT / CODI / PCCoT checkpoint into a model
directory (``latent/convert.py``, ``latent/loop_convert.py``; docs/models.md)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("convert", help="turn an upstream COCONUT / CODI / PCCoT checkpoint "
                                       "into a latentserve model directory")
    add_args(p)
    p.set_defaults(func=run)


def add_args(p) -> None:
    """``latentserve convert {coconut,codi} --base DIR --checkpoint FILE --out DIR ...`` and
    ``latentserve convert pccot --base DIR --adapter DIR --out DIR``."""
    p.add_argument("family", choices=["coconut", "codi", "pccot"], help="upstream checkpoint form")
    p.add_argument("--base", required=True, help="the base HF model directory it was trained from")
    p.add_argument("--checkpoint",
                   help="COCONUT: checkpoint_N; CODI: model.safetensors or pytorch_model.bin")
    p.add_argument("--adapter",
                   help="PCCoT: the upstream PEFT adapter directory (pccot_args.json, ...)")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--default-budget", type=int, help="COCONUT/CODI: latent steps by default (6)")
    p.add_argument("--max-budget", type=int,
                   help="the largest budget allowed (64; PCCoT: at least num_iterations)")
    p.add_argument("--variant", help="COCONUT/CODI: informative tag, e.g. sim-cot")
    p.add_argument("--lora-alpha", type=float, help="CODI LoRA alpha (32)")
    p.add_argument("--keep-eos", action="store_true",
                   help="CODI trained without --remove_eos: latents in [eos, bot] ... [eot, eos]")
    p.add_argument("--symlink", action="store_true", help="link the checkpoint instead of copying")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")


# Which optional flags each form reads; another one given is an error, not silently dropped.
_FLAGS = {"coconut": {"checkpoint", "default_budget", "variant", "symlink"},
          "codi": {"checkpoint", "default_budget", "variant", "symlink", "lora_alpha",
                   "keep_eos"},
          "pccot": {"adapter"}}


def run(args) -> int:
    unused = [n for n in sorted(set().union(*_FLAGS.values()) - _FLAGS[args.family])
              if getattr(args, n) is not None and getattr(args, n) is not False]
    if unused:
        flag = "--" + unused[0].replace("_", "-")
        raise ValueError(f"convert {args.family} does not take {flag}")
    pccot = args.family == "pccot"
    source = args.adapter if pccot else args.checkpoint
    if not source:
        raise ValueError(f"convert {args.family} needs "
                         + ("--adapter DIR" if pccot else "--checkpoint FILE"))
    from latentserve.latent.convert import convert_coconut, convert_codi
    from latentserve.latent.loop_convert import convert_pccot

    # the form's own flags as its converter's keywords; one not given takes the default
    opts = {n: getattr(args, n) for n in _FLAGS[args.family] - {"checkpoint", "adapter", "keep_eos"}
            | {"max_budget"} if getattr(args, n) is not None}
    if args.family == "codi":
        opts["remove_eos"] = not args.keep_eos
    convert = {"coconut": convert_coconut, "codi": convert_codi, "pccot": convert_pccot}
    out = convert[args.family](args.base, source, args.out, overwrite=args.force, **opts)
    print(f"wrote {out}")
    return 0
