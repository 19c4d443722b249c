"""Teacher-forced probe of a CoLaR model (``train colar`` output) at each thinking speed.

For the first N items of an iCoT file, feed the prompt at speed r, the gold compressed
steps (each group of r step tokens compressed as in training, by colar_config.json's
``compression``) and the answer, in one fp32 pass on CPU, and report per r: the share of
answers whose every token is the argmax (``answer_exact``), the mean share of answer tokens that are
(``answer_tokens``), and the mean cosine between the latent policy's mean (times
``embeds_std``) and the gold next compressed input (``latent_cosine``). This separates the
two ways the closed loop can fail: the backbone not reading compressed steps (low
``answer_exact`` here) or the policy drifting (high here, low in ``latentserve eval``).

Usage: python scripts/colar_teacher_forced.py MODEL_DIR DATA.txt [N=100] [r ...]
Prints one JSON line per r.
"""

import json
import sys

import torch

from latentserve.latent import colar
from latentserve.train.colar import compress_groups
from latentserve.train.cot import encode_parts, read_items
from tests.support.colar_reference import load_colar_reference


@torch.no_grad()
def probe(model_dir: str, data: str, n: int, speeds: list[int]) -> list[dict]:
    model, tok, cfg, policy = load_colar_reference(model_dir)
    items = read_items(data)[:n]
    parts = encode_parts(tok, items)
    emb = model.get_input_embeddings()
    sep = tok.convert_tokens_to_ids(colar.SEPARATOR)
    rows = []
    for r in speeds:
        prompts = (colar.prompt_ids(tok, [it.question for it in items], r, separator=False) if r > 1
                   else [p for p, _, _ in parts])
        exact, tokens, cosine = 0, 0.0, 0.0
        for (_, steps, answer), prompt in zip(parts, prompts):
            pad = [-1] * (-len(steps) % r)
            gold = compress_groups(emb, torch.tensor(steps + pad).view(-1, r), cfg.compression)
            x = torch.cat([emb(torch.tensor(prompt + [sep])), gold, emb(torch.tensor(answer))])
            hidden = model.model(inputs_embeds=x[None]).last_hidden_state[0]
            q, k = len(prompt), len(gold)  # q: the opening ###; c_K predicts the closing one
            pred = model.lm_head(hidden[q + k:q + k + len(answer)]).argmax(-1).tolist()
            exact += pred == answer
            tokens += sum(a == b for a, b in zip(pred, answer)) / len(answer)
            mean = policy(hidden[q:q + k].float()).mean * cfg.embeds_std
            cosine += torch.nn.functional.cosine_similarity(mean, gold, dim=-1).mean().item()
        rows.append({"compression_factor": r, "n": len(items), "answer_exact": exact / len(items),
                     "answer_tokens": round(tokens / len(items), 4),
                     "latent_cosine": round(cosine / len(items), 4)})
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    speeds = [int(a) for a in args[3:]] or [1, 2, 3, 4]
    for row in probe(args[0], args[1], int(args[2]) if len(args) > 2 else 100, speeds):
        print(json.dumps(row), flush=True)
