"""Engine configuration shared by the CLI, the server and ``LLM``: each field is declared
once (``options.option``); the flags (``cli/engine_args.py``) and checks come from that."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from latentserve.options import check, option
from latentserve.sampling_params import EXIT_SEMANTICS
from latentserve.token_masks import REASONING_PARSERS

# vLLM's --dtype names (vllm/config/model.py: _STR_DTYPE_TO_TORCH_DTYPE) and what they mean.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ("auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES)
DEVICES = ("auto", "cpu", "cuda")  # and cuda:N


def check_device_name(device) -> str:
    """``device`` when it is one of ``DEVICES`` or ``cuda:N`` (N a GPU index); ValueError
    naming the field otherwise."""
    if isinstance(device, str) and (device in DEVICES or re.fullmatch(r"cuda:\d+", device)):
        return device
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N (N a GPU index), got "
                     f"{device!r}")


def _device_arg(text: str) -> str:
    """The ``--device`` argparse type: :func:`check_device_name`'s check and text."""
    try:
        return check_device_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def checkpoint_dtype(model: str | None) -> str:
    """A directory's ``config.json`` ``torch_dtype`` (or ``dtype``) when it is float32,
    bfloat16 or float16; else bfloat16 (a ``.gguf``, the embedded model, no config)."""
    if model is not None:
        try:
            config = json.loads((Path(model).expanduser() / "config.json").read_text())
            stored = config.get("torch_dtype") or config.get("dtype")
        except (OSError, ValueError, AttributeError):
            stored = None
        if stored in ("float32", "bfloat16", "float16"):
            return stored
    return "bfloat16"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_device(device: str) -> None:
    """Raises ValueError naming ``device`` when it is ``cuda`` (``cuda:N``) and torch sees no
    CUDA device."""
    if device.startswith("cuda") and not _cuda_available():
        import torch

        raise ValueError(f"device {device!r}: no CUDA device is available here "
                         f"(torch {torch.__version__}); use --device cpu")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine is asked to run; each field's ``help`` says what it means. After
    construction ``device`` and ``dtype`` are concrete (``auto`` device: ``cuda`` when torch
    sees one, else ``cpu``; ``auto`` dtype: float32 on the CPU, :func:`checkpoint_dtype` on
    CUDA; ``half`` / ``float`` renamed) and ``model`` has no trailing ``/``.
    ``latent_cap_where_applicable`` (each model of a multi-model server): ``max_latent_budget``
    and ``upstream_stop_rules`` are ignored or clipped by models they do not fit, not an
    error. Raises ValueError naming the field and its allowed values."""

    model: str | None = option(
        None, "HF-style model directory or .gguf file (default: the embedded SmolLM2); "
        "also the first positional argument, as in `vllm serve MODEL`", cli=False)
    served_model_name: tuple[str, ...] | None = option(
        None, "the name(s) the model is served as: the first in responses and metrics, "
        "every one accepted in `model` and listed by /v1/models (default: the --model "
        "path as given)", metavar="NAME", nargs="+")
    tokenizer: str | None = option(
        None, "tokenizer directory (default: the model's own tokenizer files)")
    device: str = option("auto", "auto: cuda when a CUDA device is present, else cpu; "
                         "cuda:N: GPU N", type=_device_arg, metavar="{auto,cpu,cuda,cuda:N}")
    dtype: str = option("auto", "weights and activations; auto: the checkpoint's dtype on "
                        "cuda (bfloat16 for a .gguf or the embedded model), float32 on cpu; "
                        "half = float16, float = float32", choices=DTYPES)
    max_model_len: int | None = option(
        None, "prompt + output tokens per request (default: the model's limit; 1k = 1000, "
        "1K = 1024)", ge=2, human=True)
    max_num_seqs: int = option(64, "requests running at once", ge=1)
    kv_slots: int | None = option(
        None, "KV pool size in tokens (default: 1 GiB on cpu; on cuda "
        "--gpu-memory-utilization of the device minus the memory in use on it)", ge=2,
        human=True)
    max_num_batched_tokens: int = option(2048, "tokens per forward (prefill chunk budget)",
                                         ge=1, human=True)
    enable_prefix_caching: bool = option(
        True, "reuse the KV of shared prompt prefixes (the radix cache)",
        flags=("--enable-prefix-caching",),
        off_flags=("--no-enable-prefix-caching", "--no-prefix-caching"))
    attention_backend: str = option("auto", "auto: triton on cuda, torch on cpu",
                                    choices=("auto", "torch", "triton"))
    attention_num_kv_splits: int = option(
        8, "Triton decode attention: the most splits of each request's keys; a batch that "
        "fills the GPU's SMs takes fewer (1: no merge kernel)", ge=1)
    gpu_memory_utilization: float = option(
        0.9, "fraction of GPU memory for weights, KV pool and graphs", gt=0.0, le=1.0)
    enforce_eager: bool = option(False, "no CUDA graphs")
    fused_ops: bool | None = option(
        None, "the fast path's Triton kernels and merged GEMMs (default: on with cuda and "
        "the triton backend)", flags=("--fused-ops",), off_flags=("--no-fused-ops",))
    seed: int = option(0, "the engine's random seed (requests with a seed use their own)",
                       ge=0, le=2**63 - 1)
    latent_head: str | None = option(
        None, "compression-head bundle (default: env LATENTSERVE_LATENT_HEAD, else "
        "latent_reasoning_head.safetensors in the model directory)")
    no_latent_head: bool = option(False, "serve the bare backbone even when a head bundle "
                                  "is found")
    latent_injection: str | None = option(None, "override the head bundle's injection mode",
                                          choices=("closed_loop", "prompt"))
    tensor_parallel_size: int = option(
        1, "split the model across this many processes (one GPU each on cuda)", ge=1,
        flags=("--tensor-parallel-size", "--tp", "-tp"))
    max_latent_budget: int | None = option(
        None, "cap on a request's latent_budget: latent steps (COCONUT, CODI), recurrences "
        "per token (Huginn, Ouro) or block passes (PCCoT, LOTUS); default: the model's own "
        "cap; with several --model, each latent model is capped within its own range and "
        "the others ignore it", ge=1, flags=("--max-latent-budget", "--max-recurrence"))
    latent_cap_where_applicable: bool = option(False, cli=False)
    upstream_stop_rules: bool = option(
        False, "requests that do not say (upstream_stop_rules) end on EOS as the family's "
        "upstream code does (COCONUT, PCCoT: an EOS as the first answer token is kept and "
        "decoding goes on), to reproduce upstream numbers exactly; default off: the first "
        "EOS ends a request, as in vLLM; refused for other families (with several --model, "
        "they ignore it)")
    overlap_schedule: bool | None = option(
        None, "schedule and prepare the next step while the device runs this one (default "
        "on cuda; every family, tensor parallel, logprobs and penalties too)",
        flags=("--overlap-schedule",), off_flags=("--disable-overlap-schedule",))
    exit_semantics: str = option(
        "engine", "requests that do not say (exit_semantics) use this Huginn adaptive exit: "
        "'engine' (default: the prompt runs full depth, an exited token's K/V fills its "
        "skipped steps) or 'upstream' (upstream's defaults: the prompt may exit as one "
        "block, skipped steps are dropped from attention; needs the torch attention "
        "backend); models without Huginn's exit ignore it", choices=EXIT_SEMANTICS)
    generation_config: str = option(
        "auto", "sampling defaults for the fields a request leaves unset (vLLM's flag): "
        "'auto' (the model's generation_config.json), 'vllm' (none) or a folder holding a "
        "generation_config.json", metavar="auto|vllm|DIR")
    grammar_compile_timeout: float = option(
        10.0, "seconds a request's structured-outputs grammar may take to compile (on a "
        "thread of the server's engine process, beside the running requests) before the "
        "request is refused with a 400; the offline LLM compiles in add_request, unbounded",
        gt=0)
    max_logprobs: int = option(
        20, "most logprobs (top alternatives) and prompt_logprobs a request may ask for "
        "(vLLM's; -1: the vocabulary size)", ge=-1)
    reasoning_parser: str | None = option(
        None, "the model writes <think>...</think> reasoning: the server splits it into "
        "reasoning_content and thinking_token_budget caps it; default: none",
        choices=tuple(sorted(REASONING_PARSERS)))

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize in place, once
        if self.served_model_name is not None:
            names = ((self.served_model_name,) if isinstance(self.served_model_name, str)
                     else tuple(self.served_model_name))
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name must be one or more non-empty names, "
                                 f"got {self.served_model_name!r}")
            set_(self, "served_model_name", names)
        set_(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if isinstance(self.model, str) and len(self.model) > 1:  # dir/ and dir: one name
            set_(self, "model", self.model.rstrip("/") or "/")
        check_device_name(self.device)
        check(self)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder path, got "
                             f"{self.generation_config!r}")
        for name in ("latent_head", "latent_injection"):  # they contradict --no-latent-head
            if self.no_latent_head and getattr(self, name) is not None:
                raise ValueError(f"no_latent_head serves the bare backbone; {name} "
                                 f"({getattr(self, name)!r}) asks for a head: give one of them")
        # local paths, before any loading (a tokenizer not starting with /, . or ~ is a name
        # for transformers' cache; a latent_head directory without a bundle: FileNotFoundError)
        from latentserve.models.checkpoint import TOKENIZER_FILES, has_tokenizer_files

        if self.tokenizer is not None:
            path = Path(self.tokenizer).expanduser()
            if path.is_dir():
                if not has_tokenizer_files(path):
                    raise ValueError(f"tokenizer {self.tokenizer!r} holds no tokenizer files "
                                     f"(any of {', '.join(TOKENIZER_FILES)})")
            elif path.exists() or self.tokenizer.startswith(("/", ".", "~")):
                raise ValueError(f"tokenizer must be a directory holding tokenizer files; "
                                 f"{self.tokenizer!r} is not a directory")
        if self.latent_head is not None:  # read_bundle's file, or a model dir holding one
            path = Path(self.latent_head).expanduser()
            if path.is_dir():
                from latentserve.latent.bundle import find_bundle

                find_bundle(path, self.latent_head)  # FileNotFoundError: no bundle in it
            elif not path.is_file():
                raise ValueError(f"--latent-head (latent_head) must be a head bundle file "
                                 f"(.safetensors or .pt) or a model directory holding one; "
                                 f"{self.latent_head!r} does not exist")
        if self.generation_config != "auto":  # "auto" reads the model's, if any, at load
            from latentserve.models.generation_config import generation_config_file

            generation_config_file(None, self.generation_config)
        if self.device == "auto":
            set_(self, "device", "cuda" if _cuda_available() else "cpu")
        if self.dtype == "auto":
            set_(self, "dtype", checkpoint_dtype(self.model) if self.device.startswith("cuda")
                 else "float32")

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
