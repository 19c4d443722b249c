"""How many KV slots the pool gets."""

from __future__ import annotations

import torch

CPU_KV_BYTES = 1 << 30  # the pool's size on CPU when --kv-slots is not given
_GPU_RESERVE_BYTES = 1 << 30  # activations, CUDA graphs and allocator slack


def kv_slots_for(config, bytes_per_slot: int, max_model_len: int, vocab_size: int) -> int:
    """KV pool size in tokens: ``config.kv_slots``; on CPU 1 GiB worth (at most
    ``max_num_seqs`` full requests); on CUDA ``gpu_memory_utilization`` of the device minus
    all in use and a reserve (as SGLang's ``mem_fraction_static``). Raises ValueError naming
    the flags when the pool cannot hold one ``max_model_len`` request."""
    if config.kv_slots:
        return config.kv_slots
    if not config.device.startswith("cuda"):
        return min(config.max_num_seqs * max_model_len, max(CPU_KV_BYTES // bytes_per_slot, 2))
    torch.cuda.empty_cache()  # blocks cached by an earlier engine in this process are free
    free, total = torch.cuda.mem_get_info(torch.device(config.device))
    logits = 4 * vocab_size * (2 * config.max_num_seqs + config.max_num_batched_tokens // 8)
    budget = total * config.gpu_memory_utilization - (total - free) - _GPU_RESERVE_BYTES - logits
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
