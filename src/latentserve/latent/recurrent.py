"""Recurrent depth (Huginn-0125, arXiv 2502.05171; Ouro, arXiv 2510.25741): what the engine
and the model runner share with the recurrent model files (docs/internals.md)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from latentserve.attention.base import BatchLayout
from latentserve.core import LatentState, Req
from latentserve.latent.exit_criteria import HUGINN_AUTO_THRESHOLDS, OURO_CRITERIA
from latentserve.latent.family import Admission, Family, GraphHooks
from latentserve.staging import to_device

# Huginn criteria whose value needs the output distribution (the coda + head run at a check).
HUGINN_LOGIT_CRITERIA = ("entropy-diff", "kl", "minp-kl", "argmax-stability")


@dataclass(frozen=True, slots=True)
class ExitRule:
    """One request's per-token exit rule (hashable: part of the prefix-cache salt).

    ``criterion``: one of ``HUGINN_AUTO_THRESHOLDS`` or ``OURO_CRITERIA``; ``threshold``:
    exit below it (``argmax-stability``: stable checks; Ouro: cumulative exit probability);
    ``min_steps`` / ``check_every``: upstream ``min_steps`` /
    ``check_criterion_every_n_steps``; ``upstream``: Huginn ``exit_semantics="upstream"``
    (the prompt is one exit block; skipped iterations are masked, not ``fill_banks``-copied).
    """

    criterion: str
    threshold: float = 0.0
    min_steps: int = 0
    check_every: int = 1
    upstream: bool = False

    @property
    def prompt_exits(self) -> bool:
        """Whether the prompt is one exit block: one forward from position 0, not cacheable."""
        return self.upstream and self.saves_compute

    @property
    def saves_compute(self) -> bool:
        """Whether generated tokens may stop iterating (Huginn; Ouro ``threshold-approx``)."""
        return self.criterion not in ("threshold", "weighted")

    def is_check_step(self, t: int) -> bool:
        """Whether the criterion is evaluated after iteration ``t`` (0-based)."""
        return t >= self.min_steps and (t - self.min_steps) % self.check_every == 0


@dataclass(slots=True)
class RecurrentState(LatentState):
    """One recurrent-depth request's ``Req.state``: ``exit_rule`` (None: full depth) and
    ``iters``, the iterations run at each position a token was sampled from."""

    exit_rule: ExitRule | None = None
    iters: list[int] = field(default_factory=list)

    def cacheable_len(self, req: Req) -> int:
        """Only the prompt when generated tokens may stop early; nothing when the prompt is
        an exit block; else everything."""
        rule = self.exit_rule
        if rule is not None and rule.prompt_exits:
            return 0
        if rule is not None and rule.saves_compute:
            return min(len(req.prompt_ids), req.seq_len)
        return req.seq_len


def resolve_exit_rule(spec, params, default_semantics: str = "engine") -> ExitRule | None:
    """The exit rule of ``params`` on recurrent ``spec``; None = full depth, last iteration.
    ``default_semantics`` applies when ``params.exit_semantics`` is None.

    Raises ValueError, starting with the offending field's name, for an unknown criterion,
    a threshold out of range, or exit fields the criterion or family does not use.
    """
    crit, thr = params.exit_criterion, params.exit_threshold
    # The exit fields the request set, in order: errors start with the first one's name (the
    # server's 400 reports it as ``param``).
    knobs = [name for name, unset in (("exit_min_steps", 0), ("exit_check_every", 1))
             if getattr(params, name) != unset]
    sent = (["exit_threshold"] if thr is not None else []) + knobs
    if spec.family == "huginn":
        if crit is None or crit == "none":
            if sent:
                what = "" if crit is None else " other than 'none'"
                raise ValueError(f"{sent[0]} is set, but exit_threshold / exit_min_steps / "
                                 f"exit_check_every need an exit_criterion{what}")
            return None
        if crit not in HUGINN_AUTO_THRESHOLDS:
            raise ValueError(f"exit_criterion must be one of {sorted(HUGINN_AUTO_THRESHOLDS)} "
                             f"or 'none' for this model, got {crit!r}")
        thr = HUGINN_AUTO_THRESHOLDS[crit] if thr is None else thr
        if crit == "argmax-stability" and (thr != int(thr) or thr < 1):
            raise ValueError(f"exit_threshold for argmax-stability must be an integer >= 1 "
                             f"(stable checks), got {thr}")
        return ExitRule(crit, float(thr), params.exit_min_steps, params.exit_check_every,
                        upstream=(params.exit_semantics or default_semantics) == "upstream")
    # Ouro
    if params.exit_semantics == "upstream":
        raise ValueError("exit_semantics 'upstream' is a Huginn option: Ouro's upstream "
                         "never stops a token early (its exits are exact readouts)")
    if knobs:
        raise ValueError(f"{knobs[0]} is set, but exit_min_steps / exit_check_every are "
                         "Huginn options; Ouro exits by its gate")
    if crit is None:
        if thr is None:
            return spec.default_exit
        crit = "threshold"
    if crit not in OURO_CRITERIA:
        raise ValueError(f"exit_criterion must be one of {list(OURO_CRITERIA)} for this "
                         f"model, got {crit!r}")
    if crit in ("last", "weighted"):
        if thr is not None:
            raise ValueError(f"exit_threshold must be null: exit_criterion {crit!r} takes "
                             "no exit_threshold ('threshold' and 'threshold-approx' do)")
        return None if crit == "last" else ExitRule("weighted")
    if thr is None:
        thr = spec.default_exit.threshold if spec.default_exit is not None else 1.0
    elif not 0 <= thr <= 1:
        raise ValueError(f"exit_threshold must be in [0, 1] for this model (a cumulative "
                         f"exit probability), got {thr}")
    return ExitRule(crit, float(thr))


def cache_salt(depth: int, rule: ExitRule | None) -> int:
    """``Req.cache_salt`` (> 0): 63 bits of the BLAKE2b digest of what a request's KV depends
    on besides its ids: depth, and a compute-saving rule."""
    import hashlib

    key = (depth, rule) if rule is not None and rule.saves_compute else (depth,)
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


@dataclass(slots=True)
class RecurrentBatch:
    """Host-side picture of one recurrent forward (``ForwardContext.recurrent``).

    **Compact** (eager; ``row_depths`` set): ``ActiveRows`` drops finished rows. **Masked**
    (CUDA graphs): every token runs ``num_iters`` and one past its depth keeps its state;
    valid only without exit rules. Per row ``[B]``: ``row_depths``, ``rules``, ``eligible``
    (may exit), ``traced``, ``drop_skipped`` (``upstream`` rows; None when none),
    ``iters_used``. Per token ``[T]``: ``exit_thr`` float32 (+inf: last step),
    ``exit_weighted`` bool, ``readout_steps`` int64 (-1: weighted); ``exit_probs`` ``[T, S]
    float32``. ``iterations_run``: token-iterations.
    """

    num_iters: int
    row_depths: list[int] | None = None
    q_lens: list[int] | None = None
    kv_lens: list[int] | None = None
    rows: Any = None
    out_slots: Any = None
    page_table: Any = None
    rules: list | None = None
    eligible: list[bool] | None = None
    iters_used: list[int] = field(default_factory=list)
    iterations_run: int = 0
    masked: bool = False
    exit_thr: Any = None
    exit_weighted: Any = None
    traced: list[bool] | None = None
    readout_steps: Any = None
    exit_probs: Any = None
    drop_skipped: list[bool] | None = None

    @property
    def compact(self) -> bool:
        return self.row_depths is not None and not self.masked

    @property
    def track_readout(self) -> bool:
        """Whether the forward must report readout steps: a bound buffer, or a traced row."""
        return self.readout_steps is not None or any(self.traced or ())

    @property
    def any_exit(self) -> bool:
        return bool(self.eligible) and any(self.eligible)

    @classmethod
    def from_batch(cls, batch, layout, page_table) -> RecurrentBatch:
        """Describe ``batch`` (a ``ScheduledBatch``) laid out as ``layout``."""
        depths = [int(r.latent_budget) for r in batch.reqs]
        rules = [r.state.exit_rule for r in batch.reqs]
        eligible = [rule is not None and rule.saves_compute
                    and ((n == 1 and s >= len(r.prompt_ids))  # one generated token
                         or (rule.prompt_exits and s == 0 and n == len(r.prompt_ids)))
                    for r, rule, s, n in zip(batch.reqs, rules, batch.starts, batch.q_lens)]
        drop = [rule is not None and rule.prompt_exits for rule in rules]
        return cls(max(depths, default=0), depths, list(layout.q_lens), list(layout.kv_lens),
                   layout.rows, layout.out_slots, page_table, rules, eligible,
                   traced=[bool(r.params.return_latent_trace) for r in batch.reqs],
                   drop_skipped=drop if any(drop) else None)

    def token_depths(self, device) -> torch.Tensor:
        """``[T] int64`` recurrences per token (``ForwardContext.depths``)."""
        d = torch.tensor(self.row_depths, dtype=torch.int64)
        return to_device(torch.repeat_interleave(d, torch.tensor(self.q_lens)), torch.int64,
                         device)

    def token_readout(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T] float32 threshold, [T] bool weighted)`` per token (Ouro); last step: +inf."""
        thr = [r.threshold if r is not None and r.criterion != "weighted" else math.inf
               for r in self.rules]
        weighted = [r is not None and r.criterion == "weighted" for r in self.rules]
        reps = torch.tensor(self.q_lens)
        return (to_device(torch.repeat_interleave(torch.tensor(thr, dtype=torch.float32), reps),
                          torch.float32, device),
                to_device(torch.repeat_interleave(torch.tensor(weighted), reps), torch.bool,
                          device))

    def record(self, batch) -> None:
        """Append each sampling row's iterations to ``state.iters`` and, when traced, ``{"depth",
        "readout_step" (Ouro; None: weighted), "exit_probs" (Ouro)}`` to its ``latent_trace``."""
        iters = self.iters_used or self.row_depths
        traced = [bool(self.traced and self.traced[b] and s)
                  for b, s in enumerate(batch.sample)]
        steps = probs = None
        if any(traced) and self.readout_steps is not None:
            last = torch.cumsum(torch.tensor(self.q_lens), 0) - 1  # each row's last token
            last = last.to(self.readout_steps.device)
            steps = self.readout_steps[last].tolist()
            if self.exit_probs is not None:
                probs = self.exit_probs[last].tolist()
        for b, (req, s, n) in enumerate(zip(batch.reqs, batch.sample, iters)):
            if not s:
                continue
            req.state.iters.append(int(n))
            if traced[b]:
                entry = {"depth": int(n)}
                if steps is not None:
                    entry["readout_step"] = None if steps[b] < 0 else int(steps[b])
                if probs is not None:
                    entry["exit_probs"] = exit_distribution(probs[b][: int(n)])
                req.latent_trace.append(entry)


def exit_distribution(p: list[float]) -> list[float]:
    """A token's Ouro exit distribution over its ``len(p)`` steps: ``p`` with the last entry
    ``1 - sum(p[:-1])`` in float64 (upstream ``modeling_ouro.py``, ``OuroForCausalLM``)."""
    head = [float(x) for x in p[:-1]]
    return head + [max(0.0, 1.0 - math.fsum(head))]


class ActiveRows:
    """The rows of a compact ``RecurrentBatch`` still iterating, for one forward; attention
    metadata are prepared once per distinct row set."""

    def __init__(self, rb: RecurrentBatch, ctx):
        self.rb, self.ctx = rb, ctx
        self.full_meta = ctx.attn_meta
        self.starts = [0, *accumulate(rb.q_lens)][:-1]
        self.num_tokens = sum(rb.q_lens)
        self.exited = [False] * len(rb.row_depths)
        self.rb.iters_used = [min(d, rb.num_iters) for d in rb.row_depths]
        self._cache: dict[tuple, tuple] = {}

    def token_index(self, rows: list[int]) -> torch.Tensor:
        """``[N] int64`` the token indices of ``rows``, row after row."""
        tok = [i for b in rows for i in range(self.starts[b], self.starts[b] + self.rb.q_lens[b])]
        return to_device(tok, torch.int64, self.rb.out_slots.device)

    def meta_for(self, rows: list[int]):
        """``(token index tensor or None, attention metadata)`` for ``rows``."""
        key = tuple(rows)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        rb = self.rb
        if len(rows) == len(rb.row_depths):
            hit = (None, self.full_meta)
        else:
            tok = self.token_index(rows)
            sel = to_device(rows, torch.int64, tok.device)
            layout = BatchLayout([rb.q_lens[b] for b in rows], [rb.kv_lens[b] for b in rows],
                                 rb.rows[sel], rb.out_slots[tok])
            hit = (tok, self.ctx.backend.prepare(layout, rb.page_table))
        self._cache[key] = hit
        return hit

    def select(self, t: int):
        """``(rows running iteration t, [T_active] int64 token index or None: all)``; points
        the context's attention metadata at them."""
        rows = [b for b, d in enumerate(self.rb.row_depths) if d > t and not self.exited[b]]
        if not rows:
            return rows, None
        idx, self.ctx.attn_meta = self.meta_for(rows)
        self.rb.iterations_run += self.num_tokens if idx is None else len(idx)
        return rows, idx

    def slots_of(self, rows: list[int]) -> torch.Tensor:
        return self.rb.out_slots[self.token_index(rows)]


class RecurrentLM(nn.Module):
    """What Huginn's and Ouro's models share: ``n_prelude`` layers, ``max_depth`` iterations
    of ``n_core`` layers, ``n_coda`` layers, each layer and iteration with its own KV bank;
    RoPE inverse frequencies kept as int32 bits (``model.to(bfloat16)`` cannot round them)."""

    def init_depth(self, cfg, default: int, default_name: str, inv_freq: torch.Tensor,
                   n_core: int, n_prelude: int = 0, n_coda: int = 0) -> None:
        """Raises ValueError when ``cfg.max_recurrence`` is below ``default``."""
        self.n_prelude, self.n_core, self.n_coda = n_prelude, n_core, n_coda
        depth = getattr(cfg, "max_recurrence", None)
        self.max_depth = default if depth is None else int(depth)
        if self.max_depth < default:
            raise ValueError(f"max_recurrence ({self.max_depth}) must be >= {default_name} "
                             f"({default})")
        self.register_buffer("inv_freq_bits", inv_freq.float().clone().view(torch.int32),
                             persistent=False)
        self.num_iterations = 0

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(pool layers = P + T_max * L + C, KV heads, head_dim)."""
        att = next(m for m in self.modules() if hasattr(m, "n_kv"))
        return (self.n_prelude + self.max_depth * self.n_core + self.n_coda, att.n_kv,
                att.head_dim)

    def bank(self, t: int, layer: int) -> int:
        """Pool layer of core layer ``layer`` at iteration ``t`` (0-based)."""
        return self.n_prelude + t * self.n_core + layer

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, head_dim / 2]`` float32 RoPE angles of ``positions [T]``."""
        return positions[:, None].float() * self.inv_freq_bits.view(torch.float32)[None, :]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def recur_compact(model: RecurrentLM, ctx, rb: RecurrentBatch, x, inputs: tuple, step, exits,
                  before=None):
    """``x`` ``[T, ...]`` after ``model``'s compact loop: per iteration ``t``, ``before(act,
    t, rows, idx)``, then ``x = step(x, *inputs, t)`` on the rows still iterating
    (``inputs``: per-token tensors), then ``exits(act, t, rows, idx, x)`` names the rows that
    stop; their later banks get iteration ``t``'s K/V (:func:`fill_banks`; ``upstream``
    rows: none). ``act``: the :class:`ActiveRows`."""
    act = ActiveRows(rb, ctx)
    try:
        for t in range(rb.num_iters):
            rows, idx = act.select(t)
            if not rows:
                break
            if before is not None:
                before(act, t, rows, idx)
            if idx is None:
                x = step(x, *inputs, t)
            else:
                x = x.index_copy(0, idx, step(x[idx], *(a[idx] for a in inputs), t))
            gone = exits(act, t, rows, idx, x)
            if gone:
                for b in gone:
                    act.exited[b], rb.iters_used[b] = True, t + 1
                gone = [b for b in gone if not rb.rules[b].upstream]
                # One fill for all rows exiting now, up to the deepest one (banks past a
                # row's own depth are never read by that request).
                deepest = max((rb.row_depths[b] for b in gone), default=0)
                if deepest > t + 1:
                    fill_banks(ctx.kv_pool, act.slots_of(gone), model, t, deepest)
    finally:
        ctx.attn_meta = act.full_meta
    model.num_iterations += rb.iterations_run
    return x


def slot_steps(kv_pool) -> torch.Tensor:
    """``[num_slots + 1] int32`` kept on the pool: per KV slot, the iterations its token has
    K/V for (``upstream`` exit semantics mask the others)."""
    steps = getattr(kv_pool, "recurrent_slot_steps", None)
    if steps is None:
        steps = torch.zeros(kv_pool.num_slots + 1, dtype=torch.int32, device=kv_pool.k[0].device)
        kv_pool.recurrent_slot_steps = steps
    return steps


def fill_banks(kv_pool, slots: torch.Tensor, model: RecurrentLM, t_last: int,
               depth: int) -> None:
    """Huginn's "latest same-layer" rule: copy iteration ``t_last``'s K/V at ``slots``
    (``[N] int64``) into the banks of iterations ``t_last + 1 .. depth - 1``."""
    for l in range(model.n_core):
        src = model.bank(t_last, l)
        k, v = kv_pool.k[src][slots], kv_pool.v[src][slots]
        for t in range(t_last + 1, depth):
            dst = model.bank(t, l)
            kv_pool.k[dst][slots] = k
            kv_pool.v[dst][slots] = v


class RecurrentGraphs(GraphHooks):
    """Recurrent depth in the decode graphs: one masked graph per (bucket, depth D); a batch
    replays the smallest D covering its deepest row. Static ``[max_bs]`` buffers as in
    ``RecurrentBatch`` (padded rows: depth 0, threshold +inf)."""

    packed = False  # each forward carries its RecurrentBatch (per-row depths)

    def __init__(self, spec, model, max_bs: int, device):
        top = max(spec.max_budget, 1)  # depths: the powers of two below it, it, the default
        self.depths = sorted({max(spec.default_budget, 1), top,
                              *(1 << i for i in range((top - 1).bit_length()))})
        self.row_depths = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.exit_thr = torch.full((max_bs,), math.inf, device=device)
        self.exit_weighted = torch.zeros(max_bs, dtype=torch.bool, device=device)
        self.readout_steps = self.exit_probs = None
        if spec.family == "ouro":
            self.readout_steps = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.exit_probs = torch.zeros(max_bs, self.depths[-1], device=device)

    def bind(self, ctx, depth: int, b: int) -> None:
        ctx.depths = self.row_depths[:b]
        ctx.recurrent = RecurrentBatch(
            num_iters=depth, masked=True, exit_thr=self.exit_thr[:b],
            exit_weighted=self.exit_weighted[:b],
            readout_steps=None if self.readout_steps is None else self.readout_steps[:b],
            exit_probs=None if self.exit_probs is None else self.exit_probs[:b, :depth])

    def fits(self, rec) -> bool:
        """No row may exit early or needs a key mask (a masked forward is then exact), and
        the deepest row is within the deepest captured loop."""
        return (not rec.any_exit and rec.drop_skipped is None
                and rec.num_iters <= self.depths[-1])

    def depth_for(self, rec) -> int:
        return next(d for d in self.depths if d >= rec.num_iters)

    def refresh(self, rec, n: int, b: int) -> None:
        dev = self.row_depths.device
        for buf, value, pad in zip((self.row_depths, self.exit_thr, self.exit_weighted),
                                   (rec.token_depths(dev), *rec.token_readout(dev)),
                                   (0, math.inf, False)):
            buf[:n].copy_(value)
            buf[n:b].fill_(pad)

    def replayed(self, rec, n: int) -> None:
        rec.iters_used = list(rec.row_depths)
        if self.readout_steps is not None:  # Ouro: the replay's readouts
            rec.readout_steps = self.readout_steps[:n]
            rec.exit_probs = self.exit_probs[:n]


class RecurrentFamily(Family):
    """The ``Family`` of recurrent-depth models: ``latent_budget`` is each token's recurrence
    count, the ``exit_*`` fields its exit rule (:func:`resolve_exit_rule`)."""

    budgeted = traced = takes_exit_fields = True
    description = "a recurrent-depth model"

    @property
    def takes_exit_semantics(self) -> bool:  # Ouro's exits are exact readouts: one semantics
        return self.spec.family == "huginn"

    @staticmethod
    def forward_context(batch, layout, page_table) -> RecurrentBatch:
        return RecurrentBatch.from_batch(batch, layout, page_table)  # looked up per call

    graph_hooks = RecurrentGraphs

    def admit(self, prompt_ids, params) -> Admission:
        budget = self.spec.resolve_budget(params.latent_budget)
        rule = resolve_exit_rule(self.spec, params, self.engine.exit_semantics)
        engine, n = self.engine, len(prompt_ids)
        if rule is not None and rule.prompt_exits:
            if not engine.key_mask_ok:
                raise ValueError(f"exit_semantics 'upstream' needs the torch attention backend "
                                 f"(it masks skipped steps per position); this server runs "
                                 f"{engine.backend_name!r}: use exit_semantics 'engine'")
            if n > engine.max_num_batched_tokens:
                raise ValueError(f"exit_semantics 'upstream' runs the prompt as one exit block, "
                                 f"but it has {n} tokens and max_num_batched_tokens is "
                                 f"{engine.max_num_batched_tokens}")

        def start(req: Req) -> None:  # no phase machine: answer_start stays 0
            req.latent_budget, req.state = budget, RecurrentState(rule)
            req.cache_salt = cache_salt(budget, rule)

        return Admission(params, 0, start)

    def admits_now(self, req: Req, budget: int) -> bool:
        """A prompt that is one exit block is admitted only when it fits the budget whole."""
        rule = req.state.exit_rule
        return not (rule is not None and rule.prompt_exits and len(req.prompt_ids) > budget)

    def chunk(self, req: Req, n: int) -> int:
        """With a compute-saving rule, one generated token per forward and prompt chunks
        end at the prompt's end: each token that may exit is a row of its own."""
        rule = req.state.exit_rule
        if rule is not None and rule.saves_compute:
            p = len(req.prompt_ids)
            n = 1 if req.num_computed >= p else min(n, p - req.num_computed)
        return n

    def truncate(self, req: Req) -> None:
        """One iteration count (and trace entry) per sampled token: none past the output."""
        n = len(req.output_ids)
        del req.state.iters[n:]
        del req.latent_trace[n:]

    def output_fields(self, req: Req, done: bool) -> dict:
        fields = super().output_fields(req, done)
        iters = req.state.iters
        if done and iters:  # over the sampled tokens
            fields["recurrence"] = {"tokens": len(iters),
                                    "mean_iterations": sum(iters) / len(iters),
                                    "histogram": dict(sorted(Counter(iters).items()))}
        return fields
