"""Tensor parallelism across processes: rank 0 broadcasts each batch; ranks 1..N-1 run the
same forward on their shard (docs/internals.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
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
from latentserve.staging import to_device

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


# Rank 0 scores prompt logprobs and keeps the latent trace; workers do neither.
_NO_PROMPT_LOGPROBS = type("_ShadowParams", (), {"prompt_logprobs": None,
                                                 "return_latent_trace": False})()


@dataclass(slots=True)
class _ShadowReq:
    """The fields of a ``Req`` that ``ModelRunner.run`` and ``RecurrentBatch`` read."""

    row: int
    start: int  # of this step's chunk: the only ids a worker knows
    chunk: list[int]
    prompt_ids: range  # only its length is read
    latent_start: int
    latent_embeds: list
    latent_budget: int
    # what RecurrentBatch reads of a recurrent request's state: its exit_rule, and iters,
    # which collects what rank 0 records too (unused here)
    state: SimpleNamespace
    # The engine refuses prompt logprobs under tensor parallelism (rank 0 scores them).
    params: Any = dataclasses.field(default_factory=lambda: _NO_PROMPT_LOGPROBS)

    def ids_slice(self, start: int, stop: int) -> list[int]:
        return self.chunk[start - self.start : stop - self.start]

    @property
    def seq_len(self) -> int:
        """The end of this step's chunk (rank 0 maps a pending id only where its chunk ends
        its ids, ``model_runner.pending_row``)."""
        return self.start + len(self.chunk)


class TPModelRunner(ModelRunner):
    """A ``ModelRunner`` on one TP rank: rank 0's ``run`` broadcasts first; a worker's
    ``serve_forever()`` runs batches until stop."""

    def __init__(self, model, kv_pool, table, backend, device, tp):
        super().__init__(model, kv_pool, table, backend, device)
        self.tp = tp

    def run(self, batch, pending=None):
        if self.tp.is_driver:
            self._send_batch(batch, pending)
        return super().run(batch, pending)

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
            # positions of [start, start + n) inside the latent span (as ModelRunner's)
            lo = max(start, req.latent_start)
            span = range(lo, max(lo, min(start + n, req.latent_start + len(req.latent_embeds))))
            vecs.extend(req.latent_embeds[p - req.latent_start] for p in span)
            reqs.append((req.row, start, n, req.ids_slice(start, start + n), len(req.prompt_ids),
                         req.latent_start, len(req.latent_embeds), list(span),
                         int(req.latent_budget), getattr(req.state, "exit_rule", None)))
        max_kv = max(s + n for s, n in zip(batch.starts, batch.q_lens))
        rows = to_device([r.row for r in batch.reqs], torch.int64, self.device)
        # (tensor, row) entries (latent/vectors.py), as one [num_latent, hidden]
        latents = latent_vectors.stack(vecs).contiguous() if vecs else None
        # NOTE: the tokens may view a graph's buffer: this send is queued before the replay
        prev = pending[0].contiguous() if pending is not None \
            and any(j is not None for j in rows_of) else None
        sent = [t for t in (self.table.table[rows, :max_kv].contiguous(), latents, prev)
                if t is not None]
        broadcast_object(self.tp, StepHeader(
            reqs, list(batch.sample), max_kv, len(vecs),
            "" if latents is None else str(latents.dtype).removeprefix("torch."),
            [-1 if j is None else j for j in rows_of], 0 if prev is None else len(prev)))
        for t in sent:
            dist.broadcast(t, src=0, group=self.tp.device_group)

    def serve_forever(self) -> None:
        """Run rank 0's batches until it sends stop."""
        while True:
            header = broadcast_object(self.tp)
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
        rows = to_device([r[0] for r in header.reqs], torch.int64, dev)
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
            out.append(_ShadowReq(row, start, ids, range(prompt_len), lat_start,
                                  embeds, budget, SimpleNamespace(exit_rule=rule, iters=[])))
        if not header.num_prev_tokens:
            return out, None
        tokens = torch.empty(header.num_prev_tokens, dtype=torch.int64, device=dev)
        dist.broadcast(tokens, src=0, group=self.tp.device_group)
        return out, (tokens, {id(r): j for r, j in zip(out, header.pending) if j >= 0})


def load_served_model(config: EngineConfig, model_dir, device: str, tp=None) -> tuple:
    """``latent.load.load_model`` with ``config``'s latent and fused-ops options:
    ``(model, hf_config)``."""
    return load_model(model_dir, config.torch_dtype, device, latent_head=config.latent_head,
                      no_latent_head=config.no_latent_head,
                      latent_injection=config.latent_injection, tp=tp,
                      fused_ops=config.use_fused_ops)


def make_runner(model, config: EngineConfig, kv_slots: int, max_model_len: int, device,
                tp=None) -> Any:
    """A runner with a KV pool of ``kv_slots`` tokens and a page table of ``max_model_len``
    columns (a ``TPModelRunner`` under ``tp``)."""
    layers, kv_heads, head_dim = model.kv_shape
    args = (model, KVPool(layers, kv_slots, kv_heads, head_dim, config.torch_dtype, device),
            PageTable(config.max_num_seqs, max_model_len, device),
            make_backend(config.backend_name, config.attention_num_kv_splits), device)
    return ModelRunner(*args) if tp is None else TPModelRunner(*args, tp)


def broadcast_object(tp, obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank, over the gloo group (pickled): a ``StepHeader``, the
    ``RunnerSetup``, or None (stop)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def start_workers(config) -> tuple[Any, list[subprocess.Popen]]:
    """Start ranks 1..N-1 as subprocesses and join as rank 0: ``(TPGroup, processes)``.
    Raises RuntimeError when a worker exits before the group forms."""
    import atexit
    import socket

    size = config.tensor_parallel_size
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    payload = json.dumps(dataclasses.asdict(config))
    procs = [subprocess.Popen([sys.executable, "-m", "latentserve.engine.tp_worker", payload,
                               str(rank), str(size), init, str(os.getpid())])
             for rank in range(1, size)]
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


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """Wait up to 30 s for the workers to exit (after ``send(None)``); kill those that do not."""
    deadline = time.monotonic() + 30.0
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    _kill_alive(procs)


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when rank 0's process goes away (its collectives would never come)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str]) -> None:
    """Rank ``rank`` (argv: config JSON, rank, size, init method, rank 0's pid): load this
    rank's shard, copy rank 0's ``RunnerSetup`` (KV pool, page table, capture layer, CUDA
    graphs), then run batches until stop."""
    payload, rank, size, init, parent = argv
    threading.Thread(target=_exit_with_parent, args=(int(parent),), daemon=True).start()
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig(**json.loads(payload))
    tp = init_tp_group(int(rank), int(size), init, config.device)
    torch.manual_seed(config.seed)
    model, hf_config = load_served_model(config, resolve_model_dir(config.model),
                                         str(tp.device), tp)
    runner: Any = None  # a TPModelRunner
    try:
        setup: RunnerSetup = broadcast_object(tp)
        if hasattr(model, "prepare_positions"):  # the fast path's RoPE table, as rank 0's
            model.prepare_positions(setup.max_model_len)
        runner = make_runner(model, config, setup.kv_slots, setup.max_model_len, tp.device,
                             tp)
        runner.capture_layer = setup.capture_layer
        if setup.graph_max_bs:
            runner.capture_graphs(setup.graph_max_bs, hf_config.hidden_size,
                                  config.torch_dtype, with_greedy=False)  # rank 0 samples
        runner.serve_forever()
    finally:
        if runner is not None:
            runner.release_graphs()
        destroy_tp_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NOTE: skip interpreter teardown (seconds for torch); the group is closed


if __name__ == "__main__":
    main(sys.argv[1:])
