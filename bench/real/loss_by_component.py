"""Where a conversion loses, by component: every layer's attention with only its scores, or only its values, converted.

Each decoder layer of the source recomputes its attention from the same input twice, once through the source's own
attention module and once through the converted model's (transformers' modules of both; the converted residual stream
is the source's times α, ``Swapped.alpha``), and keeps from each what the mode says:

- ``exact``: the source's attention weights and values (a check of the harness: KL 0);
- ``scores``: the converted attention weights over the source's values (what the query/key side loses: the shared
  RoPE key, the mean rotation in the NoPE query, the latent's key part);
- ``values``: the source's attention weights over the converted values (what the latent's value part loses);
- ``converted``: both converted (every layer swapped in, as ``loss_at_depth``'s last row).

The whole model's KL to the source is measured per position bucket of long windows, so a loss that grows with
distance shows where it comes from. Rows (one per model and mode; a rerun of a name replaces its rows) go to
``bench/results/real-loss-by-component.json``.

    python -m bench.real.loss_by_component bench/_work/real/unhealed-50 --name unhealed-50 \\
        --text bench/real/data/pride_and_prejudice.txt
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the mlaconv command sets it: waiting threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.models.llama.modeling_llama import repeat_kv  # noqa: E402

from bench.lib.results import RESULTS, commit, write_result  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE  # noqa: E402
from bench.real.loss_at_depth import Swapped, text_windows  # noqa: E402

MODES = ("exact", "scores", "values", "converted")
BUCKETS = (0, 512, 2048)
CAPTURE = "mlaconv_bench_capture"


def _capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal softmax attention that keeps its weights [B, N, T, T] and values [B, N, T, dv] on the module."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = (query @ key.transpose(-1, -2)) * scaling
    T = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    module.captured = scores.softmax(-1, dtype=torch.float32).to(value.dtype), value
    return (module.captured[0] @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(CAPTURE, _capture)


def _heads_out(attn, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """o_proj(weights @ values) for weights [B, N, T, T], values [B, N, T, dv] → [B, T, H]."""
    mixed = (weights @ values).transpose(1, 2)
    return attn.o_proj(mixed.reshape(*mixed.shape[:2], -1))


class Components(Swapped):
    """The source whose every layer's attention takes its weights and values from the source or the conversion."""

    def __init__(self, source, converted):
        super().__init__(source, converted)
        for model in (source, converted):
            model.set_attn_implementation(CAPTURE)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, mode: str) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])[None]
        h = self.source.model.embed_tokens(ids)
        source_angles = self.source.model.rotary_emb(h, position_ids=positions)
        converted_angles = self.converted.model.rotary_emb(h, position_ids=positions)
        for src, conv in zip(self.source.model.layers, self.converted.model.layers):
            src.self_attn(src.input_layernorm(h), position_embeddings=source_angles, attention_mask=None)
            conv.self_attn(conv.input_layernorm(h * self.alpha), position_embeddings=converted_angles,
                           attention_mask=None)
            (w_src, v_src), (w_conv, v_conv) = (attn.__dict__.pop("captured")  # held one layer at a time
                                                for attn in (src.self_attn, conv.self_attn))
            if mode == "exact":
                out = _heads_out(src.self_attn, w_src, v_src)
            elif mode == "scores":
                out = _heads_out(src.self_attn, w_conv, v_src)
            elif mode == "values":
                out = _heads_out(conv.self_attn, w_src, v_conv) / self.alpha
            else:
                out = _heads_out(conv.self_attn, w_conv, v_conv) / self.alpha
            h = h + out
            h = h + src.mlp(src.post_attention_layernorm(h))
        return self.source.lm_head(self.source.model.norm(h))


def token_kl_top1(reference: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(reference ‖ other) and whether the top-1 tokens agree, [T] each."""
    p, q = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1), (p.argmax(-1) == q.argmax(-1)).double()


def bucket_means(values: torch.Tensor) -> dict[str, float]:
    """Mean of [windows, T] per bucket of positions [0, 512), [512, 2048), [2048, T), and over all."""
    T = values.shape[-1]
    edges = [b for b in BUCKETS if b < T] + [T]
    means = {f"{a}-{b}": values[:, a:b].mean().item() for a, b in zip(edges, edges[1:])}
    return {"all": values.mean().item(), **means}


def main() -> None:
    from mlaconv.io.models import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--source", type=Path, default=SOURCE)
    args = parser.parse_args()
    ids = text_windows(args.source, args.text, args.windows, args.window)
    source = load_causal_lm(args.source)
    with torch.inference_mode():  # transformers' own attention, before the harness replaces it
        reference = [source(w[None], use_cache=False).logits[0] for w in ids]
    components = Components(source, load_causal_lm(args.converted))
    rows, command = [], " ".join(["python -m bench.real.loss_by_component", *sys.argv[1:]])
    for mode in MODES:
        kl, top1 = zip(*(token_kl_top1(ref, components.logits(w[None], mode)[0]) for ref, w in zip(reference, ids)))
        kl, top1 = bucket_means(torch.stack(kl)), bucket_means(torch.stack(top1))
        rows.append({"run": args.name, "mode": mode, "text": args.text.name, "kl": kl, "top1": top1,
                     "commit": commit(), "command": command})
        print(args.name, mode, json.dumps(kl), flush=True)
    path = RESULTS / "real-loss-by-component.json"
    kept = [r for r in json.loads(path.read_text())["rows"] if r["run"] != args.name] if path.exists() else []
    columns = [["run", "{run}"], ["text", "{text}"], ["mode", "{mode}"], ["KL", "{kl[all]:.3f}"],
               ["KL 0–512", "{kl[0-512]:.3f}"], ["KL 512–2K", "{kl[512-2048]:.3f}"],
               ["KL 2K–4K", "{kl[2048-4096]:.3f}"], ["top-1", "{top1[all]:.1%}"]]
    print(write_result("real-loss-by-component", "real", kept + rows, columns, title=(
        f"SmolLM2-135M conversions: the whole model's KL to the source with every layer's attention weights, "
        f"values or both converted ({args.windows} windows of {args.window:,} tokens)")))


if __name__ == "__main__":
    main()
