"""Evaluation sets (GSM8K, ProsQA, iCoT multiplication), each a list of :class:`Item`.

Design notes: docs/internals.md, "latentserve.eval.datasets".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from latentserve import settings

# name -> (file under the data root, format, answer kind)
DATASETS = {
    "gsm8k": ("gsm8k/test.jsonl", "jsonl", "number"),
    "gsm8k-icot": ("gsm8k/test_icot.txt", "icot", "number"),
    "prosqa": ("prosqa/test.json", "prosqa", "prosqa"),
    "mult4": ("multiplication/4x4_test.txt", "icot", "digits"),
    "mult5": ("multiplication/5x5_test.txt", "icot", "digits"),
}
# Where each data folder's files come from (unchanged upstream copies, MIT licences).
UPSTREAM = {
    "gsm8k": "github.com/openai/grade-school-math, grade_school_math/data/ (the iCoT-format "
             "files: github.com/da03/Internalize_CoT_Step_by_Step, data/gsm8k/)",
    "prosqa": "github.com/facebookresearch/coconut, data/",
    "multiplication": "github.com/da03/Internalize_CoT_Step_by_Step, data/{4,5}_by_{4,5}_mult/",
}
# What the model is asked to end its answer with, per answer kind (text-CoT prompts).
INSTRUCTIONS = {
    "number": "Solve the problem step by step, then give the final answer as '#### <number>'.",
    "digits": "Multiply step by step. Digits are written least significant first; give the "
              "product the same way as '#### <digits>'.",
    "prosqa": "Reason step by step, then give the answer as '#### <name> is a <concept>.'",
}


@dataclass(frozen=True, slots=True)
class Item:
    """One question: ``question`` (text), ``gold`` (the answer as the set writes it),
    ``kind`` (answer kind for ``answers.score``), ``steps`` (the reference reasoning, may
    be empty)."""

    question: str
    gold: str
    kind: str
    steps: str = ""


DATA_ENV = "LATENTSERVE_DATA"


def package_data_dir() -> Path:
    """The data sets shipped inside the package (``latentserve/data``)."""
    return Path(str(resources.files("latentserve").joinpath("data")))


def data_dirs(data_dir: str | Path | None = None) -> list[Path]:
    """The folders searched for a data file, in order: ``data_dir`` (``--data-dir``), else
    ``$LATENTSERVE_DATA`` when set; then the package's own data. Raises FileNotFoundError
    naming ``--data-dir`` or the variable when the folder given is not one (else a typo
    would read the package's copy without a word)."""
    given = data_dir or settings.get(DATA_ENV)
    if given and not Path(given).is_dir():
        what = "is not a folder" if Path(given).exists() else "does not exist"
        where = f"--data-dir {given}" if data_dir else f"${DATA_ENV} ({given})"
        raise FileNotFoundError(
            f"{where} {what}; give a folder laid out as the package's data "
            f"(gsm8k/test.jsonl, multiplication/4x4_test.txt, ...), or "
            f"{'leave it out' if data_dir else 'unset it'} for the test sets that ship "
            "(docs/training.md, 'Data')")
    return ([Path(given)] if given else []) + [package_data_dir()]


def find_data_file(rel: str, data_dir: str | Path | None = None,
                   flag: str = "--data-dir DIR") -> Path:
    """The file ``rel`` under the first of :func:`data_dirs` that holds it. Raises
    FileNotFoundError naming the folders searched, ``flag`` and the upstream source, or
    (:func:`data_dirs`) a data folder that does not exist."""
    dirs = data_dirs(data_dir)
    for d in dirs:
        if (d / rel).is_file():
            return d / rel
    folder = rel.split("/")[0]
    raise FileNotFoundError(
        f"data file {rel} not found in {', '.join(str(d) for d in dirs)}; pass {flag} or "
        f"set {DATA_ENV} to a directory holding {rel}, from "
        f"{UPSTREAM.get(folder, 'its upstream repository')} (docs/training.md, 'Data')")


def dataset_file(name: str, path: str | Path | None = None,
                 data_dir: str | Path | None = None) -> Path:
    """The file :func:`load_items` reads for data set ``name``: ``path`` when given, else
    the set's file found by :func:`find_data_file`. ValueError for an unknown name,
    FileNotFoundError."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {name!r}")
    return Path(path) if path else find_data_file(DATASETS[name][0], data_dir)


def load_items(name: str, path: str | Path | None = None, limit: int | None = None,
               data_dir: str | Path | None = None) -> list[Item]:
    """Items of data set ``name`` (a key of ``DATASETS``) from ``path`` (default: its file
    found by :func:`find_data_file` under ``data_dir``, ``$LATENTSERVE_DATA`` or the
    package; :func:`dataset_file`); the first ``limit`` only when given. Raises ValueError
    for an unknown name or a malformed file (naming it, and the line where it can),
    FileNotFoundError."""
    p = dataset_file(name, path, data_dir)
    _, fmt, kind = DATASETS[name]
    try:
        return parse_file(p, fmt, kind, limit)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON errors included
        raise ValueError(f"{p} is not a {name} data file ({fmt} format): "
                         f"{type(exc).__name__}: {exc}") from None


def parse_file(p: Path, fmt: str, kind: str, limit: int | None) -> list[Item]:
    """The items of file ``p`` in format ``fmt`` (see :func:`load_items`); ``jsonl``'s steps
    are the GSM8K solution before ``####``. ValueError naming the file and a malformed
    ``jsonl`` or ``icot`` line; FileNotFoundError naming a missing file."""
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} does not exist")
    if fmt == "prosqa":
        return [Item(row["question"], row["answer"], kind, " ".join(row["steps"]))
                for row in json.loads(p.read_text())][:limit]
    items = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if fmt == "jsonl":
            try:
                row = json.loads(line)
                ok = all(isinstance(row.get(k), str) for k in ("question", "answer"))
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                raise ValueError(f"{p}:{n}: not a GSM8K jsonl line (a JSON object with string "
                                 "'question' and 'answer')")
            body, _, gold = row["answer"].rpartition("####")
            items.append(Item(row["question"], gold.strip(), kind, body.strip()))
        else:
            q, sep, rest = line.partition("||")
            steps, sep2, gold = rest.rpartition("####")
            if not sep or not sep2:
                raise ValueError(f"{p}:{n}: expected 'question||steps #### answer'")
            items.append(Item(q.strip(), gold.strip(), kind, steps.strip()))
        if limit is not None and len(items) >= limit:
            break
    return items


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Ids of one chat user turn ``question`` with the assistant turn opened; plain ids
    without a chat template."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tokenizer.encode(question))
