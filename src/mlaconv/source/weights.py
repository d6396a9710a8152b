"""A source checkpoint's tensors in the canonical (Llama) layout, whatever its family: ``SourceWeights`` reads one
group at a time through the family's hooks (``families``), and ``canonical_rope`` puts partial rotary and LongRoPE's
attention factor into that layout.
"""

from __future__ import annotations

import torch

from mlaconv.io.reader import StoredTensor
from mlaconv.mla import qk_norm
from mlaconv.mla.forward import MLPWeights
from mlaconv.mla.layer import SourceAttention
from mlaconv.source.names import (B, DOWN, EMBED, GATE, INPUT_NORM, K, K_NORM, LM_HEAD, O, POST_ATTENTION_NORM, Q,
                                  Q_NORM, UP, V, W, layer_name)
from mlaconv.source.spec import SourceSpec


class SourceWeights:
    """The canonical (Llama-layout) tensors of a source checkpoint, read one group at a time.

    The last fused tensor read is kept until the group is read (Phi-3's q, k and v come from one
    ``qkv_proj``); every other tensor is read when asked for and owned by the caller.
    """

    def __init__(self, reader, spec: SourceSpec):
        self.reader, self.spec, self.family = reader, spec, spec.family
        self._fused: tuple[str, torch.Tensor] | None = None

    def _get(self, name: str, keep: bool = False) -> torch.Tensor:
        if not keep:
            return self.reader.get(name)  # the reader refuses NaN and Inf
        if self._fused is None or self._fused[0] != name:
            self._fused = None
            self._fused = (name, self.reader.get(name))
        return self._fused[1]

    def tensor(self, i: int | None, key: str) -> torch.Tensor:
        """One canonical tensor: layer ``i``'s ``key`` (top level when None), read and folded."""
        return self.family.modify(self.spec, key, self.family.read(self._get, self.spec, i, self._source_key(i, key)))

    def stored(self, i: int | None, key: str, dtype: torch.dtype) -> StoredTensor | None:
        """Where the canonical tensor lies as it is, in ``dtype``, in the checkpoint, checked
        (``CheckpointReader.stored``), for copying its bytes unread; None when the family slices or folds it, it is
        in another dtype, or the checkpoint is a pickle."""
        name = self.family.stored_name(self.spec, i, self._source_key(i, key))
        if name is None or self.family.factor(self.spec, key) != 1.0 or self.reader.dtype(name) != dtype:
            return None
        return self.reader.stored(name)

    def _source_key(self, i: int | None, key: str) -> str:
        """Tied weights: the head is the raw embedding."""
        return EMBED if i is None and key == LM_HEAD and LM_HEAD not in self.reader else key

    def release(self) -> None:
        self._fused = None

    def attention(self, i: int) -> SourceAttention:
        """Layer i's attention in the canonical layout (see ``canonical_rope``), its input norm γ included."""
        s = self.spec

        def bias(key: str, present: bool) -> torch.Tensor | None:
            return self.tensor(i, key) if present and layer_name(i, key) in self.reader else None

        norms = self.family.qk_norm  # the query's RoPE factor then goes after the norm, on its weight
        q, q_bias = canonical_rope(s, self.tensor(i, Q + W), bias(Q + B, s.qkv_bias), query=not norms)
        k, k_bias = canonical_rope(s, self.tensor(i, K + W), bias(K + B, s.qkv_bias), query=False)
        q_norm = k_norm = None
        if norms:  # one head's weight [d], reordered like the head's rows
            q_norm = canonical_rope(s, self.tensor(i, Q_NORM)[:, None], None, query=True)[0][:, 0]
            k_norm = canonical_rope(s, self.tensor(i, K_NORM)[:, None], None, query=False)[0][:, 0]
        attention = SourceAttention(
            q=q, k=k, v=self.tensor(i, V + W), o=self.tensor(i, O + W), input_norm=self.tensor(i, INPUT_NORM),
            q_bias=q_bias, k_bias=k_bias, v_bias=bias(V + B, s.qkv_bias), o_bias=bias(O + B, s.o_bias),
            rotated=s.rope_layers[i], q_norm=q_norm, k_norm=k_norm, qk_norm_eps=s.rms_norm_eps,
        )
        self.release()
        return attention

    def key(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's canonical key projection and input norm γ (what the rope stride is chosen from); with QK-norm,
        its weights-only linear stand-in."""
        k, _ = canonical_rope(self.spec, self.tensor(i, K + W), None, query=False)
        gamma = self.tensor(i, INPUT_NORM)
        if self.family.qk_norm:
            norm = canonical_rope(self.spec, self.tensor(i, K_NORM)[:, None], None, query=False)[0][:, 0]
            k = qk_norm.weights_only_keys(k, norm, gamma)
        self.release()
        return k, gamma

    def mlp(self, i: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MLPWeights:
        """Layer i's MLP and its pre-norm, each tensor moved to ``device``/``dtype`` as it is read."""
        def get(key: str) -> torch.Tensor:
            return self.tensor(i, key).to(device=device, dtype=dtype)

        weights = MLPWeights(gate=get(GATE), up=get(UP), down=get(DOWN), post_attention_norm=get(POST_ATTENTION_NORM))
        self.release()
        return weights


def canonical_rope(spec: SourceSpec, w: torch.Tensor, bias: torch.Tensor | None,
                   query: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Query or key rows [heads·d, H] in rotate-half pairs over the whole head, with their bias.

    Partial rotary (the first d_rot dims rotate, pairs (j, j + d_rot/2); the rest pass) becomes pairs
    (j, j + d/2) over the whole head whose last (d − d_rot)/2 pairs have frequency 0: the rows are
    reordered per head, identically for q and k, so q·k is unchanged. The query's rotated rows carry the
    RoPE attention factor squared (LongRoPE scales cos and sin, hence both q and k, on rotated dims only).
    """
    d, rot = spec.head_dim, spec.rotary_dim
    factor = spec.rope_attention_factor**2 if query else 1.0
    if rot == d and factor == 1.0:
        return w, bias
    half, passing = rot // 2, (d - rot) // 2
    order = torch.cat([torch.arange(half), rot + torch.arange(passing), half + torch.arange(half),
                       rot + passing + torch.arange(passing)])
    scale = torch.ones(d)
    scale[:half] = scale[d // 2 : d // 2 + half] = factor  # the rotated pairs, after the reordering

    def reorder(t: torch.Tensor) -> torch.Tensor:
        heads = t.shape[0] // d
        t = t.reshape(heads, d, *t.shape[1:])[:, order]
        if factor != 1.0:
            t = t.to(torch.promote_types(t.dtype, torch.float32)) * scale.view(d, *[1] * (t.dim() - 2))
        return t.reshape(heads * d, *t.shape[2:])

    return reorder(w), None if bias is None else reorder(bias)
