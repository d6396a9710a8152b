"""A healed model blended back towards the model it was healed from: a probe of what keeps the long reach.

Healing trains every layer's ``q_proj``, ``kv_a_proj_with_mqa`` and ``kv_b_proj`` end to end, and on SmolLM2-135M it
buys perplexity at the cost of passkey recall at 4K, which the refined, unhealed model keeps (README). Blending the
two in weight space, W = (1 − w)·W_from + w·W_healed for each trained tensor, every other tensor the unhealed
folder's, asks whether part of healing's gain comes without that cost. Where healing rescaled a layer's tiny latent
(its kv_a rows scaled down, ``kv_a_layernorm`` up by the same factor), the healed rows are first expressed under the
unhealed norm (the same function while the norm is linear), and the blend's latent is re-proved tiny as healing's
own output is (``heal.run``). The folder is scored like a row: ``bench.real.dev NAME``, ``bench.real.retrieval``.

    python -m bench.real.blend full-refine-blend-50 --from full-refine-unhealed-50 --healed full-refine-healed-50 --weight 0.5
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.lib import WORK

REAL = WORK / "real"


def blended_state(start, healed, weight: float, rank: int) -> dict[str, torch.Tensor]:
    """The trained tensors of ``healed`` blended with ``start``'s (two CheckpointReaders), keyed by name."""
    from mlaconv.heal.distill import TRAINED
    from mlaconv.target import deepseek
    from mlaconv.target.deepseek import checkpoint_layers

    state = {}
    for layer in checkpoint_layers(start, json.loads((start.folder / "config.json").read_text())["num_hidden_layers"]):
        for name in TRAINED:
            key = f"{layer.prefix}self_attn.{name}.weight"
            a, b = start.get(key).double(), healed.get(key).double()
            if key == layer.prefix + deepseek.KV_A_PROJ:
                norm_a, norm_b = (r.get(layer.prefix + deepseek.KV_A_NORM).double() for r in (start, healed))
                b[:rank] *= (norm_b / norm_a)[:, None]
            state[key] = ((1 - weight) * a + weight * b).to(start.dtype(key))
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the blended folder, bench/_work/real/NAME")
    parser.add_argument("--from", dest="start", required=True, help="the folder healing started from")
    parser.add_argument("--healed", required=True, help="the healed folder")
    parser.add_argument("--weight", type=float, required=True, help="w: 0 is the unhealed model, 1 the healed one")
    args = parser.parse_args()

    from mlaconv.heal.run import _rewrite, _tiny_latent
    from mlaconv.io import CheckpointReader
    from mlaconv.io.writer import atomic_output_dir
    from mlaconv.mla.latent_norm import DEFAULT_DELTA

    start, out = REAL / args.start, REAL / args.name
    report = json.loads((start / "mlaconv.json").read_text())
    rank, delta = report["kv_lora_rank"], report["latent_norm"]["delta"] or DEFAULT_DELTA
    readers = CheckpointReader(start), CheckpointReader(REAL / args.healed)
    state = blended_state(*readers, args.weight, rank)
    for reader in readers:
        reader.close()
    state, bound, rescaled = _tiny_latent(start, rank, delta, state)
    with atomic_output_dir(out, force=True) as tmp:
        _rewrite(start, tmp, state)
        (tmp / "blend.json").write_text(json.dumps({"from": args.start, "healed": args.healed, "weight": args.weight,
                                                    "latent_bound": bound, "rescaled_layers": rescaled}) + "\n")
    print(f"{out}: {len(state)} tensors blended at w = {args.weight}; latent bound {bound:.3g}, rescaled {rescaled}")


if __name__ == "__main__":
    main()
