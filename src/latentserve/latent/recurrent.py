"""Recurrent depth (Huginn-0125, arXiv 2502.05171; Ouro, arXiv 2510.25741): what the engine
and the model runner share with the recurrent model files.

Design notes: docs/internals.md, "latentserve.latent.recurrent".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from latentserve.core import LatentState, Req
from latentserve.latent.family import Admission, Family, GraphHooks

# Huginn exit criteria and their "auto" thresholds (upstream raven_modeling_minimal.py,
# get_adaptive_exit_evaluator). "none" never exits.
HUGINN_AUTO_THRESHOLDS = {"entropy-diff": 1e-3, "latent-diff": 0.03, "kl": 1e-3,
                          "minp-kl": 1e-5, "argmax-stability": 5, "cosine": 1e-3}
# Huginn criteria whose value needs the output distribution (the coda + head run at a check).
HUGINN_LOGIT_CRITERIA = ("entropy-diff", "kl", "minp-kl", "argmax-stability")
# Ouro readouts (upstream modeling_ouro.py, OuroForCausalLM.forward): "last" step,
# "threshold" (first step whose cumulative exit probability reaches the threshold),
# "weighted" (exit-probability mixture), and our compute-saving "threshold-approx".
OURO_CRITERIA = ("last", "threshold", "weighted", "threshold-approx")


@dataclass(frozen=True, slots=True)
class ExitRule:
    """One request's per-token exit rule (hashable: part of the prefix-cache salt).

    Attributes:
        criterion: Huginn: ``entropy-diff``, ``latent-diff``, ``kl``, ``minp-kl``,
            ``argmax-stability``, ``cosine``. Ouro: ``threshold``, ``weighted``,
            ``threshold-approx``.
        threshold: exit when the criterion's value is below it (``argmax-stability``: when
            the argmax was stable for at least this many checks; Ouro: when the cumulative
            exit probability reaches it).
        min_steps / check_every: Huginn checks after iteration ``t`` (0-based) when
            ``t >= min_steps and (t - min_steps) % check_every == 0`` (upstream
            ``min_steps``, ``check_criterion_every_n_steps``).
        upstream: Huginn ``exit_semantics="upstream"``: the prompt is one exit block (it may
            stop early, all its positions at the same iteration) and an exited token's
            skipped iterations stay empty: attention at iteration ``t`` masks positions with
            no K/V there (``SlotSteps``), instead of the ``fill_banks`` copy.
    """

    criterion: str
    threshold: float = 0.0
    min_steps: int = 0
    check_every: int = 1
    upstream: bool = False

    @property
    def prompt_exits(self) -> bool:
        """Whether the prompt is one exit block (``upstream``): it must run in one forward
        from position 0, and its K/V depends on the whole prompt, so no prefix of it is
        cacheable."""
        return self.upstream and self.saves_compute

    @property
    def saves_compute(self) -> bool:
        """Whether generated tokens may stop iterating (all Huginn criteria; Ouro only
        ``threshold-approx``). Such rules change the KV of generated tokens."""
        return self.criterion not in ("threshold", "weighted")

    def is_check_step(self, t: int) -> bool:
        """Whether the criterion is evaluated after iteration ``t`` (0-based)."""
        return t >= self.min_steps and (t - self.min_steps) % self.check_every == 0


@dataclass(slots=True)
class RecurrentState(LatentState):
    """One recurrent-depth request's state (``Req.state``): its ``exit_rule`` (None: every
    token runs its full recurrence) and ``iters``, the iterations run at each position a
    token was sampled from."""

    exit_rule: ExitRule | None = None
    iters: list[int] = field(default_factory=list)

    def cacheable_len(self, req: Req) -> int:
        """With an exit rule that skips iterations, only the prompt (generated tokens stopped
        early, while a later request's prompt runs every iteration on them); nothing when the
        prompt itself is an exit block (``ExitRule.prompt_exits``: its K/V depends on the
        whole prompt); else everything."""
        rule = self.exit_rule
        if rule is not None and rule.prompt_exits:
            return 0
        if rule is not None and rule.saves_compute:
            return min(len(req.prompt_ids), req.seq_len)
        return req.seq_len


def resolve_exit_rule(spec, params, default_semantics: str = "engine") -> ExitRule | None:
    """The exit rule of a request with ``SamplingParams`` ``params`` on a model with
    ``LatentSpec`` ``spec`` (``kind == "recurrent"``); None = run the full depth and read out
    the last iteration. ``default_semantics`` applies when ``params.exit_semantics`` is None
    (the server default; ignored by Ouro).

    Raises ValueError (its message starts with the offending field's name) for a criterion
    the family does not know, a threshold out of range (Ouro: outside [0, 1]), or exit fields
    without a criterion that uses them (Huginn: none or ``'none'``; Ouro: ``'last'``,
    ``'weighted'``; ``exit_min_steps`` / ``exit_check_every`` / ``exit_semantics='upstream'``
    on Ouro).
    """
    crit, thr = params.exit_criterion, params.exit_threshold
    semantics = params.exit_semantics or default_semantics
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
        if thr < 0:
            raise ValueError(f"exit_threshold must be >= 0, got {thr}")
        return ExitRule(crit, float(thr), params.exit_min_steps, params.exit_check_every,
                        upstream=semantics == "upstream")
    if spec.family == "ouro":
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
        if crit == "last":
            if thr is not None:
                raise ValueError("exit_threshold needs exit_criterion 'threshold' or "
                                 "'threshold-approx'")
            return None
        if crit == "weighted":
            if thr is not None:
                raise ValueError("exit_threshold must be null: exit_criterion 'weighted' "
                                 "takes no exit_threshold (the mixture has no threshold)")
            return ExitRule("weighted")
        if thr is None:
            thr = spec.default_exit.threshold if spec.default_exit is not None else 1.0
        elif not 0 <= thr <= 1:
            # A cumulative exit probability never exceeds 1: a larger threshold would silently
            # read out the last step (exit_criterion 'last' says that).
            raise ValueError(f"exit_threshold must be in [0, 1] for this model (a cumulative "
                             f"exit probability), got {thr}")
        return ExitRule(crit, float(thr))
    raise ValueError(f"unknown recurrent family {spec.family!r}")


def salt_of(key: tuple) -> int:
    """A request's prefix-cache namespace (``Req.cache_salt``, > 0) for a
    :func:`cache_salt_key`: 63 bits of a BLAKE2b digest of the key, so the same variant always
    gets the same namespace and the engine keeps no table that grows with every distinct
    threshold a client sends."""
    import hashlib

    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


def cache_salt_key(depth: int, rule: ExitRule | None) -> tuple:
    """What a request's KV depends on besides its token ids: the depth, and the exit rule
    when it changes which iterations generated tokens compute."""
    return (depth, rule) if rule is not None and rule.saves_compute else (depth,)


@dataclass(slots=True)
class RecurrentBatch:
    """Host-side picture of one forward of a recurrent model (``ForwardContext.recurrent``).

    **Compact** (eager; ``row_depths`` set): ``ActiveRows`` drops rows whose depth is reached
    or that exited. **Masked** (CUDA graphs; ``masked`` or ``row_depths`` None): every token
    runs ``num_iters`` iterations and one past its depth keeps its state; valid only without
    exit rules (the extra K/V goes to banks ``>= depth``, never read at that depth).

    ``row_depths`` ``[B]``; ``q_lens`` / ``kv_lens`` / ``rows`` / ``out_slots`` /
    ``page_table``: the batch layout; ``rules`` ``[B]`` ``ExitRule`` or None; ``eligible``
    ``[B]``: the row may exit; ``iters_used`` ``[B]`` and ``iterations_run`` (token-iterations)
    filled by the model; ``exit_thr`` / ``exit_weighted``: ``[T]`` float32 / bool Ouro
    readout threshold (+inf: last step) and mixture flag (graphs bind static buffers; eager
    reads ``rules``); ``traced`` ``[B]``: ``return_latent_trace``; ``readout_steps`` ``[T]
    int64`` Ouro readout step (-1: weighted), filled when ``track_readout``;
    ``exit_probs`` ``[T, S] float32`` Ouro exit probability per loop step; ``drop_skipped``
    ``[B]``: ``upstream`` rule rows (attention masks positions without K/V, ``SlotSteps``),
    None when none.
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

    @property
    def graph_ok(self) -> bool:
        """Whether a masked (graph) forward gives the same result: no row may exit, and no
        row needs skipped steps masked (``drop_skipped``: the graph path has no key mask)."""
        return not self.any_exit and self.drop_skipped is None

    def row_starts(self) -> list[int]:
        out, s = [], 0
        for n in self.q_lens:
            out.append(s)
            s += n
        return out

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
        return torch.repeat_interleave(d, torch.tensor(self.q_lens)).to(device)

    def token_readout(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T] float32 threshold, [T] bool weighted)`` of each token's readout rule (Ouro):
        +inf / False for the last step, the rule's threshold for ``threshold*`` rules, +inf /
        True for ``weighted``."""
        thr = [r.threshold if r is not None and r.criterion != "weighted" else math.inf
               for r in self.rules]
        weighted = [r is not None and r.criterion == "weighted" for r in self.rules]
        reps = torch.tensor(self.q_lens)
        return (torch.repeat_interleave(torch.tensor(thr, dtype=torch.float32), reps).to(device),
                torch.repeat_interleave(torch.tensor(weighted), reps).to(device))

    def record(self, batch) -> None:
        """Append each sampling row's iteration count to its request's stats and, for a
        traced row (``traced``), one entry to its ``latent_trace``: ``{"depth": n}``
        (iterations its last token ran) plus, when the forward reported readout steps
        (Ouro), ``"readout_step"``: the 0-based step read out, None for ``weighted``, and
        ``"exit_probs"``: :func:`exit_distribution` of the token's ``depth`` steps.
        Host reads of ``readout_steps`` / ``exit_probs`` only when a traced row samples."""
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
    """A token's Ouro exit distribution over the ``len(p)`` loop steps it ran (upstream
    ``modeling_ouro.py``, ``OuroForCausalLM.forward``: ``p_t = lambda_t * prod_{j<t}(1 -
    lambda_j)``, the last step takes the remaining mass), from the per-step probabilities
    ``p`` the forward computed: the last entry is ``1 - sum(p[:-1])``, so the list sums to 1
    in float64 whatever the model dtype. A ``threshold-approx`` token that stopped early ran
    fewer steps than its depth: its last step takes the mass of the steps it skipped."""
    head = [float(x) for x in p[:-1]]
    return head + [max(0.0, 1.0 - math.fsum(head))]


class ActiveRows:
    """The rows of a compact ``RecurrentBatch`` still iterating, for one forward.

    ``select(t)`` makes the attention metadata of ``ForwardContext`` describe the rows that
    run iteration ``t`` (depth ``> t``, not exited) and returns their token indices
    (``[T_active] int64``, or None when every token of the batch is active). Metadata are
    prepared once per distinct row set. ``exit(rows, t)`` retires rows after iteration ``t``.
    ``restore()`` puts the full batch's metadata back.
    """

    def __init__(self, rb: RecurrentBatch, ctx):
        from latentserve.attention.base import BatchLayout

        self._layout_cls = BatchLayout
        self.rb, self.ctx = rb, ctx
        self.full_meta = ctx.attn_meta
        self.starts = rb.row_starts()
        self.num_tokens = sum(rb.q_lens)
        self.exited = [False] * len(rb.row_depths)
        self.rb.iters_used = [min(d, rb.num_iters) for d in rb.row_depths]
        self._key = None
        self._idx = None
        self._cache: dict[tuple, tuple] = {}

    def rows_at(self, t: int) -> list[int]:
        return [b for b, d in enumerate(self.rb.row_depths) if d > t and not self.exited[b]]

    def tokens_of(self, rows: list[int]) -> list[int]:
        out = []
        for b in rows:
            out.extend(range(self.starts[b], self.starts[b] + self.rb.q_lens[b]))
        return out

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
            dev = rb.out_slots.device
            tok = torch.tensor(self.tokens_of(rows), dtype=torch.int64).to(dev)
            sel = torch.tensor(rows, dtype=torch.int64).to(dev)
            layout = self._layout_cls([rb.q_lens[b] for b in rows], [rb.kv_lens[b] for b in rows],
                                      rb.rows[sel], rb.out_slots[tok])
            hit = (tok, self.ctx.backend.prepare(layout, rb.page_table))
        self._cache[key] = hit
        return hit

    def select(self, t: int):
        """Rows running iteration ``t``: returns ``(rows, token index or None)`` and points
        the context's attention metadata at them. ``rows`` may be empty."""
        rows = self.rows_at(t)
        if rows:
            idx, meta = self.meta_for(rows)
            self.ctx.attn_meta = meta
            n = self.num_tokens if idx is None else len(idx)
            self.rb.iterations_run += n
            return rows, idx
        return rows, None

    def exit(self, rows: list[int], t: int) -> None:
        for b in rows:
            self.exited[b] = True
            self.rb.iters_used[b] = t + 1

    def slots_of(self, rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(self.tokens_of(rows), dtype=torch.int64).to(self.rb.out_slots.device)
        return self.rb.out_slots[idx]

    def restore(self) -> None:
        self.ctx.attn_meta = self.full_meta


def slot_steps(kv_pool) -> torch.Tensor:
    """``[num_slots + 1] int32`` on the pool's device, kept on the pool: per KV slot, the
    iterations its token has K/V for (banks of iterations ``< n`` hold it). Written by a
    forward that has ``RecurrentBatch.drop_skipped`` rows (each new token: its depth, or its
    exit iteration + 1), read by their attention (``upstream`` exit semantics: a position
    without K/V at iteration ``t`` is masked there). Slots of other requests are never read
    through it."""
    steps = getattr(kv_pool, "recurrent_slot_steps", None)
    if steps is None:
        steps = torch.zeros(kv_pool.num_slots + 1, dtype=torch.int32, device=kv_pool.k[0].device)
        kv_pool.recurrent_slot_steps = steps
    return steps


def fill_banks(kv_pool, slots: torch.Tensor, bank, t_last: int, depth: int,
               num_layers: int) -> None:
    """Huginn's "latest same-layer" rule, write side: copy the K/V of iteration ``t_last`` of
    every looped layer ``l`` (pool layer ``bank(t_last, l)``) at ``slots`` (``[N] int64``) into
    the banks of iterations ``t_last + 1 .. depth - 1``."""
    for l in range(num_layers):
        src = bank(t_last, l)
        k, v = kv_pool.k[src][slots], kv_pool.v[src][slots]
        for t in range(t_last + 1, depth):
            dst = bank(t, l)
            kv_pool.k[dst][slots] = k
            kv_pool.v[dst][slots] = v


def recurrence_stats(iters: list[int]) -> dict:
    """Per-request stats: ``{"tokens", "mean_iterations", "histogram": {iters: count}}``
    over the sampled tokens (each counted with the iterations of the position it was
    sampled from)."""
    hist: dict[int, int] = {}
    for n in iters:
        hist[n] = hist.get(n, 0) + 1
    mean = sum(iters) / len(iters) if iters else math.nan
    return {"tokens": len(iters), "mean_iterations": mean,
            "histogram": dict(sorted(hist.items()))}


def default_graph_depths(spec) -> list[int]:
    """Recurrence counts captured for a recurrent model: powers of two up to the spec's
    max budget, plus its default and its max, so a batch replays a loop at most about
    twice as deep as its deepest row (1, 2, 4, 8, 16, 32 for Huginn's max 32)."""
    top = max(spec.max_budget, 1)
    depths = {max(spec.default_budget, 1), top}
    d = 1
    while d < top:
        depths.add(d)
        d *= 2
    return sorted(depths)


class RecurrentGraphs(GraphHooks):
    """Recurrent depth in the decode graphs (``engine/cuda_graph.py``): the loop runs in the
    masked mode (``RecurrentBatch`` masked) with a fixed trip count ``D``, one graph per
    (bucket, D) for D in ``depths`` (default: :func:`default_graph_depths`); static buffers
    (``max_bs`` rows) give each token its recurrence count (``row_depths [B] int64``,
    padded rows 0) and Ouro readout rule (``exit_thr [B] float32``, +inf: the last step;
    ``exit_weighted [B] bool``), and take Ouro's readout step per token
    (``readout_steps [B] int64``) and exit probability per loop step (``exit_probs [B,
    max D] float32``, columns past a replay's depth stale). A batch replays the smallest D
    that covers its deepest row; one with a row that may exit early runs eagerly."""

    packed = False  # each forward carries its RecurrentBatch (per-row depths)

    def __init__(self, spec, max_bs: int, device, depths=None):
        self.depths = sorted(set(depths or default_graph_depths(spec)))
        self.row_depths = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.exit_thr = torch.full((max_bs,), math.inf, device=device)
        self.exit_weighted = torch.zeros(max_bs, dtype=torch.bool, device=device)
        ouro = spec.family == "ouro"
        self.readout_steps = (torch.zeros(max_bs, dtype=torch.int64, device=device)
                              if ouro else None)
        self.exit_probs = (torch.zeros(max_bs, self.depths[-1], device=device)
                           if ouro else None)

    def bind(self, ctx, depth: int, b: int) -> None:
        ctx.depths = self.row_depths[:b]
        ctx.recurrent = RecurrentBatch(
            num_iters=depth, masked=True, exit_thr=self.exit_thr[:b],
            exit_weighted=self.exit_weighted[:b],
            readout_steps=None if self.readout_steps is None else self.readout_steps[:b],
            exit_probs=None if self.exit_probs is None else self.exit_probs[:b, :depth])

    def fits(self, rec) -> bool:
        """No row may exit early and the deepest row is within the deepest captured loop."""
        return rec.graph_ok and rec.num_iters <= self.depths[-1]

    def depth_for(self, rec) -> int:
        return next(d for d in self.depths if d >= rec.num_iters)

    def refresh(self, rec, n: int, b: int) -> None:
        dev = self.row_depths.device
        self.row_depths[:n].copy_(rec.token_depths(dev))
        self.row_depths[n:b].zero_()
        thr, weighted = rec.token_readout(dev)
        self.exit_thr[:n].copy_(thr)
        self.exit_weighted[:n].copy_(weighted)
        self.exit_thr[n:b].fill_(math.inf)
        self.exit_weighted[n:b].zero_()

    def replayed(self, rec, n: int) -> None:
        rec.iters_used = list(rec.row_depths)
        if self.readout_steps is not None:  # Ouro: the replay's readouts
            rec.readout_steps = self.readout_steps[:n]
            rec.exit_probs = self.exit_probs[:n]


class RecurrentFamily(Family):
    """The engine's :class:`~latentserve.latent.family.Family` for recurrent-depth models
    (``LatentSpec.kind == "recurrent"``): ``latent_budget`` is every token's recurrence
    count, the ``exit_*`` fields its exit rule (:func:`resolve_exit_rule`, the engine's
    ``exit_semantics`` as the default); nothing is added to the prompt and there are no
    latent inputs (the recurrence runs inside ``model.forward``)."""

    budgeted = True
    traced = True
    takes_exit_fields = True
    description = "a recurrent-depth model"

    @property
    def takes_exit_semantics(self) -> bool:  # Ouro's exits are exact readouts: one semantics
        return self.spec.family == "huginn"

    @staticmethod
    def forward_context(batch, layout, page_table) -> RecurrentBatch:
        return RecurrentBatch.from_batch(batch, layout, page_table)

    @staticmethod
    def graph_hooks(spec, model, max_bs, device, depths=None) -> RecurrentGraphs:
        return RecurrentGraphs(spec, max_bs, device, depths)

    def admit(self, prompt_ids, params) -> Admission:
        budget = self.spec.resolve_budget(params.latent_budget)
        rule = resolve_exit_rule(self.spec, params, self.engine.exit_semantics)
        if rule is not None and rule.prompt_exits:
            self._check_upstream_exit(len(prompt_ids))

        def start(req: Req) -> None:  # no phase machine: answer_start stays 0
            req.latent_budget, req.state = budget, RecurrentState(rule)
            req.cache_salt = salt_of(cache_salt_key(budget, rule))

        return Admission(params, 0, start)

    def admits_now(self, req: Req, budget: int) -> bool:
        """A prompt that is one exit block (``ExitRule.prompt_exits``) runs whole, in one
        forward: it is admitted only when it fits the budget."""
        rule = req.state.exit_rule
        return not (rule is not None and rule.prompt_exits and len(req.prompt_ids) > budget)

    def chunk(self, req: Req, n: int) -> int:
        """A request whose exit rule saves compute runs its generated tokens (recomputed
        after a preemption too) one per forward and ends a prompt chunk at the prompt's end,
        so each token that may exit early is a batch row of its own."""
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
        if done and req.state.iters:
            fields["recurrence"] = recurrence_stats(req.state.iters)
        return fields

    def _check_upstream_exit(self, n: int) -> None:
        """Refuse (ValueError naming ``exit_semantics``) an upstream-semantics exit rule the
        engine cannot run exactly: on an attention backend without ``supports_key_mask``,
        or a prompt of ``n`` tokens above ``max_num_batched_tokens`` (its one exit block)."""
        engine = self.engine
        if not engine.key_mask_ok:
            raise ValueError(f"exit_semantics 'upstream' needs the torch attention backend "
                             f"(it masks skipped steps per position); this server runs "
                             f"{engine.backend_name!r}: use exit_semantics 'engine'")
        if n > engine.max_num_batched_tokens:
            raise ValueError(f"exit_semantics 'upstream' runs the prompt as one exit block, but "
                             f"it has {n} tokens and max_num_batched_tokens is "
                             f"{engine.max_num_batched_tokens}")
