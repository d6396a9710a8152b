"""Build the bundled example ``examples/llama-docs`` from the trained bench model.

    python -m bench.models.train llama && python -m bench.models.make_example

The weights of ``bench/_work/models/llama-docs`` are stored in bfloat16 (9 MB instead of 19), with its
tokenizer and ``train.json``. Its two short texts come from the bench's *calibration* part, never
from its evaluation part (``eval.txt``, on which the bench's figures, and so mlaconv's defaults, were
chosen): the part's documents (docstrings; 77% of the part's tokens are one file, pandas/core/generic.py,
so whole units would not make two texts) in a fixed pseudo-random order, sha256("example:UNIT:INDEX"),
first into ``eval.txt`` until it holds ``WINDOWS`` windows of ``WINDOW`` tokens, then into ``calib.txt``
likewise, leaving out every document that shares a 13-word shingle with ``eval.txt``
(``bench/models/overlap.py``). ``texts.json`` lists the documents of each text.
Finally both weights (float32, bfloat16) are scored on ``eval.txt`` as mlaconv tokenizes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from bench.lib import REPO as ROOT
from bench.models.docs_corpus import build_corpus, corpus_units, join, split_of
from bench.models.overlap import SHINGLE, drop_overlapping, shared_shingles
from bench.models.train import WORK, perplexity, windows

WINDOW = 256
WINDOWS = 64  # per text
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def text_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` as mlaconv reads a text file (tokenized once, default special tokens)."""
    return len(tokenizer(text, verbose=False)["input_ids"])


def pick_texts(tokenizer) -> tuple[dict[str, str], dict]:
    """eval.txt and calib.txt from the calibration part's documents (see the module docstring)."""
    docs = [(unit, k, doc) for unit, unit_docs in corpus_units().items() if split_of(unit) == "calib"
            for k, doc in enumerate(unit_docs)]
    order = iter(sorted(docs, key=lambda d: hashlib.sha256(f"example:{d[0]}:{d[1]}".encode()).hexdigest()))
    picked: dict[str, list[tuple[str, int, str]]] = {"eval": [], "calib": []}
    dropped = 0
    for name in ("eval", "calib"):
        while text_tokens(tokenizer, join([doc for *_, doc in picked[name]])) < WINDOWS * WINDOW:
            picked[name].append(next(order))  # StopIteration: the part is too small for two such texts
            if name == "calib":  # drop what shares a run with eval.txt, also across the new boundary
                evaluation = join([doc for *_, doc in picked["eval"]])
                _, out = drop_overlapping([doc for *_, doc in picked["calib"]], evaluation)
                picked["calib"] = [d for k, d in enumerate(picked["calib"]) if k not in out]
                dropped += len(out)
    joined = {name: join([doc for *_, doc in chosen]) for name, chosen in picked.items()}
    assert not shared_shingles(joined["calib"], joined["eval"])
    record = {
        name: {"documents": [f"{unit}#{k}" for unit, k, _ in picked[name]], "chars": len(joined[name]),
               "tokens": text_tokens(tokenizer, joined[name]),
               "windows": text_tokens(tokenizer, joined[name]) // WINDOW,
               "sha256": hashlib.sha256(joined[name].encode()).hexdigest()}
        for name in ("calib", "eval")
    }
    record["rule"] = (f"documents of the bench's calib part (unit#index: the index-th docstring of that file) in "
                      f"sha256('example:unit:index') order: eval.txt until {WINDOWS} windows of {WINDOW} tokens, "
                      f"then calib.txt likewise, skipping what shares a {SHINGLE}-word shingle with eval.txt "
                      f"(bench/models/overlap.py; {dropped} documents skipped)")
    return joined, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=WORK / "models" / "llama-docs")
    parser.add_argument("--out", type=Path, default=ROOT / "examples" / "llama-docs")
    args = parser.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(2)
    trained = json.loads((args.source / "train.json").read_text())
    _, manifest = build_corpus()
    if manifest["parts"]["calib"]["sha256"] != trained["corpus"]["parts"]["calib"]["sha256"]:
        sys.exit(f"error: the corpus rebuilt here is not the one {args.source} was trained on")
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    texts, record = pick_texts(tokenizer)

    args.out.mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    model.to(torch.bfloat16).save_pretrained(args.out)
    for name in (*TOKENIZER_FILES, "train.json"):
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    for name, text in texts.items():
        (args.out / f"{name}.txt").write_text(text, encoding="utf-8")
    config = json.loads((args.out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4.x has no TokenizersBackend
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    ids = windows(torch.tensor(tokenizer(texts["eval"], verbose=False)["input_ids"]), WINDOW)
    model = LlamaForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    shipped = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    record["eval_ppl"] = {"float32 (trained)": perplexity(model, ids), "bfloat16 (shipped)": perplexity(shipped, ids)}
    (args.out / "texts.json").write_text(json.dumps(record, indent=2) + "\n")
    size = sum(path.stat().st_size for path in args.out.iterdir()) / 1e6
    print(json.dumps({name: {k: v for k, v in part.items() if k != "documents"} if isinstance(part, dict) else part
                      for name, part in record.items()}, indent=2))
    print(f"{args.out}: {size:.1f} MB")


if __name__ == "__main__":
    main()
