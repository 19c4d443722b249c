"""The in-process engine: model, KV pool, scheduler and sampler behind
``add_request`` / ``abort_request`` / ``step``. The offline ``LLM`` and the server's engine
process both drive this class."""

from __future__ import annotations

import logging

import torch

from latentserve.config import EngineConfig
from latentserve.core import Req
from latentserve.outputs import StepOutput
from latentserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    """Loads ``config.model`` and serves requests step by step.

    Attributes: ``tokenizer`` (transformers), ``model_name`` (str), ``max_model_len`` (int),
    ``num_kv_slots`` (int), ``runner`` (ModelRunner), ``scheduler`` (Scheduler).

    Raises (constructor): FileNotFoundError / ValueError from model resolution and loading;
    ValueError when the KV pool cannot hold one full-length request.
    """

    def __init__(self, config: EngineConfig):
        from latentserve.attention.base import make_backend
        from latentserve.engine.kv_sizing import kv_slots_for
        from latentserve.engine.model_runner import ModelRunner
        from latentserve.kvcache.allocator import SlotAllocator
        from latentserve.kvcache.pool import KVPool, PageTable
        from latentserve.kvcache.radix import RadixCache
        from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir
        from latentserve.models.loader import load_model
        from latentserve.scheduler.cache import CacheManager
        from latentserve.scheduler.scheduler import Scheduler

        self.config = config
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        model_dir = resolve_model_dir(config.model)
        self.model_dir = model_dir
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.tokenizer = load_tokenizer(model_dir)
        model, hf_config = load_model(model_dir, config.torch_dtype, config.device)
        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size
        limit = getattr(hf_config, "max_position_embeddings", None) or hf_config.n_positions
        self.max_model_len = min(config.max_model_len or limit, limit)
        layers, kv_heads, head_dim = model.kv_shape
        per_slot = KVPool.bytes_per_slot(layers, kv_heads, head_dim, config.torch_dtype)
        slots = kv_slots_for(config, per_slot, self.max_model_len, hf_config.vocab_size)
        self.num_kv_slots = slots
        pool = KVPool(layers, slots, kv_heads, head_dim, config.torch_dtype, self.device)
        table = PageTable(config.max_num_seqs, self.max_model_len, self.device)
        allocator = SlotAllocator(slots, self.device)
        radix = RadixCache(allocator, enabled=config.enable_prefix_caching)
        self.cache = CacheManager(allocator, radix, table)
        self.eos_ids = _eos_ids(model_dir, self.tokenizer, hf_config)
        self.latent_spec = getattr(model, "latent_spec", None)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   self.eos_ids, self.latent_spec)
        self.runner = ModelRunner(model, pool, table, make_backend(config.backend_name),
                                  self.device)
        if (self.device.type == "cuda" and config.backend_name == "triton"
                and not config.enforce_eager):
            hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
            self.runner.capture_graphs(min(config.max_num_seqs, 256), hidden,
                                       config.torch_dtype)
        self._rids: set[str] = set()
        self._arrivals = 0
        log.info("engine ready: %s, %d KV slots, max_model_len %d", self.model_name, slots,
                 self.max_model_len)

    def add_request(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError (naming the field) for an empty prompt, a prompt
        of max_model_len tokens or more (latent positions and transition tokens included), a
        token id outside the vocabulary, a prompt the KV pool cannot hold, a latent_budget
        above the model's cap, or a duplicate ``rid``.

        For a model with a ``LatentSpec`` the spec's start ids are appended to the prompt and
        the request runs ``latent_budget`` latent steps (None = the model's default) before
        the transition tokens and the answer."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        spec, budget, extra = self.latent_spec, 0, 0
        if spec is not None:
            budget = spec.resolve_budget(params.latent_budget)
            extra = len(spec.start_ids) + budget + len(spec.end_ids)
        elif params.latent_budget:
            raise ValueError("latent_budget must be 0 or null: this model does no latent "
                             "reasoning")
        if n + extra >= self.max_model_len:
            what = f"prompt has {n} tokens" + (f" (+{extra} latent and transition)" if extra
                                               else "")
            raise ValueError(f"{what} but max_model_len is {self.max_model_len}; it must be "
                             "shorter to leave room for at least one output token")
        if n + extra + 1 > self.num_kv_slots:
            raise ValueError(f"prompt has {n} tokens but the KV pool holds {self.num_kv_slots}")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[0]}")
        if rid in self._rids:
            raise ValueError(f"request id {rid!r} is already running")
        req = Req(rid, list(prompt_token_ids), params, arrival=self._arrivals)
        if spec is not None:
            req.prompt_ids += spec.start_ids
            req.latent_budget, req.latent_start = budget, len(req.prompt_ids)
            req.answer_start = None
        self._arrivals += 1
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        self._rids.add(rid)
        self.scheduler.add(req)

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Schedule, forward once, sample, and return what each request produced."""
        from latentserve.sampling import sample

        batch = self.scheduler.schedule()
        if batch is None:
            outs = self.scheduler.drain_aborted()
        else:
            logits, last_hidden = self.runner.run(batch)
            sampling_reqs = [r for r, s in zip(batch.reqs, batch.sample) if s]
            tokens = sample(logits, sampling_reqs).tolist() if sampling_reqs else []
            latents = self._latent_inputs(sampling_reqs, logits, last_hidden)
            outs = self.scheduler.postprocess(batch, tokens, latents)
        for o in outs:
            if o.finished:
                self._rids.discard(o.rid)
        return outs

    def _latent_inputs(self, reqs, logits, last_hidden) -> list | None:
        """Next latent input (``[hidden]`` in the model dtype) for each sampling row still
        in its latent phase, None elsewhere; the feedback hook runs once, batched. Records
        the latent trace (norm, logit-lens top 5) for requests that asked for it."""
        rows = [i for i, r in enumerate(reqs)
                if r.answer_start is None and len(r.latent_embeds) < r.latent_budget]
        if not rows:
            return None
        model = self.runner.model
        idx = torch.tensor(rows, dtype=torch.long, device=last_hidden.device)
        with torch.inference_mode():
            vecs = model.latent_feedback(last_hidden[idx])
        out: list = [None] * len(reqs)
        traced = [j for j, i in enumerate(rows) if reqs[i].params.return_latent_trace]
        if traced:
            with torch.inference_mode():
                lens = model.compute_logits(vecs[torch.tensor(traced, device=vecs.device)])
            top = lens.topk(5, dim=-1)
            for k, j in enumerate(traced):
                reqs[rows[j]].latent_trace.append({
                    "norm": float(vecs[j].float().norm()),
                    "top_tokens": [[int(t), float(v)] for t, v in
                                   zip(top.indices[k].tolist(), top.values[k].tolist())]})
        for j, i in enumerate(rows):
            out[i] = vecs[j]
        return out


def _eos_ids(model_dir, tokenizer, hf_config) -> set[int]:
    """EOS ids from generation_config.json, the model config and the tokenizer."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        ids |= _as_set(gen.eos_token_id)
    except OSError:
        pass
    ids |= _as_set(getattr(hf_config, "eos_token_id", None))
    ids |= _as_set(tokenizer.eos_token_id)
    return ids


def _as_set(x) -> set[int]:
    if x is None:
        return set()
    return {int(v) for v in x} if isinstance(x, (list, tuple)) else {int(x)}
