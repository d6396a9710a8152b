"""Where a conversion loses, layer by layer: the source model with one converted layer swapped in at a time.

Each converted layer runs inside the otherwise exact source (transformers' own decoder layers of both models; the
converted model's residual stream is the source's times α, ``residual_scale``), and the whole model's KL to the
source is measured on windows of a text; then every layer converted at once. Rows go to
``bench/results/real-loss-at-depth-NAME.json``.

    python -m bench.real.loss_at_depth bench/_work/real/closed-50 --name closed-50 --text bench/real/data/pride_and_prejudice.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.lib.results import commit, machine
from bench.real.build import DEFAULT_OUT as SOURCE

RESULTS = Path(__file__).resolve().parents[1] / "results"


class Swapped:
    """The source with some decoder layers replaced by the converted model's."""

    def __init__(self, source, converted):
        self.source, self.converted = source, converted
        self.alpha = (converted.model.embed_tokens.weight.norm() / source.model.embed_tokens.weight.norm()).item()

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, swapped: set[int]) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])[None]
        h = self.source.model.embed_tokens(ids)
        source_angles = self.source.model.rotary_emb(h, position_ids=positions)
        converted_angles = self.converted.model.rotary_emb(h, position_ids=positions)
        for i, layer in enumerate(self.source.model.layers):
            if i in swapped:
                h = self.converted.model.layers[i](h * self.alpha, attention_mask=None, position_ids=positions,
                                                   position_embeddings=converted_angles) / self.alpha
            else:
                h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=source_angles)
        return self.source.lm_head(self.source.model.norm(h))


def text_windows(source: Path, text: Path, windows: int, window: int) -> torch.Tensor:
    """The first ``windows`` windows of ``window`` tokens of ``text`` in the source's tokenizer → [windows, window]."""
    from mlaconv.io.models import load_tokenizer

    ids = load_tokenizer(source)(text.read_text(encoding="utf-8"), verbose=False)["input_ids"]
    return torch.tensor(ids[: windows * window]).view(windows, window)


def kl_top1(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    p, q = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item(), (p.argmax(-1) == q.argmax(-1)).double().mean().item()


def main() -> None:
    from mlaconv.io.models import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    ids = text_windows(SOURCE, args.text, args.windows, args.window)
    source, converted = load_causal_lm(SOURCE), load_causal_lm(args.converted)
    swapped = Swapped(source, converted)
    with torch.inference_mode():
        reference = torch.cat([source(w[None], use_cache=False).logits for w in ids])
        layers = len(source.model.layers)

        def measured(chosen: set[int]) -> tuple[float, float]:
            return kl_top1(reference, torch.cat([swapped.logits(w[None], chosen) for w in ids]))

        rows = [{"layer": i, "kl": kl, "top1": top1} for i in range(layers) for kl, top1 in [measured({i})]]
        every_kl, every_top1 = measured(set(range(layers)))
    result = {"bench": "real-loss-at-depth", "name": args.name, "converted": str(args.converted),
              "text": args.text.name, "windows": args.windows, "window": args.window, "commit": commit(),
              "machine": machine(), "rows": rows, "all_layers": {"kl": every_kl, "top1": every_top1},
              "sum_of_single_layer_kl": sum(r["kl"] for r in rows)}
    path = RESULTS / f"real-loss-at-depth-{args.name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(path, json.dumps(result["all_layers"]), result["sum_of_single_layer_kl"])


if __name__ == "__main__":
    main()
