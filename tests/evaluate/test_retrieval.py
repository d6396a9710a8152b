"""``mlaconv.evaluate_retrieval``: passkey prompts of the lengths asked, scored by hand-checkable models (one that
copies the key, ones that do not), and tiny real models through transformers' generate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import mlaconv.evaluate.retrieval as retrieval
from helpers import PASSKEY_VOCAB, check_documented, make_model, passkey_tokenizer
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.retrieval import (FILLER, INSTRUCTION, NEEDLE, NEW_TOKENS, QUESTION, answer_is_right,
                                        evaluate_retrieval, passkey_prompts)
from mlaconv.report import RetrievalReport

LENGTHS = [96, 160, 256]  # the tiny models' context is 256


@pytest.fixture(scope="session")
def tokenizer():
    return passkey_tokenizer()


@pytest.fixture
def models(tmp_path, tokenizer):
    """Tiny random Llamas with the tokenizer saved beside them, by name."""
    def build(name: str, **kwargs) -> Path:
        folder = make_model(tmp_path / name, vocab=PASSKEY_VOCAB, **kwargs)
        tokenizer.save_pretrained(folder)
        return folder

    return build


class FakeModel:
    """A model whose greedy answer is ``answer(key in the prompt)``: hand-checkable scoring, no weights."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer

    def generate(self, ids, attention_mask, generation_config):
        assert ids.shape == attention_mask.shape and generation_config.do_sample is False
        key = int(re.search(r"The pass key is (\d{5})\.", self.tokenizer.decode(ids[0])).group(1))
        answer = self.tokenizer(self.answer(key), add_special_tokens=False)["input_ids"][:NEW_TOKENS]
        return torch.cat([ids, torch.tensor([answer])], 1)


def use_fakes(monkeypatch, tokenizer, **answers):
    """Load the folder named ``name`` as a FakeModel answering ``answers[name]``."""
    monkeypatch.setattr(retrieval, "load_causal_lm",
                        lambda folder, dtype, device=None: FakeModel(tokenizer, answers[Path(folder).name]))


def test_answers_are_right_when_their_first_5_digit_number_is_the_key():
    assert answer_is_right(" 12345. Remember", 12345) and answer_is_right("12345", 12345)
    assert answer_is_right(" it is 12345 or 54321", 12345)
    assert not answer_is_right(" 54321, not 12345", 12345)
    assert not answer_is_right(" 123456", 12345) and not answer_is_right(" 1234", 12345)
    assert not answer_is_right(" twelve", 12345)


def test_prompts_fit_the_length_with_room_for_the_answer(tokenizer):
    prompts = passkey_prompts(tokenizer, LENGTHS, trials=4, seed=0)
    longest_sentence = max(len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in FILLER)
    assert [p.length for p in prompts] == [length for length in LENGTHS for _ in range(4)]
    for prompt in prompts:
        assert prompt.length - NEW_TOKENS - longest_sentence - 2 < len(prompt.ids) <= prompt.length - NEW_TOKENS
        assert prompt.ids[0] == tokenizer.bos_token_id  # the tokenizer's own BOS rule
        text = tokenizer.decode(prompt.ids, skip_special_tokens=True)
        assert text.startswith(INSTRUCTION) and text.endswith(QUESTION)
        assert NEEDLE.format(key=prompt.key) in text and 10_000 <= prompt.key <= 99_999


def test_needles_are_spread_evenly_over_the_filler(tokenizer):
    prompts = passkey_prompts(tokenizer, [256], trials=5, seed=0)
    assert [p.depth for p in prompts] == [0.1, 0.3, 0.5, 0.7, 0.9]
    for prompt in prompts:
        text = tokenizer.decode(prompt.ids, skip_special_tokens=True)
        needle = NEEDLE.format(key=prompt.key)
        before, after = text[len(INSTRUCTION):].split(needle)
        sentences = [len(re.findall(r"[.]", part)) for part in (before, after[: -len(QUESTION)])]
        assert sum(sentences) > 20
        assert sentences[0] / sum(sentences) == pytest.approx(prompt.depth, abs=1 / sum(sentences))


def test_the_keys_follow_the_seed_and_both_models_see_the_same_prompts(tokenizer):
    first, again, other = (passkey_prompts(tokenizer, [160], trials=6, seed=s) for s in (0, 0, 1))
    assert [p.key for p in first] == [p.key for p in again] and [p.key for p in first] != [p.key for p in other]
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(first, again))
    assert len({p.key for p in first}) > 1
    assert [p.key for p in passkey_prompts(tokenizer, [96, 160], trials=6, seed=0)][6:] == [p.key for p in first]


def test_a_copying_model_scores_all_and_models_that_do_not_copy_score_none(models, tokenizer, monkeypatch):
    use_fakes(monkeypatch, tokenizer, copier=lambda key: f" {key}. Remember it.", wrong=lambda key: f" {key + 1}.",
              longer=lambda key: f" {key}0", chatty=lambda key: " I do not know, sorry.")
    source = models("copier")
    for broken in ("wrong", "longer", "chatty"):
        report = evaluate_retrieval(models(broken), source, lengths=LENGTHS, trials=5, seed=0)
        assert report.baseline_accuracy == 1.0 and report.accuracy == 0.0
        for length in report.lengths:
            assert (length.accuracy, length.baseline_accuracy) == (0.0, 1.0)
            assert [(b.trials, b.accuracy, b.baseline_accuracy) for b in length.by_depth] == [(1, 0.0, 1.0)] * 5
            assert all(c.baseline_correct and not c.correct for c in length.cases)
    itself = evaluate_retrieval(source, source, lengths=LENGTHS, trials=3, seed=0)
    assert itself.accuracy == itself.baseline_accuracy == 1.0
    assert all(c.answer == c.baseline_answer and c.answer.startswith(f" {c.key}. Remember") for length in itself.lengths
               for c in length.cases)


def test_accuracy_is_counted_per_length_and_depth(models, tokenizer, monkeypatch):
    """A model that copies only keys hidden in the first half of the filler."""
    prompts = {p.key: p.depth for p in passkey_prompts(tokenizer, LENGTHS, trials=10, seed=3)}
    use_fakes(monkeypatch, tokenizer, source=lambda key: f" {key}.",
              shallow=lambda key: f" {key}." if prompts[key] < 0.5 else " 00000.")

    report = evaluate_retrieval(models("shallow"), models("source"), lengths=LENGTHS, trials=10, seed=3)

    assert report.accuracy == 0.5 and report.baseline_accuracy == 1.0
    for length in report.lengths:
        assert length.accuracy == 0.5
        assert [(b.start, b.end, b.trials) for b in length.by_depth] == \
               [(0.0, 0.2, 2), (0.2, 0.4, 2), (0.4, 0.6, 2), (0.6, 0.8, 2), (0.8, 1.0, 2)]
        assert [b.accuracy for b in length.by_depth] == [1.0, 1.0, 0.5, 0.0, 0.0]
        assert length.prompt_tokens == [min(c.prompt_tokens for c in length.cases),
                                        max(c.prompt_tokens for c in length.cases)]


def test_a_real_model_against_itself_gives_the_same_answers_and_a_zeroed_one_finds_nothing(models):
    source = models("source")
    itself = evaluate_retrieval(source, source, lengths=[128, 256], trials=2, seed=0)
    cases = [c for length in itself.lengths for c in length.cases]
    assert [c.answer for c in cases] == [c.baseline_answer for c in cases]
    assert itself.accuracy == itself.baseline_accuracy

    zeroed = evaluate_retrieval(models("zeroed", scale=0.0), source, lengths=[128, 256], trials=2, seed=0)
    assert zeroed.accuracy == 0.0 and zeroed.baseline == str(source) and zeroed.tokenizer.endswith(f"from {source}")


def test_an_exact_mla_conversion_answers_as_its_source(models, tmp_path):
    from mlaconv.conversion.run import convert
    from mlaconv.conversion.options import ConvertOptions

    source = models("source", kv_heads=1, head_dim=16)  # MQA with R = d: the conversion is exact
    convert(str(source), tmp_path / "mla", ConvertOptions(rank=16, rope_dim=16, verify=False))

    report = evaluate_retrieval(tmp_path / "mla", source, lengths=[256], trials=3, seed=0)

    assert [c.answer for c in report.lengths[0].cases] == [c.baseline_answer for c in report.lengths[0].cases]
    assert RetrievalReport.from_json(report.to_json()) == report
    assert_documented(report.to_json())
    for model, baseline in ((tmp_path / "mla", source), (source, tmp_path / "mla")):  # as eval perplexity does
        with pytest.raises(MlaconvError, match="--dtype float16 is refused for the MLA checkpoint"):
            evaluate_retrieval(model, baseline, lengths=[256], dtype="float16")


def test_without_a_baseline_no_baseline_keys_are_written(models, tokenizer, monkeypatch):
    use_fakes(monkeypatch, tokenizer, alone=lambda key: f" {key}")
    written = evaluate_retrieval(models("alone"), lengths=[128], trials=2, seed=0).to_json()

    def keys(value) -> set[str]:
        if isinstance(value, list):
            return set().union(*map(keys, value))
        return set(value).union(*map(keys, value.values())) if isinstance(value, dict) else set()

    assert written["baseline"] is None and written["accuracy"] == 1.0
    assert {key for key in keys(written) if key.startswith("baseline")} == {"baseline"}
    assert_documented(written)


def assert_documented(written: dict) -> None:
    """Every key of a retrieval report is in docs/report.md, and every key marked *always* is in the report."""
    check_documented("retrieval", written)
    for length in written["lengths"]:
        check_documented("retrieval.lengths[]", length)
        for bucket in length["by_depth"]:
            check_documented("retrieval.lengths[].by_depth[]", bucket)
        for case in length["cases"]:
            check_documented("retrieval.lengths[].cases[]", case)


def test_the_default_lengths_are_those_of_1k_to_8k_within_the_context(models, tokenizer, monkeypatch):
    use_fakes(monkeypatch, tokenizer, long=lambda key: f" {key}")
    folder = models("long")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 3000}))
    report = evaluate_retrieval(folder, trials=1)
    assert [length.length for length in report.lengths] == [1024, 2048] and report.accuracy == 1.0


@pytest.mark.parametrize("lengths, trials, message", [
    ([512], 2, "--lengths 512 is longer than the models' context (256 tokens)"),
    ([], 2, "--lengths names no length"),
    ([40], 2, "--lengths 40 is too short"),
    ([128], 0, "--trials must be at least 1, not 0"),
])
def test_bad_settings_are_refused(models, lengths, trials, message):
    with pytest.raises(MlaconvError, match=re.escape(message)):
        evaluate_retrieval(models("source"), lengths=lengths, trials=trials)


def test_a_model_without_a_tokenizer_is_refused(tmp_path):
    bare = make_model(tmp_path / "bare", vocab=PASSKEY_VOCAB)
    with pytest.raises(MlaconvError, match="has no tokenizer"):
        evaluate_retrieval(bare, lengths=[128])
