"""Writing a converted checkpoint: the DeepSeek-V3 tensors in the order the layer pass produces them.

The head, the embedding and the final norm come first, then each layer's attention and its source MLP. A layer
converted two ways (closed form and refined) is held on disk (``PendingTensors``) until the whole-model check
chooses; memory holds one layer's tensors at a time. What a family folds into a tensor comes from
``SourceWeights``; α is the residual rescale (``conversion.plan.residual_scale``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mlaconv.io.pending import PendingTensors
from mlaconv.io.reader import CheckpointReader
from mlaconv.io.writer import ShardedWriter
from mlaconv.mla.layer import MLAAttention
from mlaconv.source import names
from mlaconv.source.spec import SourceSpec
from mlaconv.source.weights import SourceWeights
from mlaconv.target import deepseek

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
)


class LayerWriter:
    """The output's tensors, written as they come: ``outer()``, then ``layer(i, models)`` for every layer in order,
    then ``choose(name)`` when a layer was held with more than one model."""

    def __init__(self, writer: ShardedWriter, reader: CheckpointReader, spec: SourceSpec, alpha: float,
                 dtype: torch.dtype, biases: bool, pending: Path):
        self.writer, self.weights, self.alpha, self.dtype, self.biases = writer, SourceWeights(reader, spec), alpha, dtype, biases
        self.pending = PendingTensors(pending)

    def outer(self) -> None:
        """The head, the embedding (scaled by α) and the final norm, one at a time."""
        self._source(names.LM_HEAD, None, names.LM_HEAD)
        self._source(names.EMBED, None, names.EMBED, self.alpha)
        self._source(names.FINAL_NORM, None, names.FINAL_NORM)

    def layer(self, i: int, models: dict[str, MLAAttention]) -> None:
        """Layer i: its attention (α already in o_proj), written now if there is one model, else held until
        ``choose``; then the source MLP (down_proj scaled by α) and post-attention norm, one tensor at a time."""
        tensors = {name: self._attention(mla) for name, mla in models.items()}
        if len(tensors) == 1:
            self._add(i, next(iter(tensors.values())))
        else:
            self.pending.put(i, tensors)
        del tensors
        p = names.layer_prefix(i)
        for name in (names.GATE, names.UP):
            self._source(p + name, i, name)
        self.weights.release()
        self._source(p + names.DOWN, i, names.DOWN, self.alpha)
        self._source(p + names.POST_ATTENTION_NORM, i, names.POST_ATTENTION_NORM)

    def choose(self, name: str) -> None:
        """Write model ``name``'s version of every held layer."""
        for i in list(self.pending.keys):
            self._add(i, self.pending.take(i, name))

    def _source(self, name: str, i: int | None, key: str, alpha: float = 1.0) -> None:
        """A source tensor (layer ``i``'s ``key``) as ``name``, scaled by ``alpha``: its bytes copied unread when
        they are the output's (``SourceWeights.stored``), else read, scaled and cast."""
        if alpha != 1.0:
            self.writer.add(name, scaled(self.weights.tensor(i, key), alpha, self.dtype))
        elif (stored := self.weights.stored(i, key, self.dtype)) is not None:
            self.writer.copy(name, stored)
        else:
            self.writer.add(name, self.weights.tensor(i, key).to(self.dtype))

    def _attention(self, mla: MLAAttention) -> dict[str, torch.Tensor]:
        return {name: t.to(self.dtype) for name, t in deepseek.attention_tensors(mla, self.biases).items()}

    def _add(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.writer.add(names.layer_prefix(i) + name, tensor)


def scaled(matrix: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """matrix·α in ``dtype``, scaled in place in the wider of the two dtypes: no float64 copy of a large matrix
    (the multiply runs in float32 at least, within one unit in the last place of the exact product)."""
    return matrix.to(torch.promote_types(matrix.dtype, dtype)).mul_(alpha).to(dtype)


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer and generation files the source has; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(name)
    return copied
