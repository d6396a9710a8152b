"""What a linear stand-in of QK-norm costs before any compression: per layer, the share of the normalised
queries' and keys' energy the least-squares stand-in (``mla.qk_norm``, fitted on the calibration's fit
windows) leaves unexplained, the relative attention-output error of the uncompressed stand-in layer against
the true QK-normed layer, and how much the key norm's per-token factor 1/rms varies (std/mean over tokens, per
KV head), all on the select windows (calibration text only, never eval.txt).

It also splits that floor between the query and the key, and measures the one place the DeepSeek-V3 layout
has for a query norm: with ``q_lora_rank`` set, ``q_a_layernorm`` divides the query latent by its own RMS. With
q_a_proj = the source's W_q (all heads stacked, q_lora_rank = N·d) it divides every head by one joint RMS;
q_b_proj is then the least-squares map from that normalised latent to the true normalised queries (fitted on
the fit windows). Columns, each the uncompressed layer's attention-output error against the true layer: the
linear stand-in for both; true query with the linear key; linear query with the true key; the joint-RMS query
with the linear key (what q_a_layernorm could give; the key has no such place: ``kv_a_layernorm`` would divide
the values by the same RMS).

    python -m bench.qk_norm.floor                     # bench/_work/models/qwen3-docs
    python -m bench.qk_norm.floor --model PATH
    python -m bench.qk_norm.floor --write-stand-in OUT   # also write the stand-in model, then:
    mlaconv eval perplexity OUT --baseline bench/_work/models/qwen3-docs --text bench/_work/models/qwen3-docs/eval.txt --window 256

``--write-stand-in`` writes the source with every layer's QK-norm replaced by its linear stand-in and nothing else
changed, as a plain Llama checkpoint (Qwen3 without q/k norms and biases is Llama): its drift on eval.txt is the
stand-in's cost in the whole model, before any compression, computed by transformers' own Llama.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from bench.lib import WORK
from bench.lib.eval import calibration_ids
from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.conversion.pipeline import source_layers
from mlaconv.mla.forward import query_key, rms_norm, source_attention
from mlaconv.mla.qk_norm import linear_fit
from mlaconv.mla.rope import rotate_half_pairs
from mlaconv.source.spec import load_source


def relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).double().pow(2).sum() / exact.double().pow(2).sum()).item()


def attention_from(q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, w, heads, angles: torch.Tensor) -> torch.Tensor:
    """The source layer's attention output with given queries [B, N, S, d] and keys [B, n_kv, S, d] (before RoPE)."""
    B, S, _ = x.shape
    N, G, d = heads.heads, heads.kv_heads, heads.head_dim
    v = F.linear(x, w.v, w.v_bias).view(B, S, G, d).transpose(1, 2).repeat_interleave(N // G, dim=1)
    q, k = rotate_half_pairs(q, angles), rotate_half_pairs(k, angles).repeat_interleave(N // G, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(B, S, N * d), w.o, w.o_bias)


def joint_rms(x: torch.Tensor, w, eps: float) -> torch.Tensor:
    """q_a_layernorm(q_a_proj x) with q_a_proj = W_q (and its bias), unit weight: [B, S, N·d]."""
    z = F.linear(x, w.q, w.q_bias).double()
    return z * z.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()


def joint_rms_query(x_fit: torch.Tensor, x: torch.Tensor, w, heads, eps: float) -> torch.Tensor:
    """Queries [B, N, S, d] from the joint-RMS latent through the least-squares q_b_proj fitted on ``x_fit``."""
    target = query_key(x_fit, w, heads)[0].transpose(1, 2).flatten(2).double()  # [B, S, N·d]
    latent = joint_rms(x_fit, w, eps)
    cross = torch.einsum("bsi,bsj->ij", target, latent)
    gram = torch.einsum("bsi,bsj->ij", latent, latent)
    q_b = linear_fit(cross, gram)  # [N·d, N·d]
    B, S, _ = x.shape
    return (joint_rms(x, w, eps) @ q_b.T).float().view(B, S, heads.heads, heads.head_dim).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=WORK / "models" / "qwen3-docs")
    parser.add_argument("--write-stand-in", type=Path, metavar="OUT", help="also write the stand-in model as Llama")
    args = parser.parse_args()
    stand_ins = {}
    _, spec, reader = load_source(str(args.model))
    streamer = SourceStreamer(reader, spec, CalibrationOptions(calibration_ids(args.model)))
    select, fit = list(streamer.split.select), list(streamer.split.fit)
    print("| layer | q unexplained | k unexplained | attention-output error, uncompressed stand-in | key 1/rms std/mean "
          "| true q, linear k | linear q, true k | joint-RMS q (q_a_layernorm), linear k | joint-RMS q unexplained |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layer in source_layers(reader, spec, streamer):
        i, true = layer.index, layer.attention
        linear = layer.linear.cast(dtype=torch.float32)
        true32 = true.cast(dtype=torch.float32)
        angles = streamer.angles(true)
        with torch.no_grad():
            x = rms_norm(streamer.hidden[select], true32.input_norm, spec.rms_norm_eps).float()
            (q, k), (q_lin, k_lin) = query_key(x, true32, streamer.heads), query_key(x, linear, streamer.heads)
            out = relative(source_attention(x, linear, streamer.heads, angles),
                           source_attention(x, true32, streamer.heads, angles))
            raw = (x @ true32.k.T + (0 if true32.k_bias is None else true32.k_bias)).unflatten(-1, (spec.num_kv_heads, spec.head_dim))  # [B, S, n_kv, d]
            factor = raw.pow(2).mean(-1).add(spec.rms_norm_eps).rsqrt().flatten(0, 1)  # [tokens, n_kv]
            spread = ", ".join(f"{v:.2f}" for v in (factor.std(0) / factor.mean(0)).tolist())
            exact = source_attention(x, true32, streamer.heads, angles)
            x_fit = rms_norm(streamer.hidden[fit], true32.input_norm, spec.rms_norm_eps).float()
            q_joint = joint_rms_query(x_fit, x, true32, streamer.heads, spec.rms_norm_eps)
            splits = [relative(attention_from(a, b, x, true32, streamer.heads, angles), exact)
                      for a, b in ((q, k_lin), (q_lin, k), (q_joint, k_lin))]
        print(f"| {i} | {relative(q_lin, q):.4f} | {relative(k_lin, k):.4f} | {out:.4f} | {spread} | "
              + " | ".join(f"{e:.4f}" for e in splits) + f" | {relative(q_joint, q):.4f} |", flush=True)
        stand_ins[i] = linear
    reader.close()
    if args.write_stand_in:
        write_stand_in(args.model, args.write_stand_in, stand_ins)


def write_stand_in(model: Path, out: Path, stand_ins: dict) -> None:
    """``model`` with each layer's q/k projections replaced by the stand-in's and its q/k norms removed, as Llama."""
    config = json.loads((model / "config.json").read_text())
    for key in ("layer_types", "max_window_layers", "sliding_window", "use_sliding_window"):
        config.pop(key, None)
    config.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False)
    tensors = {name: t for name, t in load_file(model / "model.safetensors").items()
               if not name.endswith(("q_norm.weight", "k_norm.weight"))}
    for i, linear in stand_ins.items():
        for part in ("q", "k"):
            name = f"model.layers.{i}.self_attn.{part}_proj.weight"
            tensors[name] = getattr(linear, part).to(tensors[name].dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / name).exists():
            shutil.copy(model / name, out / name)


if __name__ == "__main__":
    main()
