"""Calibration, streamed: run the source model one layer at a time and collect what the factorization needs.

Only the current layer's weights and the calibration activations are in memory: the hidden states
of the calibration windows [B, S, H] (float32) move through the source model layer by layer, and for
each layer we accumulate E[x xᵀ] of the attention input x = γ ⊙ ĥ in float64. Everything the
converter weighs (key/query energies per frequency, K/V output energies) is a quadratic form in
that matrix, so this is all the data it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mlaconv.arch import SourceSpec
from mlaconv.errors import MlaconvError
from mlaconv.families import EMBED, SourceWeights
from mlaconv.io.text import load_dataset_text, read_text, read_token_lines
from mlaconv.io import CheckpointReader
from mlaconv.models import load_tokenizer
from mlaconv.mla import qk_norm
from mlaconv.mla.attention import LayerStats, MLAAttention, SourceAttention
from mlaconv.mla.rope import pair_frequencies
from mlaconv.reference import (Heads, attention_by_distance, mla_attention, mlp_block, query_key, rms_norm,
                               rope_angles, source_attention)


def load_calibration_tokens(source: Path, spec: SourceSpec, files: list[str], dataset: str | None,
                            tokens: int, window: int, seed: int = 0) -> torch.Tensor:
    """[B, S] calibration windows: text (tokenized once with the source tokenizer) or token-id files.

    Text files and a Hugging Face dataset (``NAME[:CONFIG[:SPLIT]]``, train split by default) are
    joined with blank lines and tokenized once; ``.jsonl`` files hold ``{"input_ids": [...]}`` lines.
    Non-overlapping windows of ``window`` tokens are cut, and ``tokens // window`` of them (at least
    one) are drawn with a fixed seed.
    """
    window = min(window, spec.max_position_embeddings)
    if window < 2:
        raise MlaconvError(f"--calib-window must be at least 2, got {window}")
    texts, sequences = [], []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise MlaconvError(f"calibration file not found: {name}")
        if path.suffix == ".jsonl":
            sequences.extend(read_token_lines(path))
        else:
            texts.append(read_text(path))
    if dataset:
        texts.append(load_dataset_text(dataset, default_split="train"))
    if texts:
        tokenizer = load_tokenizer(source)
        if tokenizer is None:
            raise MlaconvError(f"{source} has no tokenizer: give calibration as token ids (--calib FILE.jsonl)")
        sequences.append(torch.tensor(tokenizer("\n\n".join(texts), verbose=False)["input_ids"], dtype=torch.long))
    windows = [seq[k : k + window] for seq in sequences for k in range(0, len(seq) - window + 1, window)]
    if not windows:
        raise MlaconvError(f"the calibration data is shorter than one window of {window} tokens")
    count = max(1, min(len(windows), tokens // window))
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))[:count].sort().values
    ids = torch.stack([windows[k] for k in order.tolist()])
    if ids.max() >= spec.vocab_size:
        raise MlaconvError(f"calibration token ids fall outside the vocabulary (size {spec.vocab_size})")
    return ids


@dataclass
class CalibrationOptions:
    tokens: torch.Tensor  # [B, S] token ids of the calibration windows
    device: str = "cpu"
    batch_size: int = 4
    profile_windows: int = 16  # windows whose attention probabilities give the distance profile μ


class SourceStreamer:
    """Moves calibration windows through the source model, one layer at a time, in float32.

    Use ``stats(i, attention)`` to get layer i's input statistics, then ``advance(i, attention)`` to
    move the hidden states through layer i (its MLP weights are read then and dropped right after).
    """

    def __init__(self, reader: CheckpointReader, spec: SourceSpec, options: CalibrationOptions):
        self.reader, self.spec, self.options = reader, spec, options
        self.device = torch.device(options.device)
        self.heads = Heads(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.weights = SourceWeights(reader, spec)  # the family's tensors in Llama's canonical layout
        embed = self.weights.tensor(None, EMBED)
        self.hidden = embed[options.tokens].to(torch.float32)  # [B, S, H] on CPU
        del embed
        length = options.tokens.shape[1]
        self.freqs = pair_frequencies(spec.rope_frequencies(length), spec.head_dim)  # [d/2], 0 where nothing turns
        self.rotated_angles = rope_angles(self.freqs, length).to(self.device)
        self.still = torch.zeros_like(self.rotated_angles)  # a layer without RoPE
        self.next_layer = 0
        self._held_out: tuple[int, torch.Tensor, torch.Tensor] | None = None  # layer, inputs, source outputs

    @property
    def token_count(self) -> int:
        return self.options.tokens.numel()

    def _angles(self, attention: SourceAttention) -> torch.Tensor:
        return self.rotated_angles if attention.rotated else self.still

    def _batches(self):
        for start in range(0, self.hidden.shape[0], self.options.batch_size):
            yield slice(start, start + self.options.batch_size)

    def stats(self, i: int, attention: SourceAttention) -> LayerStats:
        """Layer i's E[x xᵀ] [H, H] over all calibration tokens and its attention profile μ [N, F]."""
        if i != self.next_layer:
            raise RuntimeError(f"calibration is at layer {self.next_layer}, asked for layer {i}")
        weights = self._on_device(attention)
        H, S = self.spec.hidden_size, self.options.tokens.shape[1]
        moment = torch.zeros(H, H, dtype=torch.float64, device=self.device)
        by_distance = torch.zeros(self.spec.num_heads, S, dtype=torch.float64, device=self.device)
        profiled = 0
        with torch.no_grad():
            for batch in self._batches():
                x = rms_norm(self.hidden[batch].to(self.device), weights.input_norm, self.spec.rms_norm_eps)
                moment += x.flatten(0, 1).T.double() @ x.flatten(0, 1).double()
                if profiled < self.options.profile_windows:
                    by_distance += attention_by_distance(x, weights, self.heads, self._angles(attention)).double()
                    profiled += x.shape[0]
        freqs = self.freqs if attention.rotated else torch.zeros_like(self.freqs)
        phases = torch.exp(-1j * torch.arange(S, dtype=torch.float64)[:, None] * freqs[None, :])  # [S, F]
        rotation_mean = (by_distance.cpu().to(torch.complex128) @ phases) / (profiled * S)
        rotation_mean[:, freqs == 0] = 1  # a pair that never turns keeps its whole alignment
        return LayerStats(metric=(moment / self.token_count).cpu(), rotation_mean=rotation_mean)

    def stand_in(self, i: int, attention: SourceAttention, metric: torch.Tensor) -> SourceAttention:
        """Layer i itself, or for a layer with QK-norm its least-squares linear stand-in (``mla.qk_norm``),
        fitted on the same windows as ``metric`` = E[x xᵀ]."""
        if attention.q_norm is None and attention.k_norm is None:
            return attention
        return qk_norm.stand_in(attention.cast(dtype=torch.float64), metric, self.norm_moments(i, attention))

    def norm_moments(self, i: int, attention: SourceAttention) -> qk_norm.NormMoments:
        """E[q̃ xᵀ] and E[k̃ xᵀ] of layer i's normalised queries and keys (before RoPE) with its input x."""
        if i != self.next_layer:
            raise RuntimeError(f"calibration is at layer {self.next_layer}, asked for layer {i}")
        weights = self._on_device(attention)
        H = self.spec.hidden_size
        query = torch.zeros(weights.q.shape[0], H, dtype=torch.float64, device=self.device)
        key = torch.zeros(weights.k.shape[0], H, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for batch in self._batches():
                x = rms_norm(self.hidden[batch].to(self.device), weights.input_norm, self.spec.rms_norm_eps).float()
                q, k = query_key(x, weights, self.heads)  # [B, heads, S, d]
                x = x.flatten(0, 1).double()
                query += q.transpose(1, 2).flatten(2).flatten(0, 1).T.double() @ x
                key += k.transpose(1, 2).flatten(2).flatten(0, 1).T.double() @ x
        return qk_norm.NormMoments(query=(query / self.token_count).cpu(), key=(key / self.token_count).cpu())

    def attention_error(self, i: int, attention: SourceAttention, converted: MLAAttention, rank: int,
                        rope_dim: int, slot_frequencies: torch.Tensor, residual_scale: float) -> float:
        """‖MLA(x)/α − source(x)‖² / ‖source(x)‖² of layer i's attention output on the held-out windows
        (the first ``profile_windows``, which refinement never trains on).

        α is the residual rescale folded into the converted o_proj.
        """
        if i != self.next_layer:
            raise RuntimeError(f"calibration is at layer {self.next_layer}, asked for layer {i}")
        mla = MLAAttention(**{name: t.to(self.device, torch.float32) if t is not None else None
                              for name, t in vars(converted).items()})
        angles = rope_angles(slot_frequencies, self.options.tokens.shape[1]).to(self.device)
        error = total = 0.0
        inputs, outputs = self._held_out_pairs(i, attention)
        with torch.no_grad():
            for start in range(0, inputs.shape[0], self.options.batch_size):
                batch = slice(start, start + self.options.batch_size)
                x, reference = inputs[batch], outputs[batch]
                approx = mla_attention(x, mla, self.heads, rank, rope_dim, angles) / residual_scale
                error += (approx - reference).double().pow(2).sum().item()
                total += reference.double().pow(2).sum().item()
        return error / total if total > 0 else 0.0

    def _held_out_pairs(self, i: int, attention: SourceAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out windows' normalised inputs and layer i's source attention outputs, [P, S, H] each,
        computed once per layer (for the layer the streamer is at, whose weights ``attention`` must be):
        every variant of the layer, and its refinement, are measured against the same outputs."""
        if self._held_out is None or self._held_out[0] != i:
            self._held_out = None  # drop the previous layer's pairs before computing these
            weights = self._on_device(attention)
            held = self.hidden[: self.options.profile_windows]
            inputs = torch.empty(held.shape, dtype=torch.float32, device=self.device)
            outputs = torch.empty(held.shape, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                for start in range(0, held.shape[0], self.options.batch_size):
                    batch = slice(start, start + self.options.batch_size)
                    inputs[batch] = rms_norm(held[batch].to(self.device), weights.input_norm, self.spec.rms_norm_eps)
                    outputs[batch] = source_attention(inputs[batch], weights, self.heads, self._angles(attention))
            self._held_out = (i, inputs, outputs)
        return self._held_out[1], self._held_out[2]

    def refinement_data(self, i: int, attention: SourceAttention, windows: int):
        """(x, source attention output) pairs [B, S, H] for refining layer i: up to ``windows`` training
        windows after the profiling windows, and the profiling windows themselves held out. None when
        the calibration set has no windows beyond the held-out ones."""
        if i != self.next_layer:
            raise RuntimeError(f"calibration is at layer {self.next_layer}, asked for layer {i}")
        held = min(self.options.profile_windows, self.hidden.shape[0])
        if self.hidden.shape[0] <= held:
            return None
        weights = self._on_device(attention)
        with torch.no_grad():
            x = rms_norm(self.hidden[held : held + windows].to(self.device), weights.input_norm,
                         self.spec.rms_norm_eps).float()
            train = (x, source_attention(x, weights, self.heads, self._angles(attention)))
        return train, self._held_out_pairs(i, attention)

    def _on_device(self, attention: SourceAttention) -> SourceAttention:
        return attention.cast(self.device, torch.float32)

    def advance(self, i: int, attention: SourceAttention) -> None:
        """Move the hidden states through source layer i (attention + MLP): every layer is calibrated on
        the source model's own activations."""
        self._held_out = None
        attention = self._on_device(attention)
        mlp = self.weights.mlp(i, self.device, torch.float32)
        eps = self.spec.rms_norm_eps
        with torch.no_grad():
            for batch in self._batches():
                h = self.hidden[batch].to(self.device)
                x = rms_norm(h, attention.input_norm, eps).to(torch.float32)
                h = h + source_attention(x, attention, self.heads, self._angles(attention))
                h = h + mlp_block(h, mlp, eps)
                self.hidden[batch] = h.cpu()
        self.next_layer = i + 1
