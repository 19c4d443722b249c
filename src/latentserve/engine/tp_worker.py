"""Tensor parallelism across processes: rank 0 broadcasts each batch; ranks 1..N-1 run the
same forward on their shard (docs/internals.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from latentserve.attention.base import make_backend
from latentserve.config import EngineConfig
from latentserve.distributed import destroy_tp_group, init_tp_group
from latentserve.engine.model_runner import ModelRunner, pending_row
from latentserve.kvcache.pool import KVPool, PageTable
from latentserve.latent import vectors as latent_vectors
from latentserve.latent.load import load_model
from latentserve.models.checkpoint import resolve_model_dir
from latentserve.scheduler.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerSetup:
    """What rank 0 decides after loading and every worker must copy: KV pool size in slots,
    page-table width, capture layer (-1: none), the largest CUDA-graph batch (0: eager)."""

    kv_slots: int
    max_model_len: int
    capture_layer: int
    graph_max_bs: int


@dataclass(slots=True)
class StepHeader:
    """One batch as the workers need it: per request ``(row, start, n, ids_chunk, prompt_len,
    latent_start, latent_len, latent_positions, latent_budget, exit_rule)``; latent vectors
    ``[num_latent, hidden]`` and (overlap) ``pending`` tokens follow on the device group."""

    reqs: list[tuple]
    sample: list[bool]
    max_kv_len: int
    num_latent: int
    latent_dtype: str
    pending: list[int]
    num_prev_tokens: int


class _Window:
    """``ids`` of a worker-side request: only the slice ``[start, start + len(ids))`` that
    this step computes is known; slicing it returns that part."""

    __slots__ = ("ids", "start")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start : s.stop - self.start]


# Rank 0 scores prompt logprobs and keeps the latent trace; workers do neither.
_NO_PROMPT_LOGPROBS = type("_ShadowParams", (), {"prompt_logprobs": None,
                                                 "return_latent_trace": False})()


@dataclass(slots=True)
class _ShadowState:
    """A recurrent request's ``exit_rule`` on a worker; ``iters`` collects what rank 0
    records too (unused here)."""

    exit_rule: Any
    iters: list = dataclasses.field(default_factory=list)


@dataclass(slots=True)
class _ShadowReq:
    """The fields of a ``Req`` that ``ModelRunner.run`` and ``RecurrentBatch`` read."""

    row: int
    ids: _Window
    prompt_ids: range  # only its length is read
    latent_start: int
    latent_embeds: list
    latent_budget: int
    state: Any  # _ShadowState: what RecurrentBatch reads of a recurrent request's state
    # The engine refuses prompt logprobs under tensor parallelism (rank 0 scores them).
    params: Any = dataclasses.field(default_factory=lambda: _NO_PROMPT_LOGPROBS)

    def ids_slice(self, start: int, stop: int) -> list[int]:
        return self.ids[start:stop]

    @property
    def seq_len(self) -> int:
        """The end of this step's chunk (rank 0 maps a pending id only where its chunk ends
        its ids, ``model_runner.pending_row``)."""
        return self.ids.start + len(self.ids.ids)


def _chunk(req, start: int, n: int) -> list[int]:
    """``req.ids[start : start + n]`` without building ``prompt_ids + output_ids``."""
    p = len(req.prompt_ids)
    if start >= p:
        return req.output_ids[start - p : start - p + n]
    return req.ids[start : start + n]


def _latent_span(req, start: int, n: int) -> range:
    """Positions of ``[start, start + n)`` inside ``req``'s latent span (as ``ModelRunner``)."""
    if not req.latent_embeds:
        return range(0)
    lo = max(start, req.latent_start)
    hi = min(start + n, req.latent_start + len(req.latent_embeds))
    return range(lo, max(lo, hi))


class TPModelRunner(ModelRunner):
    """A ``ModelRunner`` on one TP rank: rank 0's ``run`` broadcasts first; a worker's
    ``serve_forever()`` runs batches until stop."""

    def __init__(self, model, kv_pool, table, backend, device, tp):
        super().__init__(model, kv_pool, table, backend, device)
        self.tp = tp

    # ----- rank 0 -----

    def send_setup(self, setup: RunnerSetup) -> None:
        self._send_object(setup)

    def send_stop(self) -> None:
        self._send_object(None)

    def run(self, batch, pending=None):
        if self.tp.is_driver:
            self._send_batch(batch, pending)
        return super().run(batch, pending)

    def _send_object(self, obj) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([obj], src=0, group=self.tp.cpu_group)

    def _send_batch(self, batch, pending: tuple | None) -> None:
        """Broadcast ``batch``'s ``StepHeader``, page-table block, latent vectors and pending
        tokens; what may raise runs before the first send."""
        import torch.distributed as dist

        reqs: list = []
        vecs: list = []
        src_of = None if pending is None else pending[1]
        rows_of = [pending_row(r, s, n, src_of) for r, s, n
                   in zip(batch.reqs, batch.starts, batch.q_lens)]
        for req, start, n in zip(batch.reqs, batch.starts, batch.q_lens):
            span = _latent_span(req, start, n)
            vecs.extend(req.latent_embeds[p - req.latent_start] for p in span)
            reqs.append((req.row, start, n, _chunk(req, start, n), len(req.prompt_ids),
                         req.latent_start, len(req.latent_embeds), list(span),
                         int(req.latent_budget), getattr(req.state, "exit_rule", None)))
        max_kv = max(s + n for s, n in zip(batch.starts, batch.q_lens))
        rows = torch.tensor([r.row for r in batch.reqs], dtype=torch.int64, device=self.device)
        sent = [self.table.table[rows, :max_kv].contiguous()]
        # (tensor, row) entries (latent/vectors.py), as one [num_latent, hidden]
        latents = latent_vectors.stack(vecs).contiguous() if vecs else None
        if latents is not None:
            sent.append(latents)
        # NOTE: the tokens may view a graph's buffer: this send is queued before the replay
        prev = pending[0].contiguous() if pending is not None \
            and any(j is not None for j in rows_of) else None
        if prev is not None:
            sent.append(prev)
        self._send_object(StepHeader(
            reqs, list(batch.sample), max_kv, len(vecs),
            "" if latents is None else str(latents.dtype).removeprefix("torch."),
            [-1 if j is None else j for j in rows_of], 0 if prev is None else len(prev)))
        for t in sent:
            dist.broadcast(t, src=0, group=self.tp.device_group)

    # ----- workers -----

    def receive_setup(self) -> RunnerSetup:
        return self._receive_object()

    def _receive_object(self):
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.cpu_group)
        return box[0]

    def serve_forever(self) -> None:
        """Run rank 0's batches until it sends stop."""
        while True:
            header = self._receive_object()
            if header is None:
                return
            reqs, pending = self._receive_batch(header)
            self.run(ScheduledBatch(reqs, [r[1] for r in header.reqs],  # type: ignore[arg-type]
                                    [r[2] for r in header.reqs], header.sample), pending)

    def _receive_batch(self, header: StepHeader) -> tuple[list[_ShadowReq], tuple | None]:
        """The batch's ``_ShadowReq`` and its ``pending`` argument of ``ModelRunner.run``
        (rank 0's pending ids, as rows of the tokens it broadcast; None when none)."""
        import torch.distributed as dist

        dev = self.device
        rows = torch.tensor([r[0] for r in header.reqs], dtype=torch.int64, device=dev)
        block = torch.empty(len(rows), header.max_kv_len, dtype=self.table.table.dtype,
                            device=dev)
        dist.broadcast(block, src=0, group=self.tp.device_group)
        self.table.table[rows, : header.max_kv_len] = block
        vecs = None
        if header.num_latent:
            hidden = self.model.config.hidden_size
            vecs = torch.empty(header.num_latent, hidden,
                               dtype=getattr(torch, header.latent_dtype), device=dev)
            dist.broadcast(vecs, src=0, group=self.tp.device_group)
        out, k = [], 0
        for (row, start, _n, ids, prompt_len, lat_start, lat_len, span, budget,
             rule) in header.reqs:
            embeds: list = [None] * lat_len
            for p in span:
                embeds[p - lat_start] = (vecs, k)  # a (tensor, row) entry, as on rank 0
                k += 1
            out.append(_ShadowReq(row, _Window(start, ids), range(prompt_len), lat_start,
                                  embeds, budget, _ShadowState(rule)))
        if not header.num_prev_tokens:
            return out, None
        tokens = torch.empty(header.num_prev_tokens, dtype=torch.int64, device=dev)
        dist.broadcast(tokens, src=0, group=self.tp.device_group)
        return out, (tokens, {id(r): j for r, j in zip(out, header.pending) if j >= 0})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(config) -> tuple[Any, list[subprocess.Popen]]:
    """Start ranks 1..N-1 as subprocesses and join as rank 0: ``(TPGroup, processes)``.
    Raises RuntimeError when a worker exits before the group forms."""
    size = config.tensor_parallel_size
    init = f"tcp://127.0.0.1:{_free_port()}"
    payload = json.dumps(dataclasses.asdict(config))
    procs = [subprocess.Popen([sys.executable, "-m", "latentserve.engine.tp_worker", payload,
                               str(rank), str(size), init, str(os.getpid())])
             for rank in range(1, size)]
    import atexit

    atexit.register(_kill_alive, procs)  # e.g. when the engine fails after this point
    try:
        tp = init_tp_group(0, size, init, config.device)
    except Exception:
        _kill_alive(procs)
        raise
    return tp, procs


def abort_workers(procs: list[subprocess.Popen]) -> None:
    """Kill the workers and leave the process group (rank 0 failed before it could stop them
    in order)."""
    _kill_alive(procs)
    destroy_tp_group()


def _kill_alive(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def stop_workers(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """Wait for the workers to exit (after ``send_stop``); kill those that do not."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when rank 0's process goes away (its collectives would never come)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(1.0)


def worker_main(config, rank: int, size: int, init_method: str) -> None:
    """Rank ``rank``: load this rank's shard, copy rank 0's ``RunnerSetup`` (KV pool,
    page table, capture layer, CUDA graphs), then run batches until stop."""
    tp = init_tp_group(rank, size, init_method, config.device)
    torch.manual_seed(config.seed)
    model, hf_config = load_model(resolve_model_dir(config.model), config.torch_dtype,
                                  str(tp.device), latent_head=config.latent_head,
                                  no_latent_head=config.no_latent_head,
                                  latent_injection=config.latent_injection, tp=tp,
                                  fused_ops=config.use_fused_ops)
    layers, kv_heads, head_dim = model.kv_shape
    runner = None
    try:
        import torch.distributed as dist

        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
        setup: RunnerSetup = box[0]
        if hasattr(model, "prepare_positions"):  # the fast path's RoPE table, as rank 0's
            model.prepare_positions(setup.max_model_len)
        pool = KVPool(layers, setup.kv_slots, kv_heads, head_dim, config.torch_dtype,
                      tp.device)
        table = PageTable(config.max_num_seqs, setup.max_model_len, tp.device)
        backend = make_backend(config.backend_name, config.attention_num_kv_splits)
        runner = TPModelRunner(model, pool, table, backend, tp.device, tp)
        runner.set_capture(setup.capture_layer)
        if setup.graph_max_bs:
            runner.capture_graphs(setup.graph_max_bs, hf_config.hidden_size,
                                  config.torch_dtype, with_greedy=False)  # rank 0 samples
        runner.serve_forever()
    finally:
        if runner is not None:
            runner.release_graphs()
        destroy_tp_group()


def main(argv: list[str]) -> None:
    payload, rank, size, init, parent = argv
    threading.Thread(target=_exit_with_parent, args=(int(parent),), daemon=True).start()
    logging.basicConfig(level=logging.WARNING)
    worker_main(EngineConfig(**json.loads(payload)), int(rank), int(size), init)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NOTE: skip interpreter teardown (seconds for torch); the group is closed


if __name__ == "__main__":
    main(sys.argv[1:])
