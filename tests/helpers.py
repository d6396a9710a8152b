"""What the tests share that is not a fixture (those are in conftest.py): the repository's paths, tiny models built
from transformers' own classes, token files, logits and errors against a source, the CLI, the checks of a refused
conversion, and the ``inspect spectra`` report's documented schema. Test files import it as ``helpers``."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "examples" / "stories260K"
CONFIGS = ROOT / "tests" / "data" / "configs"  # real models' config.json files
REPORT_DOC = ROOT / "docs" / "report.md"
HEADING = re.compile(r"^#+ `([\w.\[\]]+)`\s*$")  # a report section in REPORT_DOC
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|")  # one of its keys
PASSKEY_VOCAB = 192  # the passkey tokenizer's vocabulary


# --- models, tokens, logits ---------------------------------------------------------------------------------------


def make_model(path: Path, family: str = "llama", *, heads: int = 4, kv_heads: int = 2, hidden: int = 64,
               head_dim: int | None = None, layers: int = 2, eps: float = 1e-6, vocab: int = 96,
               seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 0.2, **extra) -> Path:
    """Save a random model of the given family (weights ~ N(0, scale), norms around 1) to ``path``."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim or hidden // heads, rms_norm_eps=eps, max_position_embeddings=256,
                        **{"tie_word_embeddings": False, **extra})
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, scale)
    model.to(dtype).save_pretrained(path)
    return path


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_tokens(rows: int, length: int, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    """[rows, length] token ids drawn uniformly below ``vocab`` (96: ``make_model``'s default) with ``seed``."""
    return torch.randint(0, vocab, (rows, length), generator=generator(seed))


def write_tokens(path: Path, tokens: torch.Tensor) -> Path:
    """Token ids [rows, length] as a JSON-lines file of ``input_ids`` (what --calib and --eval-tokens read)."""
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in tokens.tolist()))
    return path


def logits(folder: Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The model's logits on ``tokens`` through ``AutoModelForCausalLM``, in float64."""
    from mlaconv.io.models import load_causal_lm

    with torch.no_grad():
        return load_causal_lm(folder, dtype)(tokens).logits.double()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by name."""
    from safetensors.torch import load_file

    return {name: t for shard in sorted(folder.glob("*.safetensors")) for name, t in load_file(shard).items()}


def spec_for(name: str):
    """The ``SourceSpec`` of a real model's config.json (``CONFIGS``)."""
    from mlaconv.source.spec import SourceSpec

    return SourceSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def open_source(folder: Path):
    """(SourceSpec, CheckpointReader) of a source folder."""
    from mlaconv.io import CheckpointReader, read_config
    from mlaconv.source.spec import SourceSpec

    return SourceSpec.from_config(read_config(folder)), CheckpointReader(folder)


def refusal(config) -> str:
    """The one-line error ``SourceSpec.from_config`` refuses ``config`` (a dict or a transformers config) with."""
    from mlaconv.errors import MlaconvError
    from mlaconv.source.spec import SourceSpec

    with pytest.raises(MlaconvError) as caught:
        SourceSpec.from_config(config if isinstance(config, dict) else config.to_dict())
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- the command line and refused conversions ---------------------------------------------------------------------


def invoke(*args: str | Path):
    """``mlaconv ARGS`` in this process (typer's CliRunner)."""
    from typer.testing import CliRunner

    from mlaconv.cli import app

    return CliRunner().invoke(app, list(map(str, args)))


RANK = ["--rank", "16", "--rope-dim", "8", "--no-verify"]  # head_dim 16 in every tiny model here


def cli(*args: str | Path):
    """``mlaconv convert --quiet``: what is left on stderr is errors and warnings."""
    return invoke("convert", "--quiet", *args)


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path (so a new or missing file shows too)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.mlaconv-*"))


def assert_refused(result, out: Path, source: Path | None = None, before: dict | None = None,
                   match: str = "") -> str:
    """Non-zero exit, one ``error:`` line and no traceback, no OUT, no temporary, the source unchanged."""
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert match.lower() in lines[0].lower(), lines[0]
    assert not out.exists()
    assert leftovers(out) == []
    if source is not None:
        assert hashes(source) == before
    return lines[0]


# --- passkey retrieval, and a conversion interrupted ---------------------------------------------------------------


def passkey_tokenizer():
    """A byte-level BPE with a BOS, trained on passkey prompts (every digit among its symbols), at most PASSKEY_VOCAB
    ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from mlaconv.evaluate.retrieval import passkey_text

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [passkey_text(20, 0.5, key) for key in (12345, 67890)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=PASSKEY_VOCAB, special_tokens=["<s>"]))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>")


# ``python -m mlaconv``, with Ctrl-C raising KeyboardInterrupt even where the tests run as a background job
# (which starts with SIGINT ignored, and Python then leaves it ignored)
MLACONV = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "runpy.run_module('mlaconv', run_name='__main__', alter_sys=True)")


def wait_for_writing(process: subprocess.Popen, out: Path) -> Path:
    """The temporary folder, once the conversion has written its first shard into it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        temporaries = list(out.parent.glob(f".{out.name}.mlaconv-tmp-*"))
        if temporaries and any(temporaries[0].glob("*.safetensors")):
            return temporaries[0]
        assert process.poll() is None, f"the conversion ended before it was interrupted: {process.communicate()}"
        time.sleep(0.002)
    process.kill()
    raise AssertionError("the conversion never started writing")


# --- the reports, as docs/report.md documents them ------------------------------------------------------------------


def documented() -> dict[str, dict[str, bool]]:
    """Section → key → whether the key is marked *always* present."""
    sections: dict[str, dict[str, bool]] = {}
    current = None
    for line in REPORT_DOC.read_text(encoding="utf-8").splitlines():
        if (heading := HEADING.match(line)):
            current = sections.setdefault(heading.group(1), {})
        elif current is not None and (row := ROW.match(line)):
            current[row.group(1)] = row.group(2).strip() == "always"
    return sections


def check_documented(section: str, report: dict) -> None:
    """Raise AssertionError unless ``report`` has only keys docs/report.md lists for ``section``, and each one it marks
    *always*."""
    keys = documented()[section]
    assert set(report) <= set(keys), f"{section}: undocumented {sorted(set(report) - set(keys))}"
    missing = [key for key, always in keys.items() if always and key not in report]
    assert missing == [], f"{section}: documented as always present but missing"


# --- the inspect spectra report, as docs/report.md ("spectra") documents it ----------------------------------------

# The documented JSON: key → type; "per rank" / "per target" lists follow ``ranks`` / ``energy_targets``.
TOP_KEYS = {
    "mlaconv_version": str, "source": str, "architecture": str, "mode": str, "settings": dict, "num_layers": int,
    "hidden_size": int, "num_kv_heads": int, "head_dim": int, "kv_elements_per_token_per_layer": int,
    "qk_rope_head_dim": int, "rope_stride": int, "matrix_rows": int, "full_rank": int, "ranks": list,
    "energy_targets": list, "layers": list, "summary": dict, "recommendation": (dict, type(None)), "seconds": float,
    "shows": str, "window_sets": (dict, type(None)),
}
LAYER_KEYS = {
    "layer": int, "energy_retained": "rank", "rank_for_energy": "target", "rank_fraction_for_energy": "target",
    "rope_energy_kept": float, "rope_energy_kept_per_frequency": "frequency", "rope_loss_weighted_kept": float,
    "rope_frequencies": "slot", "singular_values": "full", "normalised_spectrum": "full", "energy_curve": "full",
    "rope_score_loss": float, "rope_score_loss_per_frequency": "frequency", "rope_score_loss_without_mean_rotation": float,
    "rope_mean_rotation_recovers": float,
}
SUMMARY_KEYS = {
    "energy_retained_mean": "rank", "energy_retained_min": "rank", "rank_for_energy_mean": "target",
    "rank_for_energy_max": "target", "rank_fraction_for_energy_mean": "target", "rope_energy_kept_mean": float,
    "rope_energy_kept_min": float, "rope_score_loss_mean": float, "rope_score_loss_without_mean_rotation_mean": float,
}
RECOMMENDATION_KEYS = {
    "kv_keep": float, "kv_lora_rank": int, "qk_rope_head_dim": int, "kv_elements_per_token_per_layer": int,
    "kv_keep_actual": float, "reason": str, "energy_retained": "layer", "energy_retained_mean": float,
}


def check_schema(report: dict) -> None:
    """Raise AssertionError unless ``report`` has exactly the documented keys, types and list lengths."""
    lengths = {"rank": len(report["ranks"]), "target": len(report["energy_targets"]), "full": report["full_rank"],
               "frequency": report["head_dim"] // 2, "slot": report["qk_rope_head_dim"] // 2,
               "layer": report["num_layers"]}

    def check(obj: dict, keys: dict, where: str) -> None:
        assert set(obj) == set(keys), f"{where}: {sorted(set(obj) ^ set(keys))}"
        for key, kind in keys.items():
            if isinstance(kind, str):
                assert isinstance(obj[key], list) and len(obj[key]) == lengths[kind], f"{where}.{key}"
                assert all(isinstance(v, (int, float)) for v in obj[key]), f"{where}.{key}"
            else:
                assert isinstance(obj[key], kind), f"{where}.{key}: {type(obj[key]).__name__}"

    check(report, TOP_KEYS, "report")
    assert len(report["layers"]) == report["num_layers"]
    for layer in report["layers"]:
        check(layer, LAYER_KEYS, f"layers[{layer['layer']}]")
    check(report["summary"], SUMMARY_KEYS, "summary")
    if report["recommendation"] is not None:
        check(report["recommendation"], RECOMMENDATION_KEYS, "recommendation")
