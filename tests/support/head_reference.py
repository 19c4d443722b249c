"""The eager compression-head reference (``latentserve.bench.baseline.head_reference``) with
the stop head's decision and prompt injection (docs/internals.md,
"latentserve.bench.baseline.head_reference")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latentserve.bench.baseline import head_reference as base


class HeadReference(base.HeadReference):
    """``mode`` ``"closed_loop"`` (with the stop head: before step k, ``p =
    sigmoid(stop(LN(anchor)))``; ``use_stop and k >= min_latent and p > stop_threshold`` ends
    the phase "stop") or ``"prompt"`` (the prompt run again with its last input embedding
    replaced by the decoded latent; no closing ids)."""

    def __init__(self, *args, mode: str = "closed_loop", min_latent: int = 0,
                 use_stop: bool = True, stop_threshold: float = 0.5, **kw):
        super().__init__(*args, **kw)
        self.mode, self.min_latent, self.stop_threshold = mode, min_latent, stop_threshold
        self.use_stop = use_stop and self.stop_net is not None

    def stops(self, res: dict, anchor) -> bool:
        if self.stop_net is None:
            return False
        ln = F.layer_norm(anchor.float(), (self.cfg["hidden_size"],))
        p = float(torch.sigmoid(self.stop_net(ln))[0])
        m = res["max_stop_prob"]
        res["max_stop_prob"] = p if m is None else max(m, p)
        if self.use_stop and res["steps"] >= self.min_latent and p > self.stop_threshold:
            res.update(end="stop", stop_step=res["steps"])
            return True
        return False

    def think(self, res: dict, ids, close_ids, max_latent: int, max_tokens: int):
        if self.mode != "prompt":
            return super().think(res, ids, close_ids, max_latent, max_tokens)
        _, anchor = self.run(self.embed(ids))
        embeds = self.embed(ids).clone()
        embeds[-1] = self.decode(anchor).to(embeds.dtype)
        self.past = None
        logits, _ = self.run(embeds)
        res.update(steps=1, end="prompt")
        return logits, 0


def head_reference_generate(model_dir, bundle_path, prompt_ids: list[int], open_ids, close_ids,
                            *, mode: str = "closed_loop", max_latent: int = 8,
                            min_latent: int = 0, use_stop: bool = True,
                            stop_threshold: float = 0.5, max_tokens: int = 16, eos_ids=(),
                            dtype: str = "float32", device: str = "cpu") -> dict:
    """One greedy request (``HeadReference.generate``'s result), the bundle read anew."""
    ref = HeadReference(model_dir, bundle_path, dtype, device, mode=mode,
                        min_latent=min_latent, use_stop=use_stop, stop_threshold=stop_threshold)
    return ref.generate(prompt_ids, open_ids, close_ids, max_latent, max_tokens, eos_ids)
