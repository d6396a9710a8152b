"""The pipeline's layer iterators: each layer once, in order; the calibrated pass advances itself."""

from __future__ import annotations

import pytest
import torch

from helpers import STORIES
from mlaconv.calibration.streamer import CalibrationOptions, SourceStreamer
from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.pipeline import source_layers
from mlaconv.conversion.run import convert
from mlaconv.io import CheckpointReader, read_config
from mlaconv.source.spec import load_source
from mlaconv.source.weights import SourceWeights
from mlaconv.target import deepseek
from mlaconv.target.deepseek import CheckpointLayer, checkpoint_layers


class RecordingStreamer(SourceStreamer):
    """A streamer that notes which layers it was moved through."""

    advanced: list[int]

    def advance(self, i, attention, converted=None, run=None, kept=None):
        self.advanced.append(i)
        super().advance(i, attention, converted, run, kept)


def test_source_layers_are_every_layer_in_order_read_on_use():
    _, spec, reader = load_source(str(STORIES))
    layers = list(source_layers(reader, spec))
    assert [layer.index for layer in layers] == list(range(spec.num_layers))
    assert all(layer._attention is None for layer in layers)
    for layer in layers:
        expected = SourceWeights(reader, spec).attention(layer.index)
        assert torch.equal(layer.attention.q, expected.q) and torch.equal(layer.attention.o, expected.o)
    with pytest.raises(RuntimeError, match="not calibrated"):
        layers[0].stats
    reader.close()


def test_a_calibrated_pass_advances_each_layer_once_after_its_consumer():
    _, spec, reader = load_source(str(STORIES))
    ids = torch.randint(0, spec.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    streamer = RecordingStreamer(reader, spec, CalibrationOptions(ids))
    streamer.advanced = []
    seen = []
    for layer in source_layers(reader, spec, streamer):
        assert streamer.advanced == list(range(layer.index))  # the layers before, not this one
        assert layer.stats.metric.shape[-1] == spec.hidden_size
        seen.append(layer.index)
    assert seen == streamer.advanced == list(range(spec.num_layers))
    reader.close()


def test_checkpoint_layers_read_a_converted_checkpoint(tmp_path):
    out = tmp_path / "mla"
    convert(str(STORIES), out, ConvertOptions(rank=16, verify=False))
    num_layers = read_config(out)["num_hidden_layers"]
    reader = CheckpointReader(out)
    layers = list(checkpoint_layers(reader, num_layers))
    assert layers == [CheckpointLayer(i, reader) for i in range(num_layers)]
    assert [layer.prefix for layer in layers] == [f"model.layers.{i}." for i in range(num_layers)]
    last = layers[-1].read_attention()
    assert torch.equal(last.kv_b_proj, reader.get(layers[-1].prefix + deepseek.KV_B_PROJ))
    assert last.kv_a_proj.shape[0] == 16 + read_config(out)["qk_rope_head_dim"]
    reader.close()
