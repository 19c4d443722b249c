"""Stage 0 of CoLaR: a reasoning backbone (``latentserve train cot``).

Design notes: docs/internals.md, "latentserve.train.cot".
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from latentserve.eval.datasets import Item, parse_file
from latentserve.latent import colar
from latentserve.models.checkpoint import EMBEDDED_BASE_NAMES, load_tokenizer, resolve_model_dir
from latentserve.train.options import CotConfig, check_out, fresh_lora
from latentserve.train.tasks import gsm8k_train_items

# chat_template.jinja of a trained directory: the last user message as the prompt the model
# was trained on (chat routes and LLM.chat send a question, not chat turns); those of the
# shipped models/smollm2-mult-cot and models/smollm2-mult-colar.
_LAST_USER = ("{%- set ns = namespace(q='') -%}\n{%- for m in messages -%}{%- if m['role'] == "
              "'user' -%}{%- set ns.q = m['content'] -%}{%- endif -%}{%- endfor -%}\n")
CHAT_TEMPLATES = {
    "cot": "{#- CoLaR's prompt (latent/colar.py) for the last user message: the model was "
           "trained on it, not on chat turns. -#}\n" + _LAST_USER
           + colar.prompt_text("{{ ns.q }}") + "\n",
    "colar": "{#- CoLaR's question part (latent/colar.py QUESTION) for the last user message; "
             "the engine appends the thinking speed and the separator. -#}\n" + _LAST_USER
             + colar.QUESTION.format("{{ ns.q }}") + "\n",
}
CHAT_TEMPLATE = "chat_template.jinja"


def read_items(path: str | Path) -> list[Item]:
    """Items of a GSM8K ``.jsonl`` or iCoT text file. FileNotFoundError, ValueError."""
    p = Path(path)
    return gsm8k_train_items(p) if p.suffix == ".jsonl" else parse_file(p, "icot", "text", None)


def encode_parts(tok, items: list[Item], mode: str = "cot"
                 ) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt_ids, steps_ids, answer_ids)`` per item, each segment tokenised on its own:
    the prompt at speed 1, the steps (empty for ``mode="nocot"``), ``### Answer:{gold} EOS``."""
    sep = tok.convert_tokens_to_ids(colar.SEPARATOR)

    def enc(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    prompts = colar.prompt_ids(tok, [it.question for it in items], separator=False)
    steps = enc([it.steps for it in items]) if mode == "cot" else [[] for _ in items]
    answers = enc([colar.ANSWER.format(it.gold) for it in items])
    return [(p, s, [sep, *a, tok.eos_token_id]) for p, s, a in zip(prompts, steps, answers)]


def encode_examples(tok, items: list[Item], mode: str = "cot"
                    ) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, target_ids)`` per item, tokenised in batches."""
    sep = tok.convert_tokens_to_ids(colar.SEPARATOR)
    return [(p, [sep, *s, *a]) for p, s, a in encode_parts(tok, items, mode)]


def load_backbone(base: str | None, device: str, cfg=None):
    """``(model, tokenizer, base_name)``: ``base``'s float32 HF causal LM on ``device``, in
    PEFT LoRA when ``options.fresh_lora(cfg)`` or ``cfg.init_adapter``; ``cfg.init_adapter`` with
    ``cfg.lora_r == 0``: that adapter merged into the weights, all of them trained."""
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(base)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    base_name = EMBEDDED_BASE_NAMES[0] if base is None else str(Path(base).resolve())
    if cfg is not None and cfg.init_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.init_adapter, is_trainable=True)
        if cfg.lora_r == 0:  # a full fine-tune from the adapted model
            model = model.merge_and_unload()
            model.requires_grad_(True)
    elif cfg is not None and (lora := fresh_lora(cfg)) is not None:
        from peft import LoraConfig, get_peft_model

        r, alpha, targets = lora
        model = get_peft_model(model, LoraConfig(
            r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
            bias="none", task_type="CAUSAL_LM"))
    return model, tok, base_name


@contextlib.contextmanager
def trainer_forward(device: str, autocast: bool = True):
    """On CUDA bfloat16 autocast and SDPA without cuDNN (NaN ``grad_q`` with a mask,
    pytorch/pytorch#196678); a no-op on CPU."""
    if not device.startswith("cuda"):
        yield
        return
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast), sdpa_kernel(backends):
        yield


def _lm(model):
    """The ``*ForCausalLM`` inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def right_pad(rows: list[list[int]], value: int = 0, device=None) -> torch.Tensor:
    """``[len(rows), longest] int64`` on ``device``: each row, then ``value`` to the end."""
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=device)


@torch.no_grad()
def greedy_accuracy(model, tok, items: list[Item], device: str, max_new_tokens: int = 256,
                    batch_size: int = 256) -> dict:
    """Greedy text-CoT ``{n, accuracy, thinking_median}`` of ``model`` on ``items`` through HF
    ``generate`` (thinking: tokens before the closing separator)."""
    model.eval()
    tok.padding_side = "left"
    sep = tok.convert_tokens_to_ids(colar.SEPARATOR)
    right, thinking = 0, []
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        enc = tok.pad({"input_ids": colar.prompt_ids(tok, [it.question for it in chunk])},
                      return_tensors="pt").to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device.startswith("cuda")):
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        for it, row in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist()):
            thinking.append(row.index(sep) if sep in row else len(row))
            _, answer = colar.split_output(tok.decode(row, skip_special_tokens=True))
            right += answer == it.gold
    model.train()
    return {"n": len(items), "accuracy": right / max(1, len(items)),
            "thinking_median": statistics.median_high(thinking) if thinking else 0}


def refuse_non_finite(tensors: dict[str, torch.Tensor], out) -> None:
    """FloatingPointError naming the first floating tensor of ``tensors`` holding NaN or inf:
    ``out`` is not written with a diverged model."""
    bad = next((k for k, v in tensors.items()
                if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise FloatingPointError(f"not writing {out}: weight {bad!r} holds NaN or inf (training "
                                 "diverged; a lower --lr?)")


def save(model, base_name: str, cfg, log: list[dict],
         adapter_dtype: torch.dtype = torch.bfloat16, colar_files=None, tok=None) -> None:
    """Write the PEFT adapter (in ``adapter_dtype``) or the full model, ``train_config.json``,
    ``train_log.json`` and :data:`CHAT_TEMPLATES` ``["cot"]`` as ``chat_template.jinja`` to
    directory ``cfg.out``; with ``colar_files`` (``(ColarConfig, LatentPolicy)``) also
    ``latent.colar.save_colar``'s files and the ``"colar"`` template. FloatingPointError
    (nothing written) when a weight is NaN or inf."""
    from safetensors.torch import save_file

    out = Path(cfg.out)
    peft = hasattr(model, "peft_config")
    if peft:
        from peft import get_peft_model_state_dict

        sd = {k: v.detach().to(adapter_dtype).cpu().contiguous()
              for k, v in get_peft_model_state_dict(model).items()}
    else:
        sd = model.state_dict()
    policy = {} if colar_files is None else {
        f"latent_policy.{k}": v for k, v in colar_files[1].state_dict().items()}
    refuse_non_finite(sd | policy, out)
    out.mkdir(parents=True, exist_ok=True)
    if peft:
        pc = model.peft_config["default"]
        pc.base_model_name_or_path = base_name
        pc.save_pretrained(str(out))
        save_file(sd, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    else:  # a whole model: its tokenizer beside it, so the directory serves alone
        model.save_pretrained(str(out), safe_serialization=True)
        if tok is not None:
            tok.save_pretrained(str(out))
    (out / CHAT_TEMPLATE).write_text(CHAT_TEMPLATES["cot" if colar_files is None else "colar"])
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1))
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    if colar_files is not None:
        colar.save_colar(out, *colar_files)


def batches(n: int, batch_size: int, rng: random.Random | None = None):
    """Endless batches of ``batch_size`` indices into ``n``, without replacement per pass
    (``rng``, default the global ``random``)."""
    rng = rng or random
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            order += rng.sample(range(n), n)
        yield [order.pop() for _ in range(batch_size)]


class DivergenceWatch:
    """The first step whose loss was NaN or inf, kept on the loss's device (no sync a step);
    :meth:`check` (one sync) raises FloatingPointError naming it and ``lr``."""

    def __init__(self, lr: float):
        self.lr, self.first = lr, None

    def see(self, step: int, loss: torch.Tensor) -> None:
        if self.first is None:
            self.first = torch.full((), -1, dtype=torch.long, device=loss.device)
        bad = (self.first < 0) & ~torch.isfinite(loss.detach())
        self.first = torch.where(bad, step, self.first)

    def check(self) -> None:
        step = -1 if self.first is None else int(self.first)
        if step >= 0:
            raise FloatingPointError(f"the training loss is NaN or inf at step {step}: training "
                                     f"diverged (a lower --lr than {self.lr:g}?); stopped "
                                     "without saving")


def optimise(cfg, params: list[torch.Tensor], step_loss, checkpoint, progress=print
             ) -> list[dict]:
    """The loop of ``train cot`` and ``train colar`` (AdamW, clip 1.0, warmup then cosine to 0
    by ``cfg.steps`` or ``cfg.max_seconds``) over ``step_loss() -> (loss, extra)``;
    ``checkpoint(log)`` every ``cfg.save_every``. Returns the log records (``lr``: the rate
    the step used). FloatingPointError (:class:`DivergenceWatch`, checked before each log
    record and checkpoint) once a loss is NaN or inf."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                            betas=(0.9, 0.999), fused=cfg.device.startswith("cuda"))
    watch = DivergenceWatch(cfg.lr)
    log: list[dict] = []
    start = time.time()

    def lr_factor(s: int) -> float:  # warmup, then cosine to 0 by the step or time limit
        done = s / cfg.steps
        if cfg.max_seconds:
            done = max(done, (time.time() - start) / cfg.max_seconds)
        return min(1.0, (s + 1) / max(1, cfg.warmup)) * 0.5 * (1 + math.cos(math.pi * min(
            1.0, done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    for step in range(1, cfg.steps + 1):
        with trainer_forward(cfg.device):
            loss, extra = step_loss()
        watch.see(step, loss)
        lr = sched.get_last_lr()[0]  # this step's; sched.step() sets the next one's
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        timed_out = cfg.max_seconds and time.time() - start > cfg.max_seconds
        logged = step % cfg.log_every == 0 or step == 1 or step == cfg.steps or timed_out
        saving = cfg.save_every and step % cfg.save_every == 0
        if logged or saving:  # the last step is always logged: the log ends checked
            watch.check()
        if logged:
            rec = {"step": step, "loss": round(loss.item(), 5),
                   **{k: round(v.item(), 5) if torch.is_tensor(v) else v
                      for k, v in extra.items()},
                   "lr": lr, "seconds": round(time.time() - start, 1)}
            log.append(rec)
            progress(json.dumps(rec))
        if saving:
            checkpoint(log)
        if timed_out:
            progress(f"stopping at step {step}: max_seconds {cfg.max_seconds} reached")
            break
    return log


def train(cfg: CotConfig, progress=print) -> dict:
    """Run stage 0; returns the last log record. ValueError when no example fits or ``cfg.out``
    cannot be a model directory (checked first), FileNotFoundError for missing data,
    FloatingPointError when the loss turns NaN or inf (nothing saved then)."""
    check_out(cfg.out, "a model directory", True, progress)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    items = [it for p in cfg.data for it in read_items(p)]
    evals = [it for p in cfg.eval_data for it in read_items(p)[:cfg.eval_items]]
    model, tok, base_name = load_backbone(cfg.base, cfg.device, cfg)
    examples = [e for e in encode_examples(tok, items, cfg.mode)
                if len(e[0]) + len(e[1]) <= cfg.max_len]
    if not examples:
        raise ValueError(f"no training example fits max_len={cfg.max_len}")
    params = [p for p in model.parameters() if p.requires_grad]
    progress(f"train cot: {len(examples)} examples, {sum(p.numel() for p in params)} "
             f"trainable parameters, {cfg.steps} steps of {cfg.batch_size}")
    model.train()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    order = batches(len(examples), cfg.batch_size)
    lm = _lm(model)

    def step_loss() -> tuple[torch.Tensor, dict]:  # mean CE of the right-padded targets
        batch = [examples[i] for i in next(order)]
        ids = right_pad([p + t for p, t in batch], pad, cfg.device)
        target = right_pad([[-100] * len(p) + t for p, t in batch], -100, cfg.device)[:, 1:]
        hidden = lm.model(input_ids=ids).last_hidden_state[:, :-1]
        keep = target != -100
        return F.cross_entropy(lm.lm_head(hidden[keep]).float(), target[keep]), {}

    log = optimise(cfg, params, step_loss, lambda log: save(model, base_name, cfg, log, tok=tok),
                   progress)
    if evals:
        rec = dict(log[-1], eval=greedy_accuracy(model, tok, evals, cfg.device))
        log.append(rec)
        progress(json.dumps(rec))
    save(model, base_name, cfg, log, tok=tok)
    return log[-1]
