"""The in-process engine: model, KV pool, scheduler and sampler behind
``add_request`` / ``abort_request`` / ``step``. The offline ``LLM`` and the server's engine
process both drive this class."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import threading
from numbers import Integral
from typing import Any

import torch

from latentserve import logit_bias, sampling, token_masks  # by module: tests patch them
from latentserve.config import EngineConfig, check_device
from latentserve.core import Req
from latentserve.distributed import destroy_tp_group
from latentserve.engine import overlap
from latentserve.engine.kv_sizing import check_fits, kv_slots_for
from latentserve.engine.prompt_logprobs import PromptLogprobTracker
from latentserve.engine.tp_worker import (
    RunnerSetup,
    abort_workers,
    broadcast_object,
    load_served_model,
    make_runner,
    start_workers,
    stop_workers,
)
from latentserve.kvcache.allocator import SlotAllocator
from latentserve.kvcache.pool import KVPool
from latentserve.kvcache.radix import RadixCache
from latentserve.latent.family import family_for
from latentserve.latent.spec import HEAD_FIELDS, cap_budget
from latentserve.models import layers  # by module: tests patch its row bounds
from latentserve.models.checkpoint import (
    NoTokenizer,
    base_model_dir,
    load_tokenizer,
    resolve_model_dir,
)
from latentserve.models.generation_config import sampling_defaults
from latentserve.outputs import StepOutput, attach_logprobs
from latentserve.penalties import PenaltyCounts
from latentserve.sampling import TokenMask
from latentserve.sampling_params import SamplingParams
from latentserve.scheduler.cache import CacheManager
from latentserve.scheduler.scheduler import Scheduler
from latentserve.staging import BitmaskToDevice, DeviceToHost, HostToDevice
from latentserve.structured import Grammars
from latentserve.token_masks import (
    REASONING_PARSERS,
    THINK_END,
    THINK_START,
    RequestMask,
    ThinkBudget,
    bad_words_ids,
    bitmask_width,
)

log = logging.getLogger(__name__)


class LLMEngine:
    """Loads ``config.model`` and serves requests step by step; ``sampling_defaults`` from
    the generation config are applied by ``LLM`` and the server. Raises FileNotFoundError /
    ValueError from loading, ValueError when the KV pool cannot hold one request."""

    def __init__(self, config: EngineConfig):
        # TPGroup and worker processes when TP > 1
        self.tp: Any = None
        self._tp_procs: list = []
        if config.tensor_parallel_size > 1:
            # The workers load the directory rank 0 resolves (a GGUF converted once, in the
            # serving dtype), not a conversion of their own.
            resolved = str(resolve_model_dir(config.model, _dtype_name(config)))
            self.tp, self._tp_procs = start_workers(dataclasses.replace(config, model=resolved))
        try:
            self._build(config)
        except BaseException:
            if self.tp is not None:
                self.tp = None
                abort_workers(self._tp_procs)  # kill the workers, leave the process group
            raise

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        check_device(config.device)
        self.device = self.tp.device if self.tp is not None else torch.device(config.device)
        torch.manual_seed(config.seed)
        self.model_dir = model_dir = resolve_model_dir(config.model, _dtype_name(config))
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir,  # --tokenizer
                                        optional=config.tokenizer is None)  # else ids only
        self.sampling_defaults = sampling_defaults(model_dir, config.generation_config)
        model, hf_config = load_served_model(config, model_dir, config.device, self.tp)
        self.vocab_size = hf_config.vocab_size
        limit = getattr(hf_config, "max_position_embeddings", None) or hf_config.n_positions
        self.max_model_len = min(config.max_model_len or limit, limit)
        if config.max_model_len is not None and config.max_model_len > limit:
            # vLLM refuses this (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN); we serve the limit.
            log.warning("max_model_len %d is above the model's %d positions "
                        "(max_position_embeddings): serving %d", config.max_model_len,
                        limit, limit)
        if hasattr(model, "prepare_positions"):  # the fast path's RoPE table (before sizing)
            model.prepare_positions(self.max_model_len)
        layers, kv_heads, head_dim = model.kv_shape
        per_slot = KVPool.bytes_per_slot(layers, kv_heads, head_dim, config.torch_dtype)
        slots = self.num_kv_slots = kv_slots_for(config, per_slot, self.max_model_len,
                                                 hf_config.vocab_size)
        if slots < self.max_model_len:
            # NOTE: a request must always fit the pool on its own, or it would be preempted
            # and re-admitted forever; so no request may outgrow the pool.
            log.warning("max_model_len lowered from %d to the KV pool's %d slots",
                        self.max_model_len, slots)
            self.max_model_len = slots
        check_fits(config, slots, per_slot, self.max_model_len)
        self.runner: Any = make_runner(model, config, slots, self.max_model_len, self.device,
                                       self.tp)  # a TPModelRunner under TP
        allocator = SlotAllocator(slots, self.device)
        radix = RadixCache(allocator, enabled=config.enable_prefix_caching)
        self.cache = CacheManager(allocator, radix, self.runner.table)
        self.eos_ids = _eos_ids(model_dir, self.tokenizer, hf_config)
        spec, cap = getattr(model, "latent_spec", None), config.max_latent_budget
        family = family_for(spec)
        if cap is not None and config.latent_cap_where_applicable:
            cap = (min(max(cap, spec.min_budget, 1), spec.max_budget)
                   if spec is not None and family.budgeted else None)
        self.latent_spec = cap_budget(spec, cap)
        self.upstream_stop_rules = config.upstream_stop_rules  # requests' default
        if self.upstream_stop_rules and not getattr(self.latent_spec, "upstream_eos_from", 0):
            if not config.latent_cap_where_applicable:
                raise ValueError(_no_upstream_rule(self.latent_spec))
            self.upstream_stop_rules = False  # a multi-model server: where it applies
        self.family = family(self.latent_spec, self)  # the one interface to latent reasoning
        self.scheduler = Scheduler(self.cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   self.eos_ids, self.family)
        self.exit_semantics = config.exit_semantics  # requests' default (Huginn)
        if self.exit_semantics != "engine" and not self.family.takes_exit_semantics:
            if not config.latent_cap_where_applicable:
                raise ValueError(f"exit_semantics {self.exit_semantics!r} (--exit-semantics) "
                                 f"needs a Huginn model, not {_a_model(self.latent_spec)}")
            self.exit_semantics = "engine"  # a multi-model server: where it applies
        self.backend_name = config.backend_name
        self.key_mask_ok = self.runner.backend.supports_key_mask
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.family.setup()
        graph_bs = min(config.max_num_seqs, 256) if (
            self.device.type == "cuda" and config.backend_name == "triton"
            and not config.enforce_eager) else 0
        if self.tp is not None:  # the workers copy these, then capture alongside
            broadcast_object(self.tp, RunnerSetup(slots, self.max_model_len,
                                                  self.runner.capture_layer, graph_bs))
        if graph_bs:
            self.runner.capture_graphs(graph_bs, hf_config.hidden_size, config.torch_dtype)
            self.scheduler.forced_one_by_one = True  # keep latent batches on the graphs
        self._rids: set[str] = set()
        self.inflight = None  # overlap mode: the launched batch whose tokens are not finished
        # overlap mode: pinned host copies of the tokens, on a side stream (the next replay
        # waits for them: CudaGraphRunner.wait_before_replay)
        self.token_copies = DeviceToHost(side_stream=True)
        self.score_copies = DeviceToHost()  # overlap mode: the sampled tokens' logprobs
        self._mask_copies: Any = None  # staging.BitmaskToDevice of the token masks, first use
        self._bias_copies: Any = None  # staging.HostToDevice of the logit bias, first use
        self._static_mask: tuple | None = None  # (token_masks.static_key, its TokenMask)
        # grammars fill on a worker thread beside the forward launch (a CPU forward takes
        # every core: there the fill runs on the engine's thread, before the forward)
        self.grammar_worker = self.device.type == "cuda"
        self._biased: set[str] = set()  # live requests that set logit_bias
        self._grammar_rids: set[str] = set()  # live requests with a grammar
        self.penalties = PenaltyCounts(self.vocab_size, self.device)  # token counts, if any
        self._arrivals = 0
        self._failed: dict[str, str] = {}  # rid -> error, until its final output is sent
        self.prompt_logprobs = PromptLogprobTracker()
        self.grammars: Any = None  # structured.Grammars, built for the first constrained one
        self._grammars_lock = threading.Lock()
        log.info("engine ready: %s, %d KV slots, max_model_len %d", self.model_name, slots,
                 self.max_model_len)

    def add_request(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError naming the field: empty or too long a prompt,
        an id outside the vocabulary, a duplicate ``rid``, ``n`` other than 1, latent
        fields the family refuses, ``upstream_stop_rules`` without an upstream rule."""
        if rid in self._rids:
            raise ValueError(f"request id {rid!r} is already running")
        req = self._prepare(rid, prompt_token_ids, params)
        self._arrivals += 1
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        self._rids.add(rid)
        if params.has_logit_bias:
            self._biased.add(rid)
        if req.constraint is not None and req.constraint.matcher is not None:
            self._grammar_rids.add(rid)
        if params.has_penalties:
            self.penalties.add(rid)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs.add(rid, len(prompt_token_ids), params.prompt_logprobs)
        self.scheduler.add(req)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The checks of :meth:`add_request`, nothing queued (dry runs); same ValueErrors."""
        self._prepare("", prompt_token_ids, params)

    def _prepare(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> Req:
        """The checks of :meth:`add_request` and the unqueued ``Req`` they admit."""
        if params.n != 1:
            raise ValueError(f"n must be 1 for one engine request, got {params.n} (LLM.generate "
                             "and the server's n fan a prompt out into n requests)")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        cap = self.vocab_size if self.config.max_logprobs < 0 else self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(params, name)) is not None and k > cap:
                raise ValueError(f"{name} must be in [0, {cap}] (max_logprobs), got {k}")
        if params.max_tokens is None:  # vLLM: until the context is full
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - n))
        spec, family = self.latent_spec, self.family
        if params.thinking_token_budget is not None and self.config.reasoning_parser is None:
            params = family.cap_thinking(params)
        if params.return_latent_trace and self.tp is not None and not family.traced_under_tp:
            raise ValueError("return_latent_trace is not supported with tensor_parallel_size "
                             f"> 1 on {family.description}")
        admission = family.admit(prompt_token_ids, params)
        params, extra = admission.params, admission.extra
        for taken, unset, needs in (
                (family.takes_head_controls, {"compression_factor": None,
                                              "latent_temperature": None},
                 "a CoLaR model (a directory with colar_config.json)"),
                # thinking is also the chat template's switch, so it passes on any model;
                # thinking off makes the others harmless (docs/server.md)
                (family.takes_head_controls or params.thinking is False,
                 dict.fromkeys(HEAD_FIELDS[1:6]),
                 "a model with a compression head (CoLaR or a head bundle); this model has "
                 "none, so it would do nothing"),
                (family.takes_exit_fields, {"exit_criterion": None, "exit_threshold": None,
                                            "exit_min_steps": 0, "exit_check_every": 1,
                                            "exit_semantics": None},
                 "a recurrent-depth model (Huginn, Ouro)")):
            sent = [] if taken else [k for k, v in unset.items() if getattr(params, k) != v]
            if sent:
                raise ValueError(f"{sent[0]} needs {needs}")
        if params.upstream_stop_rules and not getattr(spec, "upstream_eos_from", 0):
            raise ValueError(_no_upstream_rule(spec))
        upstream = (self.upstream_stop_rules if params.upstream_stop_rules is None
                    else params.upstream_stop_rules)
        if params.return_latent_trace and not family.traced:
            raise ValueError("return_latent_trace needs a feedback-latent, recurrent-depth "
                             f"or looped-block model, not {family.description} (it would "
                             "silently do nothing)")
        if params.stream_latent_steps and not family.streams_steps:
            raise ValueError("stream_latent_steps needs a model with latent steps, not "
                             f"{family.description} (it would silently do nothing)")
        if n + extra >= self.max_model_len:
            what = f"prompt has {n} tokens" + (f" (+{extra} latent and transition)" if extra
                                               else "")
            raise ValueError(f"{what} but max_model_len is {self.max_model_len}; it must be "
                             "shorter to leave room for at least one output token")
        if n + extra + 1 > self.num_kv_slots:
            raise ValueError(f"prompt has {n} tokens but the KV pool holds {self.num_kv_slots}")
        for name, ids in (("prompt token ids", prompt_token_ids),
                          ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logit_bias", params.logit_bias or ())):
            odd = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
            if odd:
                raise ValueError(f"{name} must be integers, got {odd[0]!r}")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be in [0, {self.vocab_size}), got {bad[0]}")
        if self.tp is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs (echo with logprobs) is not supported with "
                             "tensor_parallel_size > 1")
        req = Req(rid, [int(t) for t in prompt_token_ids], params, arrival=self._arrivals,
                  eos_from=getattr(spec, "upstream_eos_from", 0) if upstream else 0,
                  constraint=self._constraint(params, prompt_token_ids),
                  forced_close=spec is not None and bool(spec.end_ids))
        if admission.start is not None:
            admission.start(req)
        return req

    def compile_grammar(self, so) -> None:
        """Compile ``so`` (``StructuredOutputsParams``) into the grammar cache, so a request
        that uses it later finds it compiled; safe from another thread. ValueError naming
        the field, as :meth:`add_request`'s, or when its first token mask is too costly
        (``Grammars.check_first_mask``)."""
        if isinstance(self.tokenizer, NoTokenizer):
            raise ValueError(f"{so.param} needs text: this model directory has no tokenizer "
                             "files")
        self._grammars().check_first_mask(so)

    def _grammars(self) -> Grammars:
        """The engine's one ``structured.Grammars`` (one compiler cache), built on first use
        under a lock (:meth:`compile_grammar` runs on other threads)."""
        with self._grammars_lock:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
            return self.grammars

    def _constraint(self, params: SamplingParams, prompt: list[int]):
        """The request's ``token_masks.RequestMask`` (grammar compiled here) or None (nothing
        masks it); ValueError naming the field for a bad id, word or grammar."""
        parser = self.config.reasoning_parser
        budget = params.thinking_token_budget if parser else None  # else: cap_thinking
        if not params.has_token_mask and budget is None:
            return None
        so = params.structured_outputs
        for name, used in (("bad_words", bool(params.bad_words)),
                           ("thinking_token_budget", budget is not None),
                           (so.param if so is not None else "", so is not None)):
            if used and isinstance(self.tokenizer, NoTokenizer):
                raise ValueError(f"{name} needs text: this model directory has no tokenizer "
                                 "files")
        words = [w for w in bad_words_ids(self.tokenizer, params.bad_words)
                 if all(0 <= t < self.vocab_size for t in w)] if params.bad_words else None
        matcher = None
        if so is not None:
            grammars = self._grammars()
            grammars.check_first_mask(so)  # not a grammar this tokenizer cannot write
            matcher = grammars.matcher(so)
        think = None
        if parser and (budget is not None or so is not None):  # so: starts after </think>
            ids = [self.tokenizer.encode(t, add_special_tokens=False)
                   for t in (THINK_START, THINK_END)]
            think = ThinkBudget(budget, ids[0], ids[1], prompt, REASONING_PARSERS[parser])
        return RequestMask(params, self.vocab_size, self.eos_ids | set(params.stop_token_ids),
                           words, matcher, think)

    def begin_token_mask(self, reqs: list[Req], known: dict | None = None):
        """Start the token masks of ``reqs`` before their forward: a
        ``token_masks.PendingBitmask`` built on the worker thread where ``grammar_worker``
        (else here, at once), for :meth:`token_mask`; None when no row has a grammar
        (nothing worth starting; O(1) while no live request has one). ``known``: see
        ``token_masks.batch_bitmask``."""
        if not self._grammar_rids or not any(
                r.constraint is not None and r.constraint.matcher is not None for r in reqs):
            return None
        out = self._mask_host(self.device, len(reqs))
        return token_masks.begin_bitmask(reqs, self.vocab_size, known, out,
                                         background=self.grammar_worker)

    def token_mask(self, reqs: list[Req], device, known: dict | None = None, begun=None):
        """The sampler's ``TokenMask`` for ``reqs`` (None: no constraint), copied to
        ``device`` without waiting; ``known``: see ``token_masks.batch_bitmask``; ``begun``:
        :meth:`begin_token_mask`'s result, used when it was begun for these ``reqs``."""
        if begun is not None:
            if len(begun.reqs) == len(reqs) and all(map(operator.is_, begun.reqs, reqs)):
                rows, bits = begun.result()
                self._static_mask = None
                return TokenMask(rows, self._mask_copies.copy(bits))
            begun.wait()  # the grammars are free again; built anew below
        if not any(r.constraint is not None for r in reqs):
            return None
        device = torch.device(device)
        key = token_masks.static_key(reqs)
        if (key is not None and self._static_mask is not None and self._static_mask[0] == key
                and self._static_mask[1].bits.device == device):
            return self._static_mask[1]  # unchanged static masks: the rows already copied
        out = self._mask_host(device, len(reqs))
        rows, bits = token_masks.batch_bitmask(reqs, self.vocab_size, known, out)
        mask = TokenMask(rows, self._mask_copies.copy(bits))
        self._static_mask = None if key is None else (key, mask)
        return mask

    def _mask_host(self, device, rows: int) -> torch.Tensor:
        """The next host buffer of ``rows`` bitmask rows for copies to ``device``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # as logits.device names it
            device = torch.device("cuda", torch.cuda.current_device())
        if self._mask_copies is None or self._mask_copies.device != device:
            self._mask_copies = BitmaskToDevice(device)
        return self._mask_copies.host(rows, bitmask_width(self.vocab_size))

    def logit_bias(self, reqs: list[Req], device):
        """The sampler's ``LogitBias`` for ``reqs`` (None: no row has one), copied to
        ``device`` without waiting (``logit_bias.batch_logit_bias``); no pass over ``reqs``
        while no live request sets ``logit_bias``."""
        if not self._biased:
            return None
        device = torch.device(device)
        if self._bias_copies is None or self._bias_copies.device != device:
            self._bias_copies = HostToDevice(device)
        return logit_bias.batch_logit_bias(reqs, self._bias_copies)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (no-op at TP 1;
        idempotent). The engine cannot step afterwards."""
        if self.tp is None:
            return
        tp, self.tp = self.tp, None
        try:
            broadcast_object(tp, None)  # stop
        finally:
            # NOTE: leave the group while the workers leave it too: NCCL's teardown waits
            # for its peers, so destroying after they exited (or before they start) hangs.
            self.runner.release_graphs()
            destroy_tp_group()
            stop_workers(self._tp_procs)

    def dead_workers(self) -> list[str]:
        """Exited tensor-parallel workers as ``"rank R (exit code C)"`` (a dead rank is never
        recovered: stop serving)."""
        if self.tp is None:
            return []
        return [f"rank {r} (exit code {p.returncode})"
                for r, p in enumerate(self._tp_procs, start=1) if p.poll() is not None]

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def get_tokenizer(self):
        """The tokenizer (vLLM's ``LLMEngine.get_tokenizer``)."""
        return self.tokenizer

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Schedule, forward once, sample, and return what each request produced (overlap:
        the previous batch's). A sampling failure finishes only its request."""
        if self.config.use_overlap_schedule:
            if overlap.eligible(self):
                return self._retire(overlap.step(self))
            if self.inflight is not None:  # finish it first; the next step is synchronous
                prev, self.inflight = self.inflight, None
                return self._retire(overlap.finish(self, prev))
        batch = self.scheduler.schedule()
        if batch is None:
            outs = self.scheduler.drain_aborted()
        else:
            begun = (self.begin_token_mask([r for r, s in zip(batch.reqs, batch.sample) if s])
                     if self._grammar_rids else None)
            try:  # the grammars fill beside the forward
                logits, last_hidden = self.runner.run(batch)
                if self.runner.prompt_hidden:
                    self.prompt_logprobs.record(self.runner.model, self.runner.prompt_hidden)
                sampling_reqs = self._after_forward(batch)
                if self.penalties.live:
                    self.penalties.count(sampling_reqs)
                mask = self.token_mask(sampling_reqs, logits.device, begun=begun)
            except BaseException:
                token_masks.settle(begun)
                raise
            tokens, logprobs = self._sample(logits, sampling_reqs, self.runner.last_greedy,
                                            mask, self.logit_bias(sampling_reqs, logits.device))
            latents = self.family.latent_inputs(sampling_reqs, logits, last_hidden, tokens)
            outs = self.scheduler.postprocess(batch, tokens, latents)
            attach_logprobs(outs, [r.rid for r in sampling_reqs], logprobs)
        return self._retire(outs)

    def _after_forward(self, batch) -> list[Req]:
        """Before sampling: ``Family.after_forward``. Returns the sampling requests."""
        self.family.after_forward(batch)
        return [r for r, s in zip(batch.reqs, batch.sample) if s]

    def _retire(self, outs: list[StepOutput]) -> list[StepOutput]:
        """A step's outputs, after failures, prompt logprobs and finished-request bookkeeping."""
        if self._failed:
            outs = self._apply_failures(outs)
        if self.prompt_logprobs:
            self.prompt_logprobs.attach(outs)
        for o in (o for o in outs if o.finished):
            self._rids.discard(o.rid)
            self._biased.discard(o.rid)
            self._grammar_rids.discard(o.rid)
            self.penalties.release(o.rid)
            if (st := o.latent_stats) is not None:
                log.debug("latent head: req %s thinking=%s steps=%d stop_step=%s max_p=%s "
                          "end=%s", o.rid, st["thinking"], st["steps"], st["stop_step"],
                          st["max_stop_prob"], st["end"])
        return outs

    def _sample(self, logits, reqs, greedy=None, mask=None, bias=None
                ) -> tuple[list[int], list]:
        """Tokens and logprobs, batched; row by row when that fails (a failing row gets
        token 0 and its rid in ``_failed``). Penalties: counted for this step already."""
        if not reqs:
            return [], []
        try:
            res = sampling.sample_with_logprobs(logits, reqs, greedy=greedy, mask=mask,
                                                bias=bias, penalties=self.penalties)
            return res.tokens.tolist(), res.logprobs
        except Exception:  # noqa: BLE001 - find the failing rows below
            log.exception("batched sampling failed; sampling %d rows one by one", len(reqs))
        tokens, logprobs = [], []
        where = {} if mask is None else {b: i for i, b in enumerate(mask.rows)}
        for b, req in enumerate(reqs):
            try:
                i = where.get(b)
                one = None if i is None else TokenMask([0], mask.bits[i : i + 1])
                res = sampling.sample_with_logprobs(
                    logits[b : b + 1], [req], mask=one,
                    bias=None if bias is None else self.logit_bias([req], logits.device),
                    penalties=self.penalties)
                tokens.append(int(res.tokens[0]))
                logprobs.append(res.logprobs[0])
            except Exception as exc:  # noqa: BLE001 - fails this request only
                log.exception("sampling failed for request %s", req.rid)
                self._failed[req.rid] = f"sampling failed: {type(exc).__name__}"
                tokens.append(0)
                logprobs.append(None)
        return tokens, logprobs

    def _apply_failures(self, outs: list[StepOutput]) -> list[StepOutput]:
        """Failed requests' outputs become one final ``"error"`` output each (a running one is
        aborted; its placeholder token dropped)."""
        kept = []
        for o in outs:
            error = self._failed.get(o.rid)
            if error is None:
                kept.append(o)
            elif o.finished:
                del self._failed[o.rid]
                o.finish_reason, o.error, o.new_token_ids, o.logprobs = "error", error, [], None
                kept.append(o)
        finishing = {o.rid for o in kept if o.finished}
        for rid in self._failed:
            if rid not in finishing:
                self.scheduler.abort(rid)
        return kept

    def stats(self) -> dict[str, int]:
        """A cheap monitoring snapshot, all ints (idle: ``kv_slots_free + kv_slots_cached ==
        kv_slots_total``)."""
        alloc, radix = self.cache.allocator, self.cache.radix
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_slots_total": int(alloc.num_total),
            "kv_slots_free": int(alloc.num_free),
            "kv_slots_cached": int(radix.total_size()),
            "kv_slots_evictable": int(radix.evictable_size),
            "prefix_cache_queries": self.scheduler.prefix_queries,
            "prefix_cache_hits": self.scheduler.prefix_hits,
            "num_preemptions": int(self.scheduler.num_preemptions),
            "num_forward_tokens": int(self.runner.num_computed_tokens),
        }

    def warmup(self) -> None:
        """Run tiny requests to completion so one-off costs are paid before serving; the
        prefix cache is emptied after. Raises RuntimeError when requests are queued."""
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() needs an idle engine")
        fused = self.config.use_fused_ops
        long = max(4, layers.DECODE_ROWS + 1) if fused else 4
        rope_rows = layers.QKV_ROPE_ROWS[0]
        if self._warm_request((long, 4)) and fused and rope_rows <= layers.DECODE_ROWS:
            self._warm_request((rope_rows,), quiet=True)
            # the q/k/v kernel narrows above WIDE_ROWS rows (qkv_rope.default_block_half): a
            # second variant, compiled now rather than in a served step
            if self.config.device.startswith("cuda"):
                from latentserve.ops.kernels.qkv_rope import WIDE_ROWS

                if layers.QKV_ROPE_ROWS[1] > WIDE_ROWS:
                    self._warm_request((WIDE_ROWS + 1,), quiet=True)
        self.scheduler.prefix_queries = self.scheduler.prefix_hits = 0
        if self.config.device.startswith("cuda"):  # the first sampled step must not compile
            sampling.warm_race(self.vocab_size, self.config.device)

    def _warm_request(self, lengths, quiet: bool = False) -> bool:
        """One warm-up request with the first length of ``lengths`` that fits, run to
        completion; False when none fits (logged unless ``quiet``)."""
        rid = "__latentserve_warmup__"
        # A head model runs one latent step (no floor, where the head has one), so the head
        # runs too.
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1)
        if self.family.takes_head_controls:
            floor = 0 if "min_output_tokens" in getattr(self.latent_spec, "controls", ()) else None
            params = dataclasses.replace(params, max_latent=1, use_stop=False,
                                         min_output_tokens=floor)
        for n in dict.fromkeys(max(1, min(k, self.max_model_len - 3)) for k in lengths):
            try:  # the long prompt, then (a model's extra tokens overflow it) 4 tokens
                self.add_request(rid, [min(i + 1, self.vocab_size - 1) for i in range(n)],
                                 params)
                break
            except ValueError as exc:
                error = exc
        else:
            (log.debug if quiet else log.warning)("warm-up skipped: %s", error)
            return False
        while self.has_unfinished_requests():
            self.step()
        self.cache.radix.reset()  # the next warm-up prompt must not hit this one's prefix
        return True


def _no_upstream_rule(spec) -> str:
    """The refusal of ``upstream_stop_rules`` on a family without an upstream stop rule."""
    return ("upstream_stop_rules needs a model family whose upstream code ends on EOS "
            f"differently from the engine (COCONUT, PCCoT), not {_a_model(spec)}: it would "
            "change nothing (leave it unset or false)")


def _a_model(spec) -> str:
    """``spec``'s model in words, for error messages ("an ouro model")."""
    if spec is None:
        return "a model without latent reasoning"
    return f"{'an' if spec.family[0] in 'aeiou' else 'a'} {spec.family} model"


def _dtype_name(config: EngineConfig) -> str:
    """The serving dtype's name (``"bfloat16"``), for a GGUF's conversion."""
    return str(config.torch_dtype).removeprefix("torch.")


def _eos_ids(model_dir, tokenizer, hf_config) -> set[int]:
    """EOS ids from generation_config.json (an adapter directory's: its base's), the model
    config and the tokenizer."""
    from transformers import GenerationConfig

    found = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    with contextlib.suppress(OSError):
        found.append(GenerationConfig.from_pretrained(base_model_dir(model_dir),
                                                      local_files_only=True).eos_token_id)
    return {int(v) for x in found if x is not None
            for v in (x if isinstance(x, (list, tuple)) else [x])}
