"""The tokenizer of a checkpoint folder as llama.cpp's GGUF vocabulary keys.

Three cases, tried in this order:

- ``tokenizer.json`` with a byte-level BPE model (GPT-2 style: Llama 3, Qwen2): tokenizer model
  ``gpt2`` plus the name of llama.cpp's pre-tokenizer, recognised from the split regex in the file
  (llama.cpp hard-codes one regex per name; an unknown regex is refused rather than guessed).
- ``tokenizer.model`` (SentencePiece: Llama 2, Mistral): tokenizer model ``llama`` with the pieces,
  scores and piece types read from the protobuf directly (no ``sentencepiece`` dependency).
- no tokenizer at all: tokenizer model ``none`` with the vocabulary size, llama.cpp's no-vocab
  mode (token ids in, logits out).

Special token ids, ``add_bos``/``add_eos`` and the chat template come from gguf-py's ``SpecialVocab``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from mlaconv.errors import MlaconvError

# The split regexes of the Hugging Face tokenizer files, and the llama.cpp pre-tokenizer that
# implements each (llama-vocab.cpp, llm_tokenizer_bpe).
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    _LETTERS + r"\p{N}{1,3}" + _TAIL: "llama-bpe",  # Llama 3.x
    _LETTERS + r"\p{N}" + _TAIL: "qwen2",  # Qwen2 / Qwen2.5
}
GPT2_PRE = "gpt-2"  # a lone ByteLevel pre-tokenizer with its built-in (GPT-2) regex


@dataclass
class Vocabulary:
    """What goes under ``tokenizer.ggml.*``: the model kind, its tokens, and the special-token settings."""

    model: str  # "gpt2", "llama" or "none"
    size: int
    pre: str | None = None
    tokens: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    add_space_prefix: bool | None = None
    remove_extra_whitespaces: bool | None = None
    special: gguf.SpecialVocab | None = None

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        if self.model == "none":
            return
        if self.pre:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.remove_extra_whitespaces is not None:
            writer.add_remove_extra_whitespaces(self.remove_extra_whitespaces)
        if self.special is not None:
            self.special.add_to_gguf(writer, quiet=True)

    def summary(self) -> dict:
        return {"model": self.model, "pre": self.pre, "tokens": self.size if self.model == "none" else len(self.tokens)}


def read_vocabulary(folder: Path, vocab_size: int, use_tokenizer: bool = True) -> Vocabulary:
    """The GGUF vocabulary of ``folder``, padded to ``vocab_size`` (the embedding's rows) with unused tokens."""
    if not use_tokenizer:
        return Vocabulary("none", vocab_size)
    tokenizer_json = folder / "tokenizer.json"
    spec = _load_json(tokenizer_json) if tokenizer_json.is_file() else None
    if spec is not None and _is_byte_level_bpe(spec):
        return _bpe_vocabulary(folder, spec, vocab_size)
    if (folder / "tokenizer.model").is_file():
        return _sentencepiece_vocabulary(folder, vocab_size)
    if spec is not None:
        kind = (spec.get("model") or {}).get("type")
        raise MlaconvError(
            f"{tokenizer_json} is a {kind} tokenizer that llama.cpp cannot take as it is (only byte-level BPE "
            "tokenizer.json files, or a SentencePiece tokenizer.model, are exported); copy the source's "
            "tokenizer.model into the folder, or pass --no-tokenizer for a token-id-only GGUF"
        )
    return Vocabulary("none", vocab_size)


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MlaconvError(f"{path} is not readable JSON: {exc}") from None


def _is_byte_level_bpe(spec: dict) -> bool:
    model = spec.get("model") or {}
    decoder = spec.get("decoder") or {}
    return model.get("type") == "BPE" and not model.get("byte_fallback", False) and decoder.get("type") == "ByteLevel"


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE ``tokenizer.json``."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = [s for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not splits and len(byte_level) == 1 and byte_level[0].get("use_regex", True):
        return GPT2_PRE
    if len(splits) == 1 and len(byte_level) == 1 and not byte_level[0].get("use_regex", True):
        regex = (splits[0].get("pattern") or {}).get("Regex")
        if regex in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[regex]
    raise MlaconvError(
        "the tokenizer's pre-tokenizer is not one llama.cpp implements under a known name (recognised: Llama 3 "
        "'llama-bpe', Qwen2 'qwen2', GPT-2 'gpt-2'); pass --no-tokenizer for a token-id-only GGUF"
    )


def _bpe_vocabulary(folder: Path, spec: dict, vocab_size: int) -> Vocabulary:
    pre = pre_tokenizer_name(spec)
    by_id: dict[int, tuple[str, int]] = {}
    for text, token_id in spec["model"]["vocab"].items():
        by_id[int(token_id)] = (text, gguf.TokenType.NORMAL)
    for added in spec.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    tokens, types = _dense(by_id, vocab_size, folder / "tokenizer.json")
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise MlaconvError(f"{folder / 'tokenizer.json'} has no BPE merges")
    return Vocabulary("gpt2", vocab_size, pre=pre, tokens=tokens, types=types, special=special)


def _dense(by_id: dict[int, tuple[str, int]], vocab_size: int, source: Path) -> tuple[list[str], list[int]]:
    """Token texts and types for ids 0..vocab_size-1; ids the tokenizer lacks become unused padding."""
    if by_id and max(by_id) >= vocab_size:
        raise MlaconvError(f"{source} has token id {max(by_id)}, beyond the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        text, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(text)
        types.append(int(kind))
    return tokens, types


def _sentencepiece_vocabulary(folder: Path, vocab_size: int) -> Vocabulary:
    path = folder / "tokenizer.model"
    pieces, add_dummy_prefix, remove_extra_whitespaces = read_sentencepiece_model(path.read_bytes(), path)
    by_id = {i: (text, kind) for i, (text, _, kind) in enumerate(pieces)}
    added = folder / "added_tokens.json"
    if added.is_file():
        for text, token_id in _load_json(added).items():
            if int(token_id) >= len(pieces):
                by_id[int(token_id)] = (text, gguf.TokenType.USER_DEFINED)
    tokens, types = _dense(by_id, vocab_size, path)
    scores = [pieces[i][1] if i < len(pieces) else -1000.0 for i in range(vocab_size)]
    special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=vocab_size)
    return Vocabulary("llama", vocab_size, tokens=tokens, scores=scores, types=types, add_space_prefix=add_dummy_prefix,
                      remove_extra_whitespaces=remove_extra_whitespaces, special=special)


# SentencePiece's ModelProto (sentencepiece_model.proto): pieces = 1 (piece = 1, score = 2, type = 3),
# normalizer_spec = 3 (add_dummy_prefix = 3, remove_extra_whitespaces = 4; both default true).
# Piece types 1..6 (normal, unknown, control, user-defined, unused, byte) are gguf's TokenType values.
def read_sentencepiece_model(data: bytes, path: Path) -> tuple[list[tuple[str, float, int]], bool, bool]:
    """(pieces as (text, score, type), add_dummy_prefix, remove_extra_whitespaces) of a tokenizer.model."""
    pieces: list[tuple[str, float, int]] = []
    add_dummy_prefix, remove_extra_whitespaces = True, True
    try:
        for number, value in _fields(data):
            if number == 1:
                text, score, kind = "", 0.0, 1
                for sub, sub_value in _fields(value):
                    if sub == 1:
                        text = sub_value.decode("utf-8")
                    elif sub == 2:
                        score = struct.unpack("<f", sub_value)[0]
                    elif sub == 3:
                        kind = sub_value
                if not 1 <= kind <= 6:
                    raise ValueError(f"piece type {kind}")
                pieces.append((text, score, kind))
            elif number == 3:
                for sub, sub_value in _fields(value):
                    if sub == 3:
                        add_dummy_prefix = bool(sub_value)
                    elif sub == 4:
                        remove_extra_whitespaces = bool(sub_value)
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as exc:
        raise MlaconvError(f"{path} is not a SentencePiece model ({exc})") from None
    if not pieces:
        raise MlaconvError(f"{path} is not a SentencePiece model (it has no pieces)")
    return pieces, add_dummy_prefix, remove_extra_whitespaces


def _fields(data: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated")
        yield number, value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
