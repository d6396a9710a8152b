"""Controls for drift by position (issue 32): the source changed in ways whose loss does, or by construction
does not, depend on distance, into bench/_work/real/control-NAME and bench/results/real-control-NAME.json.

- ``mlp-noise``: every MLP weight (gate, up, down) of every layer plus seeded Gaussian noise of σ times the
  tensor's own standard deviation; attention is untouched, so the loss is the same kind at every position. σ is
  chosen so that the whole model's KL to the source on a development text matches ``--match-kl`` (a conversion's
  KL there), by a secant on log KL against log σ.
- ``window-N``: the source's own weights served with an N-token sliding window (a Mistral config, which
  transformers masks natively): nothing more than N positions back. It drops the first tokens too, which the
  model leans on as attention sinks, so it measures that breakage more than distance (bench/real/README.md).

Then measure each folder as a converted model is measured:

    python -m bench.real.controls mlp-noise --match-kl 0.087 --text bench/real/data/pride_and_prejudice.txt
    python -m bench.real.controls mlp-noise --match-kl 0.17 --text bench/real/data/pride_and_prejudice.txt \\
        --name mlp-noise-0.17
    python -m bench.real.controls window-512
    python -m bench.real.positions bench/_work/real/control-mlp-noise --name control-mlp-noise --text WIKITEXT
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the mlaconv command sets it: waiting threads sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lib.results import commit, load_span, machine, write_json  # noqa: E402
from bench.real.build import DEFAULT_OUT as SOURCE  # noqa: E402
from bench.real.dev import MAX_WINDOWS, WINDOW  # noqa: E402
from mlaconv.evaluate.perplexity import evaluate_perplexity  # noqa: E402
from mlaconv.io.models import load_causal_lm  # noqa: E402
from mlaconv.io.text import TokenSource  # noqa: E402

WORK = Path(__file__).resolve().parent.parent / "_work" / "real"
MLP = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def with_mlp_noise(out: Path, sigma: float, seed: int = 0) -> Path:
    """The source with every MLP weight W replaced by W + sigma · std(W) · Z, Z seeded per tensor."""
    model = load_causal_lm(SOURCE, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in MLP:
                weight = getattr(layer.mlp, name).weight
                noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
                weight.add_(noise, alpha=sigma * weight.std().item())
    return _save(model, out)


def with_sliding_window(out: Path, window: int) -> Path:
    """The source's weights as a Mistral model whose attention sees only the last ``window`` positions."""
    from transformers import MistralConfig, MistralForCausalLM

    source = load_causal_lm(SOURCE, torch.float32)
    fields = source.config.to_dict()
    for key in ("architectures", "model_type", "attention_bias", "mlp_bias", "pretraining_tp", "transformers_version",
                "_model_name_or_path"):
        fields.pop(key, None)
    config = MistralConfig(**fields, sliding_window=window)
    model = MistralForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise SystemExit(f"the Mistral layout differs: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return _save(model, out)


def _save(model, out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (SOURCE / name).is_file():
            shutil.copy2(SOURCE / name, out / name)
    return out


def kl_on(folder: Path, text: Path, windows: int) -> float:
    report = evaluate_perplexity(folder, SOURCE, source=TokenSource(text=text), window=WINDOW, max_windows=windows)
    return report.kl_per_token


def match_noise(out: Path, target: float, text: Path, windows: int, tolerance: float) -> tuple[float, float, list]:
    """σ whose model has KL ``target`` (within ``tolerance``, relative) on ``text``: a secant on log KL, log σ."""
    tried: list[tuple[float, float]] = []
    sigma = 0.05
    for _ in range(8):
        kl = kl_on(with_mlp_noise(out, sigma), text, windows)
        tried.append((sigma, kl))
        print(f"σ {sigma:.5f}: KL {kl:.4f}", flush=True)
        if abs(kl / target - 1) <= tolerance:
            return sigma, kl, tried
        if len(tried) < 2:
            slope = 2.0  # KL grows about as σ² for small noise
        else:
            (s0, k0), (s1, k1) = tried[-2], tried[-1]
            slope = (math.log(k1) - math.log(k0)) / (math.log(s1) - math.log(s0)) if s1 != s0 else 2.0
            slope = min(max(slope, 0.5), 4.0)
        sigma = math.exp(math.log(sigma) + (math.log(target) - math.log(kl)) / slope)
    raise SystemExit(f"no σ within {tolerance:.0%} of KL {target} in 8 tries: {tried}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("control", help="mlp-noise or window-N (e.g. window-512)")
    parser.add_argument("--match-kl", type=float, default=None, help="mlp-noise: the KL to match on --text")
    parser.add_argument("--text", type=Path, default=None, help="mlp-noise: the development text the KL is matched on")
    parser.add_argument("--windows", type=int, default=MAX_WINDOWS,
                        help="windows of --text the KL is measured on (as bench.real.dev scores it)")
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--name", default=None, help="the folder is control-NAME, the result real-control-NAME.json "
                                                     "(default: the control)")
    args = parser.parse_args()

    name = args.name or args.control
    out = WORK / f"control-{name}"
    result = {"bench": "real", "control": args.control, "folder": str(out.relative_to(WORK.parent.parent.parent))}
    if args.control == "mlp-noise":
        if args.match_kl is None or args.text is None:
            raise SystemExit("mlp-noise needs --match-kl and --text (a development text)")
        sigma, kl, tried = match_noise(out, args.match_kl, args.text, args.windows, args.tolerance)
        result.update(sigma=sigma, kl=kl, match_kl=args.match_kl, text=args.text.name, windows=args.windows,
                      tried=[{"sigma": s, "kl": k} for s, k in tried])
    elif args.control.startswith("window-") and args.control.removeprefix("window-").isdigit():
        result["sliding_window"] = int(args.control.removeprefix("window-"))
        with_sliding_window(out, result["sliding_window"])
    else:
        raise SystemExit(f"unknown control {args.control!r}: mlp-noise or window-N")
    result.update(commit=commit(), machine=machine(), load=load_span(),
                  command=" ".join(["python -m bench.real.controls", *sys.argv[1:]]))
    print(write_json(f"real-control-{name}", result))


if __name__ == "__main__":
    main()
