"""Calibration, streamed: run the source model one layer at a time and collect what the factorization needs.

Only the current layer's weights and the calibration activations are in memory: the hidden states
of the calibration windows [B, S, H] (float32) move through the source model layer by layer, and for
each layer we accumulate E[x xᵀ] of the attention input x = γ ⊙ ĥ in float64. Everything the
converter weighs (key/query energies per frequency, K/V output energies) is a quadratic form in
that matrix, so this is all the data it needs.

The windows are split three ways (``calibration.windows.split_windows``; disjoint, recorded in the report by index):
*fit* windows give E[x xᵀ], the attention profile μ, a QK-norm layer's linear stand-in and the refinement's
gradient steps; *select* windows make every choice (each layer's variant, the (r, R) split, the refinement's
best step and whether it is kept); *audit* windows are only measured on: every per-layer figure of the report, and
the whole-model comparison of the converted models with the source (``followed`` models, ``agreement``).

With ``sequential`` the layer being converted is chosen and refined on the inputs that the converted layers before
it produce (a second residual stream of every window, ``student``, moved through the converted attention that each
layer keeps and the source MLP), towards the source's own outputs: "outputs" the source layer's attention output on
the source's inputs, "residual" that plus the difference of the two streams, so that the layer also undoes what the
layers before it lost. The statistics and the closed form stay the source's; the audit figures are still measured
on the source's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mlaconv.calibration.windows import WindowSplit, split_windows
from mlaconv.io import CheckpointReader
from mlaconv.mla import qk_norm
from mlaconv.mla.forward import attention_by_distance, mla_attention, mlp_block, query_key, rms_norm, source_attention
from mlaconv.mla.layer import LayerStats, MLAAttention, SourceAttention
from mlaconv.mla.refine import NormalizedWindows
from mlaconv.mla.rope import pair_frequencies, rope_angles
from mlaconv.progress import Progress, no_progress
from mlaconv.source.names import EMBED, FINAL_NORM, LM_HEAD
from mlaconv.source.spec import SourceSpec
from mlaconv.source.weights import SourceWeights


@dataclass
class CalibrationOptions:
    tokens: torch.Tensor  # [B, S] token ids of the calibration windows
    device: str = "cpu"
    batch_size: int = 4
    profile_windows: int = 16  # fit windows whose attention probabilities give the distance profile μ
    split: WindowSplit | None = None  # None: ``split_windows(B)``
    sequential: str | None = None  # None, or one of SEQUENTIAL: what the refinement fits on the converted inputs


SEQUENTIAL = ("outputs", "residual")


@dataclass(frozen=True)
class MLARun:
    """How a converted layer runs: its latent rank, rope dims, slot frequencies and residual rescale α."""

    rank: int
    rope_dim: int
    slot_frequencies: torch.Tensor
    residual_scale: float


def rotation_mean(by_distance: torch.Tensor, freqs: torch.Tensor, positions: int) -> torch.Tensor:
    """μ[h, j] = E[e^{-iΔω_j}] from head h's attention mass by distance [N, S], summed over ``positions`` query
    positions → [N, F] complex128."""
    phases = torch.exp(-1j * torch.arange(by_distance.shape[1], dtype=torch.float64)[:, None] * freqs[None, :])
    mean = (by_distance.cpu().to(torch.complex128) @ phases) / positions
    mean[:, freqs == 0] = 1  # a pair that never turns keeps its whole alignment
    return mean


class SourceStreamer:
    """Moves calibration windows through the source model, one layer at a time, in float32.

    Use ``stats(i, attention)`` to get layer i's input statistics, then ``advance(i, attention)`` to
    move the hidden states through layer i (its MLP weights are read then and dropped right after).
    Converted models passed to ``advance`` are followed on the audit windows, for ``agreement``.
    """

    def __init__(self, reader: CheckpointReader, spec: SourceSpec, options: CalibrationOptions):
        self.reader, self.spec, self.options = reader, spec, options
        self.device = torch.device(options.device)
        self.heads = spec.attention_shape
        self.split = options.split or split_windows(options.tokens.shape[0])
        self.weights = SourceWeights(reader, spec)  # the family's tensors in Llama's canonical layout
        embed = self.weights.tensor(None, EMBED)
        self.hidden = embed[options.tokens].to(torch.float32)  # [B, S, H] on CPU
        del embed
        length = options.tokens.shape[1]
        self.freqs = pair_frequencies(spec.rope_frequencies(length), spec.head_dim)  # [d/2], 0 where nothing turns
        self.rotated_angles = rope_angles(self.freqs, length).to(self.device)
        self.still = torch.zeros_like(self.rotated_angles)  # a layer without RoPE
        self.next_layer = 0
        self._pairs: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # set → layer, inputs, source outputs
        self._trained: tuple[int, Sequence[int], torch.Tensor] | None = None  # layer, windows, source outputs
        self._audit_metric: tuple[int, torch.Tensor] | None = None
        self._norm_moments: tuple[int, qk_norm.NormMoments] | None = None
        self.followed: dict[str, torch.Tensor] = {}  # converted models' residual streams on the audit windows
        self.student = self.hidden.clone() if options.sequential else None  # [B, S, H]: the kept layers' stream

    @property
    def token_count(self) -> int:
        return self.options.tokens.numel()

    def angles(self, attention: SourceAttention) -> torch.Tensor:
        """The rotation angles [S, F] a layer's source attention turns its pairs by (none without RoPE)."""
        return self.rotated_angles if attention.rotated else self.still

    def audit_rotation_mean(self, i: int, attention: SourceAttention) -> torch.Tensor:
        """μ [N, F] as ``stats`` measures it, on the audit windows' held inputs (every audit figure's)."""
        inputs, _ = self.held_pairs(i, attention, "audit")
        weights = self._on_device(attention)
        by_distance = torch.zeros(self.spec.num_heads, inputs.shape[1], dtype=torch.float64)
        with torch.no_grad():
            for batch in inputs.split(self.options.batch_size):
                by_distance += attention_by_distance(batch, weights, self.heads, self.angles(attention)).double().cpu()
        return rotation_mean(by_distance, self._turning(attention), inputs.shape[0] * inputs.shape[1])

    def _turning(self, attention: SourceAttention) -> torch.Tensor:
        return self.freqs if attention.rotated else torch.zeros_like(self.freqs)

    def _batches(self, windows: Sequence[int]):
        for start in range(0, len(windows), self.options.batch_size):
            yield list(windows[start : start + self.options.batch_size])

    def _check_layer(self, i: int) -> None:
        if i != self.next_layer:
            raise RuntimeError(f"calibration is at layer {self.next_layer}, asked for layer {i}")

    def _normalized(self, windows: Sequence[int], weights: SourceAttention,
                    stream: torch.Tensor | None = None) -> NormalizedWindows:
        stream = self.hidden if stream is None else stream
        return NormalizedWindows(stream, torch.tensor(list(windows)), weights.input_norm, self.spec.rms_norm_eps,
                                 self.device)

    def _fitted(self, windows: Sequence[int], weights: SourceAttention) -> NormalizedWindows:
        """The inputs a layer is chosen and refined on: the converted stream's with ``sequential``, else the source's."""
        return self._normalized(windows, weights, self.student)

    def _targets(self, windows: Sequence[int], x: torch.Tensor, weights: SourceAttention,
                 angles: torch.Tensor) -> torch.Tensor:
        """What a converted layer's output on the ``windows``' fitted inputs ``x`` [b, S, H] should be: the source
        attention's output on x, or with ``sequential`` on the source's own inputs (plus, for "residual", the source
        stream less the converted one)."""
        if self.student is None:
            return source_attention(x, weights, self.heads, angles)
        y = source_attention(self._normalized(windows, weights)[:], weights, self.heads, angles)
        if self.options.sequential == "residual":
            rows = list(windows)
            y += (self.hidden[rows] - self.student[rows]).to(self.device)
        return y

    def stats(self, i: int, attention: SourceAttention) -> LayerStats:
        """Layer i's E[x xᵀ] [H, H] and attention profile μ [N, F], from the fit windows only.

        E[x xᵀ] of the audit windows is accumulated too, for ``audit_metric``; for a layer with QK-norm, so are
        E[q̃ xᵀ] and E[k̃ xᵀ] of its normalised queries and keys on the fit windows, for ``stand_in``.
        """
        self._check_layer(i)
        weights = self._on_device(attention)
        H, S = self.spec.hidden_size, self.options.tokens.shape[1]
        moment = torch.zeros(H, H, dtype=torch.float64, device=self.device)
        x_sum = torch.zeros(H, dtype=torch.float64, device=self.device)
        audit_moment = torch.zeros(H, H, dtype=torch.float64, device=self.device)
        cross = [torch.zeros(w.shape[0], H, dtype=torch.float64, device=self.device)
                 for w in ((weights.q, weights.k) if attention.has_qk_norm else ())]  # E[q̃ xᵀ], E[k̃ xᵀ] sums
        by_distance = torch.zeros(self.spec.num_heads, S, dtype=torch.float64, device=self.device)
        profiled = 0
        with torch.no_grad():
            for windows in self._batches(self.split.fit):
                x = self._normalized(windows, weights)[:]
                flat = x.flatten(0, 1).double()
                moment += flat.T @ flat
                x_sum += flat.sum(0)
                for total, y in zip(cross, query_key(x, weights, self.heads)):  # [B, heads, S, d]; none without norms
                    total += y.transpose(1, 2).flatten(2).flatten(0, 1).T.double() @ flat
                if profiled < self.options.profile_windows:
                    by_distance += attention_by_distance(x, weights, self.heads, self.angles(attention)).double()
                    profiled += len(windows)
            for windows in self._batches(self.split.audit):
                x = self._normalized(windows, weights)[:]
                audit_moment += x.flatten(0, 1).T.double() @ x.flatten(0, 1).double()
        mean = rotation_mean(by_distance, self._turning(attention), profiled * S)
        fit_tokens = len(self.split.fit) * S
        self._audit_metric = (i, (audit_moment / max(1, len(self.split.audit) * S)).cpu())
        self._norm_moments = (i, qk_norm.NormMoments(*(c.cpu() / fit_tokens for c in cross))) if cross else None
        return LayerStats(metric=(moment / fit_tokens).cpu(), rotation_mean=mean, mean=(x_sum / fit_tokens).cpu())

    def audit_metric(self, i: int) -> torch.Tensor:
        """E[x xᵀ] [H, H] float64 of layer i's inputs on the audit windows (after ``stats(i, …)``)."""
        if self._audit_metric is None or self._audit_metric[0] != i:
            raise RuntimeError(f"no audit statistics for layer {i}: call stats({i}, …) first")
        return self._audit_metric[1]

    def stand_in(self, i: int, attention: SourceAttention, stats: LayerStats) -> SourceAttention:
        """Layer i itself, or for a layer with QK-norm the least-squares linear stand-in of its normalised queries
        and keys (``mla.qk_norm``), fitted on the fit windows (after ``stats(i, …)``): what is factored, while
        every measurement and the followed models run the true layer."""
        if not attention.has_qk_norm:
            return attention
        if self._norm_moments is None or self._norm_moments[0] != i:
            raise RuntimeError(f"no QK-norm moments for layer {i}: call stats({i}, …) first")
        return qk_norm.stand_in(attention.cast(dtype=torch.float64), stats.metric, self._norm_moments[1])

    def attention_error(self, i: int, attention: SourceAttention, converted: MLAAttention, rank: int,
                        rope_dim: int, slot_frequencies: torch.Tensor, residual_scale: float,
                        windows: str = "select") -> float:
        """‖MLA(x)/α − source(x)‖² / ‖source(x)‖² of layer i's attention output on the ``windows`` set
        ("select" or "audit"), both on the source's own inputs to the layer (with ``sequential``, on the select
        windows: ‖MLA(x)/α − y‖² / ‖y‖² on the fitted inputs and their targets, ``held_pairs``).

        α is the residual rescale folded into the converted o_proj. The converted layer reads its own
        input γ'⊙ĥ (its input norm γ' is a per-channel multiple of the source's γ, zero where γ is).
        """
        self._check_layer(i)
        run = MLARun(rank, rope_dim, slot_frequencies, residual_scale)
        mla, angles = self._mla_on_device(converted), self._slot_angles(run)
        gamma = attention.input_norm.to(self.device, torch.float32)
        input_ratio = torch.where(gamma != 0, mla.input_norm / gamma, torch.zeros_like(gamma))
        error = total = 0.0
        inputs, outputs = self.held_pairs(i, attention, windows)
        with torch.no_grad():
            for start in range(0, inputs.shape[0], self.options.batch_size):
                batch = slice(start, start + self.options.batch_size)
                reference = outputs[batch]
                approx = self._converted_output(inputs[batch] * input_ratio, mla, run, angles)
                error += (approx - reference).double().pow(2).sum().item()
                total += reference.double().pow(2).sum().item()
        return error / total if total > 0 else 0.0

    def _converted_output(self, x: torch.Tensor, mla: MLAAttention, run: MLARun, angles: torch.Tensor) -> torch.Tensor:
        """A converted layer's attention output on its own normalised inputs x [B, S, H], in source units: every
        converted output this module measures or follows is computed here."""
        return mla_attention(x, mla, self.heads, run.rank, run.rope_dim, angles) / run.residual_scale

    def _mla_on_device(self, converted: MLAAttention) -> MLAAttention:
        return converted.cast(self.device, torch.float32)

    def _slot_angles(self, run: MLARun) -> torch.Tensor:
        return rope_angles(run.slot_frequencies, self.options.tokens.shape[1]).to(self.device)

    def _held_windows(self, windows: str) -> tuple[int, ...]:
        return {"select": self.split.select, "audit": self.split.audit}[windows]

    def held_pairs(self, i: int, attention: SourceAttention, windows: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The select or audit windows' normalised inputs and layer i's source attention outputs (for the select
        windows the fitted inputs and their ``_targets``), [P, S, H] each, computed once per layer (for the layer the
        streamer is at, whose weights ``attention`` must be): every variant of the layer, and its refinement, are
        measured against the same outputs."""
        indices = self._held_windows(windows)
        cached = self._pairs.get(windows)
        if cached is None or cached[0] != i:
            self._pairs.pop(windows, None)  # drop the previous layer's pairs before computing these
            weights = self._on_device(attention)
            shape = (len(indices), *self.hidden.shape[1:])
            inputs = torch.empty(shape, dtype=torch.float32, device=self.device)
            outputs = torch.empty(shape, dtype=torch.float32, device=self.device)
            fitted = self._fitted if windows == "select" else self._normalized  # the audit: the source's inputs
            with torch.no_grad():
                for start in range(0, len(indices), self.options.batch_size):
                    batch = slice(start, start + self.options.batch_size)
                    inputs[batch] = fitted(indices[batch], weights)[:]
                    outputs[batch] = (self._targets(indices[batch], inputs[batch], weights, self.angles(attention))
                                      if windows == "select" else
                                      source_attention(inputs[batch], weights, self.heads, self.angles(attention)))
            self._pairs[windows] = cached = (i, inputs, outputs)
        return cached[1], cached[2]

    def refinement_data(self, i: int, attention: SourceAttention, windows: int):
        """(x, target) pairs [B, S, H] for refining layer i (``_fitted``, ``_targets``): the first ``windows`` fit
        windows to train on (x formed a batch at a time on a CPU, ``NormalizedWindows``), and the select windows to
        choose the best step on."""
        self._check_layer(i)
        weights = self._on_device(attention)
        b, angles = self.options.batch_size, self.angles(attention)
        trained = self.split.fit[:windows]
        x = self._fitted(trained, weights)
        with torch.no_grad():
            if self.device.type != "cpu":  # formed a batch a step, the inputs would cross to the device every step
                x = x[:]
            y = torch.cat([self._targets(trained[start:start + b], x[start:start + b], weights, angles)
                           for start in range(0, x.shape[0], b)])  # a batch at a time: the scores stay small
        if self.student is None:  # ``advance`` adds them instead of computing them again
            self._trained = (i, trained, y)
        return (x, y), self.held_pairs(i, attention, "select")

    def _known_outputs(self, i: int) -> dict[int, torch.Tensor]:
        """Layer i's source attention outputs on the source's inputs [S, H] already computed, by window: the held
        audit pairs, and but for ``sequential`` the select pairs and the refinement's training windows."""
        known: dict[int, torch.Tensor] = {}
        for windows, (layer, _, outputs) in self._pairs.items():
            if layer == i and (windows == "audit" or self.student is None):
                known.update(zip(self._held_windows(windows), outputs))
        if self._trained is not None and self._trained[0] == i:
            known.update(zip(self._trained[1], self._trained[2]))
        return known

    def _on_device(self, attention: SourceAttention) -> SourceAttention:
        return attention.cast(self.device, torch.float32)

    def advance(self, i: int, attention: SourceAttention, converted: dict[str, MLAAttention] | None = None,
                run: MLARun | None = None, kept: MLAAttention | None = None) -> None:
        """Move the hidden states through source layer i (attention + MLP): the statistics are the source model's
        own activations'.

        ``converted`` names layer i of converted models (run as ``run`` says): each one's residual stream on
        the audit windows moves through that attention and the source MLP. A model named for the first time
        starts from the stream of the first one named (at layer 0: from the embeddings). With ``sequential``,
        ``kept`` is the converted layer i that the ``student`` stream moves through.
        """
        if (self.student is None) != (kept is None):
            raise RuntimeError("a sequential calibration advances with the layer it kept, and only it does")
        self._check_layer(i)
        converted = converted or {}
        for name in converted:
            if name not in self.followed:
                if not self.followed and i > 0:
                    raise RuntimeError(f"a converted model must be followed from layer 0, not {i}")
                start = next(iter(self.followed.values())) if self.followed else self.hidden[list(self.split.audit)]
                self.followed[name] = start.clone()
        known = self._known_outputs(i)
        for window, output in known.items():  # added now, so that they are freed before the MLP's weights load
            self.hidden[window] += output.to(self.hidden.device)
        added = set(known)
        del known
        self._pairs.clear()
        self._trained = None
        self._audit_metric = self._norm_moments = None
        attention = self._on_device(attention)
        mlp = self.weights.mlp(i, self.device, torch.float32)
        eps = self.spec.rms_norm_eps
        angles = self._slot_angles(run) if converted or kept is not None else None
        with torch.no_grad():
            for batch in self._batches(range(self.hidden.shape[0])):
                h = self.hidden[batch].to(self.device)
                missing = [k for k, window in enumerate(batch) if window not in added]
                if missing:
                    x = rms_norm(h[missing], attention.input_norm, eps).float()
                    h[missing] += source_attention(x, attention, self.heads, self.angles(attention))
                self.hidden[batch] = (h + mlp_block(h, mlp, eps)).cpu()
            streams = [(self.followed[name], layer) for name, layer in converted.items()]
            for stream, layer in streams + ([(self.student, kept)] if kept is not None else []):
                mla = self._mla_on_device(layer)
                for start in range(0, stream.shape[0], self.options.batch_size):
                    batch = slice(start, start + self.options.batch_size)
                    h = stream[batch].to(self.device)
                    h = h + self._converted_output(rms_norm(h, mla.input_norm, eps).float(), mla, run, angles)
                    stream[batch] = (h + mlp_block(h, mlp, eps)).cpu()
        self.next_layer = i + 1

    def agreement(self, progress: Progress = no_progress, tokens_per_chunk: int = 4096,
                  logits_per_block: int = 2**22) -> dict[str, dict[str, float]]:
        """KL(source ‖ model) per token and top-1 agreement of each followed model against the source on the
        audit windows, after the last layer (final norm, then the head).

        The head is read once and used in blocks of vocabulary rows, in float32; the softmax normalisers and
        KL(p‖q) = E_p[s − m] − log Z_s + log Z_m are accumulated over the blocks, so no [tokens, vocab] matrix
        is ever whole.
        """
        if self.next_layer != self.spec.num_layers:
            raise RuntimeError(f"calibration is at layer {self.next_layer}, not past the last layer")
        eps = self.spec.rms_norm_eps
        norm = self.weights.tensor(None, FINAL_NORM).to(self.device, torch.float32)
        head = self.weights.tensor(None, LM_HEAD)  # [V, H], source dtype, with what the family folds into it
        audit = list(self.split.audit)
        streams = {"source": self.hidden[audit], **self.followed}
        flat = {name: h.flatten(0, 1) for name, h in streams.items()}  # [T, H] views
        total = flat["source"].shape[0]
        kl = {name: 0.0 for name in self.followed}
        agree = {name: 0 for name in self.followed}
        with torch.no_grad():
            chunks = range(0, total, tokens_per_chunk)
            for start in progress(chunks, "whole-model check on the audit windows", len(chunks)):
                rows = {name: rms_norm(h[start : start + tokens_per_chunk].to(self.device), norm, eps).float()
                        for name, h in flat.items()}
                chunk_kl, chunk_agree = _chunk_agreement(rows, head, max(1, logits_per_block // len(rows["source"])))
                for name in self.followed:
                    kl[name] += chunk_kl[name]
                    agree[name] += chunk_agree[name]
        return {name: {"kl": kl[name] / total, "top1": agree[name] / total} for name in self.followed}


def _chunk_agreement(rows: dict[str, torch.Tensor], head: torch.Tensor, block: int):
    """Σ over the tokens of KL(source ‖ model) and of top-1 agreement, for final hidden states [t, H] of the
    source and each model, with the head used ``block`` vocabulary rows at a time."""
    t, device = rows["source"].shape[0], rows["source"].device
    models = [name for name in rows if name != "source"]
    lse = {name: torch.full((t,), -torch.inf, dtype=torch.float64, device=device) for name in rows}  # log Σ exp
    weighted = {name: torch.zeros(t, dtype=torch.float64, device=device) for name in models}  # Σ e^(s − lse_s)(s − m)
    best = {name: torch.full((t,), -torch.inf, dtype=torch.float64, device=device) for name in rows}
    arg = {name: torch.zeros(t, dtype=torch.long, device=device) for name in rows}
    for first in range(0, head.shape[0], block):
        rows_of_head = head[first : first + block].to(device, torch.float32)
        logits = {name: (x @ rows_of_head.T).double() for name, x in rows.items()}  # [t, b]
        for name, z in logits.items():
            top, where = z.max(-1)
            better = top > best[name]
            best[name], arg[name] = torch.where(better, top, best[name]), torch.where(better, where + first, arg[name])
        previous = lse["source"]
        lse["source"] = torch.logaddexp(previous, logits["source"].logsumexp(-1))
        p = (logits["source"] - lse["source"][:, None]).exp()  # the source softmax, up to the blocks still to come
        for name in models:
            weighted[name] = weighted[name] * (previous - lse["source"]).exp() + (p * (logits["source"] - logits[name])).sum(-1)
            lse[name] = torch.logaddexp(lse[name], logits[name].logsumexp(-1))
    kl = {name: (weighted[name] - lse["source"] + lse[name]).sum().item() for name in models}
    agree = {name: (arg[name] == arg["source"]).sum().item() for name in models}
    return kl, agree
