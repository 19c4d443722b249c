"""How many digits share a compressed step: for an iCoT multiplication file, group each
item's step tokens (SmolLM2's tokenizer, as ``train colar`` does) in runs of r and count the
groups holding two or more digits, and two or more different digits (whose order a sum of
embeddings cannot tell apart). docs/results.md, "The c = 4 goal is not met".

Usage: python scripts/colar_group_digits.py DATA.txt [r ...]   (default r: 2 3 4)
Prints one JSON line per r.
"""

import json
import sys

from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir
from latentserve.train.cot import encode_parts, read_items


def count(data: str, speeds: list[int]) -> list[dict]:
    tok = load_tokenizer(resolve_model_dir(None))
    steps = [[tok.decode([t]).strip() for t in s] for _, s, _ in
             encode_parts(tok, read_items(data))]
    rows = []
    for r in speeds:
        groups = [[t for t in s[g:g + r] if t.isdigit()] for s in steps
                  for g in range(0, len(s), r)]
        rows.append({"data": data, "compression_factor": r, "groups": len(groups),
                     "two_or_more_digits": round(sum(len(d) >= 2 for d in groups)
                                                 / len(groups), 4),
                     "two_or_more_different_digits": round(sum(len(set(d)) >= 2 for d in groups)
                                                           / len(groups), 4)})
    return rows


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for row in count(sys.argv[1], [int(a) for a in sys.argv[2:]] or [2, 3, 4]):
        print(json.dumps(row), flush=True)
