"""A dense DeepSeek-V3 decoder that keeps only the latent cache: r + R values per token and layer.

Per layer (as in DeepSeek-V3 dense layers): h ← h + attention(RMSNorm(h)), h ← h + MLP(RMSNorm(h)),
with the SwiGLU MLP down(silu(gate x) ⊙ up x); then the final RMSNorm and lm_head. Attention is the
absorbed form (``mlaconv.target.absorb``); everything else is read from the standard checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mlaconv.errors import MlaconvError
from mlaconv.io import CheckpointReader, read_config
from mlaconv.mla.forward import rms_norm
from mlaconv.mla.layer import MLAShape
from mlaconv.mla.rope import rope_cos_sin
from mlaconv.runtime.attention import absorbed_attention, latent_rows
from mlaconv.source import names
from mlaconv.target.absorb import (ABSORBED_DIR, MANIFEST, AbsorbedAttention, RopeSpec, check_config, checked_absorb,
                                   read_absorbed_layer, read_absorbed_manifest)
from mlaconv.target.deepseek import checkpoint_layers


class LatentCache:
    """The whole decode state: one row [ĉ | rotated k^R] of r + R values per token, per layer."""

    def __init__(self, layers: int, batch: int, max_tokens: int, row_width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.rows = torch.zeros(layers, batch, max_tokens, row_width, dtype=dtype, device=device)
        self.length = 0  # tokens cached so far

    @property
    def elements_per_token_per_layer(self) -> int:
        return self.rows.shape[-1]

    @property
    def max_tokens(self) -> int:
        return self.rows.shape[2]

    def write(self, layer: int, new_rows: torch.Tensor) -> torch.Tensor:
        """Store new_rows [B, S, r+R] after the cached tokens; return the layer's rows so far [B, length+S, r+R]."""
        end = self.length + new_rows.shape[1]
        self.rows[layer, :, self.length:end] = new_rows
        return self.rows[layer, :, :end]

    def advance(self, tokens: int) -> None:
        self.length += tokens


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [H]
    attention: AbsorbedAttention
    post_attention_norm: torch.Tensor  # [H]
    gate: torch.Tensor  # [F, H]
    up: torch.Tensor  # [F, H]
    down: torch.Tensor  # [H, F]


class LatentDecoder:
    """Runs a converted checkpoint with a latent cache; ``forward`` takes token ids and returns logits."""

    def __init__(self, shape: MLAShape, rope_spec: RopeSpec, eps: float, embed: torch.Tensor,
                 layers: list[DecoderLayer], final_norm: torch.Tensor, lm_head: torch.Tensor):
        self.shape = shape
        self.rope = rope_spec
        self.eps = eps
        self.embed = embed  # [vocab, H]
        self.layers = layers
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head  # [vocab, H]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def load(cls, folder: str | Path, absorbed: str | Path | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> "LatentDecoder":
        """Load a converted DeepSeek-V3 checkpoint with its absorbed attention weights.

        ``absorbed``: a folder written by ``write_absorbed``; by default ``folder/absorbed`` when it exists,
        otherwise the weights are absorbed in memory (same checks as the writer).
        """
        folder = Path(folder)
        config = read_config(folder)
        check_config(config)
        layers_total = int(config["num_hidden_layers"])
        if int(config.get("first_k_dense_replace", 0)) < layers_total:
            raise MlaconvError("the reference decoder runs dense layers only (first_k_dense_replace < num_hidden_layers)")
        if config.get("hidden_act", "silu") != "silu":
            raise MlaconvError(f"hidden_act {config['hidden_act']!r}: the DeepSeek-V3 dense MLP is SwiGLU (silu)")
        shape = MLAShape.from_config(config)
        absorbed_folder = Path(absorbed) if absorbed is not None else folder / ABSORBED_DIR
        if absorbed is None and not (absorbed_folder / MANIFEST).is_file():
            absorbed_folder = None
        absorbed_reader = None
        if absorbed_folder is not None:
            manifest = read_absorbed_manifest(absorbed_folder)
            expected = {"hidden_size": shape.hidden, "num_heads": shape.heads, "kv_lora_rank": shape.rank,
                        "qk_rope_head_dim": shape.rope_dim}
            if any(manifest["shapes"][k] != v for k, v in expected.items()) or manifest["num_layers"] != layers_total:
                raise MlaconvError(f"{absorbed_folder} does not belong to {folder}: its shapes differ from the config")
            absorbed_reader = CheckpointReader(absorbed_folder)

        reader = CheckpointReader(folder)

        def get(name: str) -> torch.Tensor:
            return reader.get(name).to(device=device, dtype=dtype)

        layers = []
        for layer in checkpoint_layers(reader, layers_total):
            if absorbed_reader is not None:
                attention = read_absorbed_layer(absorbed_reader, layer.index)
            else:
                attention, _ = checked_absorb(layer.read_attention(), shape, layer.index)
            p = layer.prefix
            layers.append(DecoderLayer(
                input_norm=get(p + "input_layernorm.weight"), attention=attention.to(dtype, device),
                post_attention_norm=get(p + "post_attention_layernorm.weight"),
                gate=get(p + "mlp.gate_proj.weight"), up=get(p + "mlp.up_proj.weight"),
                down=get(p + "mlp.down_proj.weight"),
            ))
        model = cls(shape, RopeSpec.from_config(config), float(config["rms_norm_eps"]), get(names.EMBED), layers,
                    get(names.FINAL_NORM), get(names.LM_HEAD))
        reader.close()
        if absorbed_reader is not None:
            absorbed_reader.close()
        return model

    def new_cache(self, batch: int, max_tokens: int) -> LatentCache:
        return LatentCache(len(self.layers), batch, max_tokens, self.shape.cache_elements, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: LatentCache) -> torch.Tensor:
        """Logits [B, S, vocab] for tokens [B, S] that follow the ``cache.length`` tokens already cached."""
        B, S = tokens.shape
        if cache.length + S > cache.max_tokens:
            raise MlaconvError(f"the cache holds {cache.max_tokens} tokens; {cache.length + S} needed")
        positions = torch.arange(cache.length, cache.length + S, device=self.device)
        cos, sin = rope_cos_sin(positions, self.rope.inv_freq, self.dtype)  # [S, R/2]
        h = F.embedding(tokens, self.embed)  # [B, S, H]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, self.eps, in_dtype=True)
            rows = cache.write(i, latent_rows(layer.attention, x, cos, sin, self.shape.rank))  # [B, T, r+R]
            h = h + absorbed_attention(layer.attention, x, rows, cos, sin, self.shape)
            x = rms_norm(h, layer.post_attention_norm, self.eps, in_dtype=True)
            h = h + F.linear(F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up), layer.down)
        cache.advance(S)
        return F.linear(rms_norm(h, self.final_norm, self.eps, in_dtype=True), self.lm_head)
