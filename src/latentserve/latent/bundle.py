"""Compression-head bundles: read, validate, write (after the DeepSeek-V4 addon's
``checkpoint.py``; docs/internals.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from latentserve import settings
from latentserve.latent.head import CONTROLS, HEAD_BUNDLE_NAME, HeadConfig, LatentHead
from latentserve.latent.spec import LatentSpec
from latentserve.models.checkpoint import load_tokenizer

SUBDICTS = ("reasoning_head", "decoder", "target_proj")
CURRENT_FORMAT = 3


@dataclass(slots=True)
class HeadBundle:
    """A parsed bundle: ``format_version``, ``config`` and three state dicts (``str ->
    tensor``; ``decoder`` / ``target_proj`` may be None)."""

    format_version: int
    config: HeadConfig
    reasoning_head: dict
    decoder: dict | None = None
    target_proj: dict | None = None

    @property
    def has_stop_head(self) -> bool:
        return any(k.startswith("stop_head.") for k in self.reasoning_head)

    def build(self) -> LatentHead:
        """The float32 modules with the weights loaded (``read_bundle`` validated them)."""
        head = LatentHead(self.config, self.has_stop_head, self.target_proj is not None)
        for part in SUBDICTS:
            if getattr(self, part) is not None:
                getattr(head, part).load_state_dict(getattr(self, part), strict=True)
        return head.float().eval().requires_grad_(False)


def validate(b: HeadBundle) -> None:
    """ValueError when the bundle cannot be served: ``arch`` not v1, v3+ without a stop head,
    an unexpected (named) or missing key, a shape mismatch or a non-finite weight."""
    cfg = b.config
    if cfg.arch != "v1":
        raise ValueError(f"head arch {cfg.arch!r} is not supported (only 'v1')")
    if b.format_version >= 3 and not b.has_stop_head:
        raise ValueError(f"format_version {b.format_version} bundle has no stop head "
                         "(reasoning_head.stop_head.*); format_version >= 3 requires one")
    with torch.device("meta"):  # shapes without allocating
        probe = LatentHead(cfg, has_stop_head=b.has_stop_head, has_target_proj=True)
    for name in (s for s in SUBDICTS if getattr(b, s) is not None):
        got = getattr(b, name)
        want = {k: tuple(v.shape) for k, v in getattr(probe, name).state_dict().items()}
        for k, v in got.items():
            if k not in want:
                raise ValueError(f"unexpected key {name}.{k} for arch {cfg.arch!r} (wrong arch "
                                 "or head layout)")
            if tuple(v.shape) != want[k]:
                raise ValueError(f"{name}.{k} has shape {tuple(v.shape)}, config says {want[k]}")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                # a NaN/inf weight would inject NaN embeddings
                raise ValueError(f"{name}.{k} holds non-finite values (NaN or inf)")
        missing = next((k for k in want if k not in got), None)
        if missing is not None:
            raise ValueError(f"missing tensor {name}.{missing}")


def _from_dict(d: dict, source: str) -> HeadBundle:
    if "format_version" not in d:  # legacy: a bare head state dict
        if not all(isinstance(v, torch.Tensor) for v in d.values()) or "net.0.weight" not in d:
            raise ValueError(f"{source}: not a head bundle (no format_version, no net.0.weight)")
        if "net.4.weight" not in d:
            raise ValueError(f"{source}: legacy head state dict has no net.4.weight")
        cfg = HeadConfig(hidden_size=int(d["net.0.weight"].shape[1]),
                         latent_dim=int(d["net.4.weight"].shape[0]) // 2,
                         mlp_dim=int(d["net.0.weight"].shape[0]))
        fv = 3 if any(k.startswith("stop_head.") for k in d) else 2
        return HeadBundle(fv, cfg, dict(d))
    extra = sorted(str(k) for k in d if k not in ("format_version", "config", *SUBDICTS))
    if extra:  # as a .safetensors file refuses an unexpected tensor prefix
        raise ValueError(f"{source}: unexpected key {extra[0]!r} in the bundle (expected "
                         f"format_version, config and {SUBDICTS})")
    cfg = d.get("config")
    if cfg is None:
        raise ValueError(f"{source}: bundle has no 'config'")
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: 'config' is not JSON: {e}") from None
    v = d["format_version"]
    try:  # int(True) and int(3.7) would pass: only integers, integral floats and digits
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        fv = int(v)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{source}: format_version must be an integer, got {v!r}") from None
    if fv < 1:
        raise ValueError(f"{source}: format_version must be >= 1, got {fv}")
    if d.get("reasoning_head") is None:
        raise ValueError(f"{source}: bundle has no reasoning_head")
    return HeadBundle(fv, HeadConfig.from_dict(cfg),
                      **{s: _state_dict(d.get(s), s, source) for s in SUBDICTS})


def _state_dict(sd, name: str, source: str) -> dict | None:
    """``sd`` as a ``str -> tensor`` dict (None stays None); ValueError naming ``name``."""
    if sd is None:
        return None
    if not isinstance(sd, dict):
        raise ValueError(  # noqa: TRY004 - a bundle error, like the others
            f"{source}: {name} must be a dict of tensors, got {type(sd).__name__}")
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(  # noqa: TRY004 - a bundle error, like the others
                f"{source}: {name}.{k} must be a tensor, got {type(v).__name__}")
    return dict(sd)


def read_bundle(path: str | Path) -> HeadBundle:
    """Read and validate a bundle (``.safetensors`` or ``.pt``). Raises FileNotFoundError,
    or ValueError naming what is wrong (another suffix, a ``.pt`` needing a pickled object)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"head bundle {path} does not exist")
    if path.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"{path}: a head bundle is a .safetensors or .pt file, got "
                         f"{path.suffix or 'a name without a suffix'}")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # noqa: BLE001 - SafetensorError is no ValueError
            raise ValueError(f"{path}: not a readable .safetensors file "
                             f"({type(e).__name__}: {e})") from None
        if "subdicts" in meta:
            try:
                subs = json.loads(meta["subdicts"])
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: metadata 'subdicts' is not JSON: {e}") from None
            if not isinstance(subs, list) or not all(isinstance(x, str) for x in subs):
                raise ValueError(f"{path}: metadata 'subdicts' must be a JSON list of "
                                 f"prefixes, got {meta['subdicts']!r}")
        else:
            subs = sorted({k.split(".", 1)[0] for k in tensors})
        dotless = sorted(k for k in tensors if "." not in k)
        if dotless:
            raise ValueError(f"{path}: unexpected tensor {dotless[0]!r} (expected "
                             f"'<prefix>.<name>' with a prefix in {SUBDICTS})")
        extra = sorted({k.split(".", 1)[0] for k in tensors} - set(subs))
        if extra or not set(subs) <= set(SUBDICTS):
            bad = extra or sorted(set(subs) - set(SUBDICTS))
            raise ValueError(f"{path}: unexpected tensor prefix {bad[0]!r} (expected "
                             f"{SUBDICTS})")
        parts = {s: ({k.split(".", 1)[1]: v for k, v in tensors.items()
                      if k.startswith(s + ".")} or None) for s in subs}
        d = {"format_version": meta.get("format_version", CURRENT_FORMAT),
             "config": meta.get("config"), **parts}  # JSON text, parsed by _from_dict
        bundle = _from_dict(d, str(path))
    else:
        import pickle

        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: refused: the .pt bundle needs a pickled object that "
                             f"weights_only loading does not allow ({str(e).splitlines()[0]})"
                             ) from None
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise ValueError(f"{path}: not a readable .pt bundle ({type(e).__name__}: {e})"
                             ) from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: a .pt bundle must hold a dict, got {type(obj).__name__}")
        bundle = _from_dict(obj, str(path))
    validate(bundle)
    return bundle


def write_bundle(bundle: HeadBundle, path: str | Path) -> Path:
    """Write ``bundle`` as ``.safetensors`` (by suffix) or ``.pt``; ``read_bundle`` gives it
    back equal. Returns the path."""
    path = Path(path)
    validate(bundle)
    parts = {s: getattr(bundle, s) for s in SUBDICTS}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        flat = {f"{s}.{k}": v.detach().contiguous() for s, sd in parts.items() if sd
                for k, v in sd.items()}
        meta = {"format_version": str(bundle.format_version),
                "config": json.dumps(bundle.config.to_dict()),
                "subdicts": json.dumps([s for s in SUBDICTS if parts[s]])}
        save_file(flat, str(path), metadata=meta)
    else:
        torch.save({"format_version": bundle.format_version,
                    "config": bundle.config.to_dict(), **parts}, path)
    return path


def bundle_from_module(head: LatentHead, format_version: int = CURRENT_FORMAT) -> HeadBundle:
    """A bundle holding ``head``'s weights (float32 copies)."""
    def sd(m):
        return None if m is None else {k: v.detach().float().clone()
                                       for k, v in m.state_dict().items()}

    return HeadBundle(format_version, head.config, sd(head.reasoning_head), sd(head.decoder),
                      sd(head.target_proj))


def random_bundle(hidden_size: int, latent_dim: int = 16, mlp_dim: int | None = None,
                  source_layer: int = 0, seed: int = 0, stop_bias: float = 0.0,
                  scale: float = 1.0, **config) -> HeadBundle:
    """A random v1 bundle (tests, benchmarks); ``stop_bias`` on the stop logit, ``scale`` on
    the init, ``config`` to ``HeadConfig``."""
    torch.manual_seed(seed)
    cfg = HeadConfig(hidden_size=hidden_size, latent_dim=latent_dim, mlp_dim=mlp_dim,
                     source_layer=source_layer, target_layer=source_layer + 1,
                     compression_factor=4, **config)
    head = LatentHead(cfg, has_stop_head=True, has_target_proj=True)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(scale)
        head.reasoning_head.stop_head[2].bias.add_(stop_bias)
    return bundle_from_module(head)


# ----------------------------------------------------------------------------- serving

def find_bundle(model_dir, override: str | None = None, disabled: bool = False):
    """The bundle a model directory serves with: ``override``, else ``LATENTSERVE_LATENT_HEAD``,
    else ``config.json``'s ``latent_reasoning_head``, else :data:`HEAD_BUNDLE_NAME`; None when none
    or ``disabled``. FileNotFoundError when ``config.json`` names a missing file."""
    if disabled:
        return None
    given = override or settings.get("LATENTSERVE_LATENT_HEAD")
    if not given:
        return _dir_bundle(Path(model_dir))
    path = Path(given)
    found = _dir_bundle(path) if path.is_dir() else path
    if found is None:
        what = "--latent-head" if override else "LATENTSERVE_LATENT_HEAD"
        raise FileNotFoundError(f"{what} {path} is a directory without a head bundle "
                                "(latent_reasoning_head.safetensors)")
    return found


def _dir_bundle(d: Path) -> Path | None:
    """The bundle of model directory ``d``: the file its ``config.json`` names (missing:
    FileNotFoundError), else ``latent_reasoning_head.safetensors``, else None."""
    cfg = d / "config.json"
    named = json.loads(cfg.read_text()).get("latent_reasoning_head") if cfg.is_file() else None
    if named:  # the directory's config asks for a head: a missing file is an error
        if not isinstance(named, str):
            raise ValueError(f"{cfg}: latent_reasoning_head must be a file name, got {named!r}")
        if not (d / named).is_file():
            raise FileNotFoundError(f"{cfg} names the head bundle {named!r} (key "
                                    f"latent_reasoning_head), but {d / named} does not exist")
        return d / named
    return d / HEAD_BUNDLE_NAME if (d / HEAD_BUNDLE_NAME).is_file() else None


def _span_ids(tok, text: str | None, token: str, what: str) -> tuple[int, ...]:
    if text == "":  # no such span: the prompt ends with the opening already (CoLaR's ###)
        return ()
    if text:
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"head config {what} {text!r} encodes to no tokens")
        return tuple(ids)
    tid = tok.convert_tokens_to_ids(token)
    if tid is None or tid == tok.unk_token_id:
        raise ValueError(f"the tokenizer has no {token!r} token: the head bundle's config must "
                         f"name the thinking span's text ({what})")
    return (int(tid),)


def attach_head(model, model_dir, hf_config, path, device, injection: str | None = None) -> None:
    """Set ``model.latent_head`` (float32 ``LatentHead``), ``latent_head_mode`` and
    ``latent_spec`` (start/end ids: the thinking opening/closing) from the bundle at
    ``path``. Raises ValueError when it does not fit the backbone."""
    bundle = read_bundle(path)
    cfg = bundle.config
    if bundle.decoder is None:
        raise ValueError(f"head bundle {path} has no decoder: it cannot be served")
    if cfg.hidden_size != hf_config.hidden_size:
        raise ValueError(f"head bundle {path} is for hidden_size {cfg.hidden_size}, the model "
                         f"has {hf_config.hidden_size}")
    n_layers = hf_config.num_hidden_layers
    if cfg.source_layer is None or not 0 <= cfg.source_layer < n_layers:
        raise ValueError(f"head bundle {path}: source_layer {cfg.source_layer} is not a layer "
                         f"of this {n_layers}-layer model")
    tok = load_tokenizer(model_dir)
    start = _span_ids(tok, cfg.think_open, "<think>", "think_open")
    end = _span_ids(tok, cfg.think_close, "</think>", "think_close")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.latent_head = bundle.build().to(device)
    model.latent_head_mode = injection or cfg.injection
    model.latent_spec = LatentSpec(kind="head", family="compression-head", default_budget=0,
                                   max_budget=0, start_ids=start, end_ids=end,
                                   latent_id=int(pad or 0), controls=CONTROLS)
