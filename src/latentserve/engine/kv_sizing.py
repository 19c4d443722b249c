"""How many KV slots the pool gets, and whether the pool and page table fit the device."""

from __future__ import annotations

import os

import torch

CPU_KV_BYTES = 1 << 30  # the pool's size on CPU when --kv-slots is not given
_GPU_RESERVE_BYTES = 1 << 30  # activations, CUDA graphs and allocator slack


def kv_slots_for(config, bytes_per_slot: int, max_model_len: int, vocab_size: int) -> int:
    """KV pool size in tokens: ``config.kv_slots``; on CPU 1 GiB worth (at most
    ``max_num_seqs`` full requests); on CUDA ``gpu_memory_utilization`` of the device minus
    all in use, a reserve and the per-sequence vocabulary rows (logits, penalty counts; as
    SGLang's ``mem_fraction_static``). Raises ValueError naming the flags when the pool
    cannot hold one ``max_model_len`` request."""
    if config.kv_slots:
        return config.kv_slots
    if not config.device.startswith("cuda"):
        return min(config.max_num_seqs * max_model_len, max(CPU_KV_BYTES // bytes_per_slot, 2))
    torch.cuda.empty_cache()  # blocks cached by an earlier engine in this process are free
    free, total = torch.cuda.mem_get_info(torch.device(config.device))
    # per sequence two float32 logits rows and the penalties' rows (int32 counts, bool
    # prompt tokens: penalties.PenaltyCounts); an eighth of a prefill chunk's logits
    rows = vocab_size * ((2 * 4 + 4 + 1) * config.max_num_seqs
                         + 4 * (config.max_num_batched_tokens // 8))
    budget = total * config.gpu_memory_utilization - (total - free) - _GPU_RESERVE_BYTES - rows
    slots = int(budget // bytes_per_slot)
    if slots < max_model_len + 1:
        gib = 1 << 30
        raise ValueError(
            f"the KV pool would hold {max(slots, 0)} tokens, fewer than one request of "
            f"max_model_len={max_model_len} needs ({bytes_per_slot} bytes per token): "
            f"{(total - free) / gib:.1f} of {total / gib:.1f} GiB of {config.device} are in "
            f"use (this process's weights and other processes), and "
            f"--gpu-memory-utilization={config.gpu_memory_utilization} counts them; lower "
            "--max-model-len or --max-num-seqs, raise --gpu-memory-utilization, free the "
            "device, or give the pool's size with --kv-slots")
    return slots


def check_fits(config, kv_slots: int, bytes_per_slot: int, max_model_len: int) -> None:
    """Raise ValueError naming the flags when the KV pool (``kv_slots`` x ``bytes_per_slot``)
    and the page table (``max_num_seqs + 1`` rows of ``max_model_len`` int64) need more bytes
    than the device has free (CPU: ``MemAvailable`` of /proc/meminfo, else physical memory)."""
    pool, table = (kv_slots + 1) * bytes_per_slot, (config.max_num_seqs + 1) * max_model_len * 8
    if config.device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(config.device))[0]
    else:
        free = _cpu_available_bytes()
    if pool + table > free:
        gib = 1 << 30
        raise ValueError(
            f"the KV pool ({kv_slots} slots x {bytes_per_slot} bytes = {pool / gib:.1f} GiB) and "
            f"the page table (max_num_seqs={config.max_num_seqs} x max_model_len="
            f"{max_model_len} x 8 bytes = {table / gib:.1f} GiB) need more than the "
            f"{free / gib:.1f} GiB free on {config.device}: lower --kv-slots, --max-num-seqs "
            "or --max-model-len")


def _cpu_available_bytes() -> int:
    """Linux's ``MemAvailable`` (free plus reclaimable cache) in bytes; elsewhere the
    machine's physical memory."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
