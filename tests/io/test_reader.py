"""Reading a source checkpoint one cannot trust: bad folders, configs and weight files are refused in one line
with nothing written and the source untouched; pickles run no code, custom code is never trusted (issue 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import RANK, ROOT, assert_refused, cli, hashes, make_model


def test_a_folder_that_is_not_a_model(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    before = hashes(folder)
    assert_refused(cli(folder, tmp_path / "out", *RANK), tmp_path / "out", folder, before, "has no config.json")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    assert_refused(cli(folder, tmp_path / "out", *RANK), tmp_path / "out", match="lacks 'num_attention_heads'")
    (folder / "config.json").write_text("{not json")
    assert_refused(cli(folder, tmp_path / "out", *RANK), tmp_path / "out", match="not valid JSON")


def test_a_model_folder_without_weights(src, tmp_path):
    (src / "model.safetensors").unlink()
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "holds no weights")


def test_config_and_weights_disagree(src, tmp_path):
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "tensor model.layers.1.mlp.up_proj.weight is missing")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"intermediate_size": 48}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "model.layers.0.mlp.gate_proj.weight has shape [64, 32], expected [48, 32]")


@pytest.mark.parametrize("key, value, match", [
    ("num_attention_heads", 0, "num_attention_heads = 0 is not a positive int"),
    ("hidden_size", "32", "hidden_size = '32' is not a positive int"),
    ("num_hidden_layers", 1.5, "num_hidden_layers = 1.5 is not a positive int"),
    ("rms_norm_eps", "tiny", "rms_norm_eps = 'tiny' is not a positive float"),
    ("rope_theta", "1e4", "rope_theta = '1e4' is not a positive number"),
    ("rope_scaling", [8.0], "rope_scaling = [8.0] is not a mapping"),
])
def test_malformed_config_numbers(src, tmp_path, key, value, match):
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)  # a transformers 4.x config: rope_theta and rope_scaling at the top level
    (src / "config.json").write_text(json.dumps(config | {key: value}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, match)


def test_a_weight_index_that_maps_to_non_names(src, tmp_path):
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "weight_map must map names to file names")


def test_truncated_and_corrupt_safetensors(src, tmp_path):
    weights = src / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) * 2 // 3])
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "truncated")
    weights.write_bytes(whole[:8] + b"\x00garbage" + whole[16:])
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "header is not JSON")
    weights.write_bytes(b"<html>rate limited</html>")
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", match="not a readable safetensors file")


def test_a_sharded_checkpoint_with_a_missing_shard(src, tmp_path):
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "model.safetensors.index.json names model-00002-of-00002.safetensors, which is missing")


def test_a_truncated_pickle_checkpoint(src, tmp_path):
    pickled = _as_pickle(src) / "pytorch_model.bin"
    pickled.write_bytes(pickled.read_bytes()[:3000])
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                   "pytorch_model.bin cannot be loaded (truncated or corrupt?)")


@pytest.mark.parametrize("name, value", [("model.layers.1.mlp.down_proj.weight", float("nan")),
                                         ("model.layers.1.mlp.gate_proj.weight", float("nan")),  # copied unread
                                         ("model.layers.0.self_attn.k_proj.weight", float("inf")),
                                         ("model.embed_tokens.weight", float("-inf"))])
def test_nan_or_inf_weights(src, tmp_path, name, value):
    """Found mid-conversion (after some shards are written): nothing of it may remain."""
    state = load_file(src / "model.safetensors")
    state[name][3, 5] = value
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK, "--shard-size", "1KB"), tmp_path / "out", src, before,
                   f"tensor {name} in model.safetensors contains NaN or Inf")


def _as_pickle(folder: Path) -> Path:
    """The same model as ``pytorch_model.bin`` (what ``save_pretrained(safe_serialization=False)`` wrote)."""
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def test_a_pickle_checkpoint_converts_with_one_warning_line(tmp_path):
    make_model(tmp_path / "safe", heads=4, kv_heads=2, hidden=32, head_dim=16)
    pickled = _as_pickle(make_model(tmp_path / "pickled", heads=4, kv_heads=2, hidden=32, head_dim=16))
    before = hashes(pickled)
    result = cli(pickled, tmp_path / "from-bin", *RANK)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"warning: {pickled} holds pickle weights (.bin): loading them with torch.load(weights_only=True), "
                     "which refuses anything but tensors; prefer safetensors"]
    assert hashes(pickled) == before
    assert cli(tmp_path / "safe", tmp_path / "from-safetensors", *RANK).exit_code == 0
    shards = sorted((tmp_path / "from-bin").glob("*.safetensors"))
    assert shards and all(p.read_bytes() == (tmp_path / "from-safetensors" / p.name).read_bytes() for p in shards)


class _Payload:
    """Unpickling this creates the marker file: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_malicious_pickle_is_refused_and_runs_nothing(src, tmp_path):
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state | {"extra": _Payload(tmp_path / "pwned")}, src / "pytorch_model.bin")
    before = hashes(src)
    line = assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before,
                          "pytorch_model.bin is refused: it is a pickle that holds more than tensors")
    assert "(it would call io.open)" in line
    assert not (tmp_path / "pwned").exists()
    # the payload is live: loading without weights_only would have run it
    torch.load(src / "pytorch_model.bin", weights_only=False)
    assert (tmp_path / "pwned").exists()


def test_custom_code_is_refused(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "modeling.MyModel"}}))
    (src / "modeling.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w')\n")
    before = hashes(src)
    assert_refused(cli(src, tmp_path / "out", *RANK), tmp_path / "out", src, before, "custom code (auto_map)")
    assert not (tmp_path / "pwned").exists()


def test_remote_code_is_never_trusted():
    sources = ROOT / "src" / "mlaconv"
    uses = [line.strip() for path in sources.rglob("*.py") for line in path.read_text().splitlines()
            if "trust_remote_code" in line and "trust_remote_code`" not in line]
    assert uses and all("False" in line for line in uses), uses
