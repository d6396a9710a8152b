"""Text the source writes itself for healing: sampled from the source's own nucleus, seeded, and trained on."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from mlaconv.conversion.options import ConvertOptions
from mlaconv.conversion.run import convert
from mlaconv.heal import generate
from mlaconv.heal.generate import TOP_P, written_windows

from test_heal import sampled_ids


def peaked(folder):
    """The tiny source with its head scaled up, so that its nucleus holds a few tokens, not most of the vocabulary."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def test_written_windows_are_the_sources_nucleus_samples(tiny_model):
    model = peaked(tiny_model(kv_heads=2, head_dim=16, layers=2))
    windows = written_windows(model, count=5, length=24, seed=3, bos=7)
    assert windows.shape == (5, 24) and windows.dtype == torch.long
    assert (windows[:, 0] == 7).all()
    assert torch.equal(windows, written_windows(model, count=5, length=24, seed=3, bos=7))
    assert not torch.equal(windows, written_windows(model, count=5, length=24, seed=4, bos=7))
    with torch.no_grad():
        probs = model(windows).logits.softmax(-1)[:, 1:-1]  # the distributions the tokens 2… were drawn from
    drawn = windows[:, 2:]
    ordered, _ = probs.sort(-1, descending=True)
    # a token is in the nucleus when the mass of the tokens more likely than it is below p
    above = (probs > probs.gather(-1, drawn[..., None])).float().mul(probs).sum(-1)
    assert (above < TOP_P + 1e-5).all()
    nucleus_size = ((ordered.cumsum(-1) - ordered) < TOP_P).sum(-1).float().mean()
    assert nucleus_size < 0.2 * probs.shape[-1]  # the check above is not vacuous
    assert len(set(drawn.flatten().tolist())) > 3  # sampled, not greedy


def test_windows_are_written_in_batches_and_the_last_one_may_be_short(tiny_model, monkeypatch):
    model = peaked(tiny_model(kv_heads=2, head_dim=16, layers=2))
    monkeypatch.setattr(generate, "BATCH", 2)
    windows = written_windows(model, count=5, length=24, seed=3, bos=7)  # batches of 2, 2 and 1
    assert windows.shape == (5, 24) and (windows[:, 0] == 7).all()
    assert len({tuple(w.tolist()) for w in windows}) == 5  # each window its own draw


def test_a_conversion_heals_on_text_the_source_writes(tiny_model, tmp_path):
    src = tiny_model(kv_heads=2, head_dim=16, layers=2)
    ids = sampled_ids(tmp_path / "ids.jsonl", count=40, length=64)
    options = dict(rank=8, rope_dim=8, calib=[str(ids)], calib_tokens=64 * 24, calib_window=64, refine_steps=0,
                   heal_tokens=64 * 4 * 30, verify=False)
    plain = convert(str(src), tmp_path / "plain", ConvertOptions(**options, heal_written=0)).heal
    written = convert(str(src), tmp_path / "written", ConvertOptions(**options, heal_written=64 * 12)).heal
    default = convert(str(src), tmp_path / "default", ConvertOptions(**options)).heal
    assert (plain.written_windows, written.written_windows) == (0, 12)
    # by default as many written tokens as the training windows hold (fewer than 65,536): one window of 64 each
    assert default.written_windows == len(default.train_windows) < 2**16 // 64
    assert written.train_windows == plain.train_windows and written.steps == plain.steps
    assert written.select_kl_after != plain.select_kl_after  # the extra windows changed what was trained
    assert written.held_out_after.kl < written.held_out_before.kl


def test_a_small_budget_trains_on_both_kinds_in_their_shares_and_writes_no_more_than_it_trains_on():
    from mlaconv.heal.run import trained_windows

    assert trained_windows(10, 5, 20, seed=0) == (list(range(10)), 5)  # room for all: all, in order
    kept, written = trained_windows(250, 128, 200, seed=0)
    assert written == round(200 * 128 / 378) and len(kept) + written == 200  # the written share kept
    assert len(set(kept)) == len(kept) and max(kept) > 200 and kept == sorted(kept)  # drawn from all of the data
    assert trained_windows(250, 128, 200, seed=0) == (kept, written)
    assert trained_windows(250, 128, 200, seed=1)[0] != kept
    assert trained_windows(250, 0, 200, seed=0)[1] == 0
