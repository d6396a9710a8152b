"""``mlaconv eval perplexity``: the papers' protocol, checked against plain cross-entropy, on tiny and real models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import mlaconv.evaluate.perplexity as evaluate_module
from helpers import check_documented, invoke
from mlaconv.errors import MlaconvError
from mlaconv.evaluate.perplexity import evaluate_perplexity
from mlaconv.io.models import load_causal_lm
from mlaconv.io.text import TokenSource, cut_windows, load_eval_tokens

VOCAB = 96
TEXT = """The lighthouse keeper climbed the stairs every evening before the sun went down. He carried a lamp,
a book and a small loaf of bread, and he counted the steps as he went, because the count kept him awake.

On the island there were no trees, only grass, stones and the wind. The wind came from the west most days,
and the keeper knew its moods the way a farmer knows the weather over his fields.

One winter a ship came too close to the rocks. The keeper turned the great lamp toward it and rang the bell
until his arms were tired. The ship turned in time, and in the spring a letter came to thank him.

He kept the letter in the book he carried, and every evening he read it again before he lit the lamp.
The stairs did not grow shorter, but the keeper did not mind the climb any more.

When he grew old a young woman came to learn the work. She counted the steps too, and she laughed when
she found that her count and his were not the same, because she took the stairs two at a time.
"""
# The documented JSON of a run with a baseline: key → type.
REPORT_KEYS = {
    "model": str, "baseline": str, "data": str, "tokenizer": (str, type(None)), "window": int, "windows": int,
    "tokens": int, "stream_tokens": int, "dropped_tokens": int, "dtype": str, "device": str, "engine": str,
    "engine_differences": list,
    "ppl": float, "ppl_stderr": float, "nll": float, "nll_stderr": float,
    "baseline_ppl": float, "baseline_ppl_stderr": float, "baseline_nll": float, "baseline_nll_stderr": float,
    "drift": float, "drift_stderr": float, "nll_diff": float, "nll_diff_stderr": float,
    "kl_per_token": float, "top1_agreement": float, "kv_kept": float,
    "kv_elements_per_token": dict, "kv_bytes_per_token": dict, "notes": list, "seconds": float,
}
BASELINE_ONLY_KEYS = {key for key in REPORT_KEYS if key.startswith("baseline_")} | {
    "drift", "drift_stderr", "nll_diff", "nll_diff_stderr", "kl_per_token", "top1_agreement", "kv_kept"}


def word_tokenizer(corpus: str):
    """A word-level tokenizer trained on ``corpus``, at most VOCAB ids, ready for ``save_pretrained``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([corpus], trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(TEXT)


@pytest.fixture
def with_tokenizer(tiny_model, tokenizer):
    """A tiny random Llama with the word-level tokenizer saved beside it."""
    def build(name: str = "model", **kwargs):
        folder = tiny_model(name, vocab=VOCAB, **kwargs)
        tokenizer.save_pretrained(folder)
        return folder

    return build


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def direct_cross_entropy(folder, windows: list[torch.Tensor]) -> tuple[float, int]:
    """Sum of next-token cross-entropy over windows (each [length]) with plain torch, and the count scored."""
    model = load_causal_lm(folder)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = model(ids[None]).logits[0]
            total += F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum").item()
            count += len(ids) - 1
    return total, count


def cli(*args: str):
    return invoke("eval", "perplexity", *args)


def test_perplexity_is_the_exponent_of_plain_cross_entropy_over_non_overlapping_windows(with_tokenizer, text_file,
                                                                                         tokenizer):
    folder = with_tokenizer()
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    window = 24
    full = len(ids) // window
    assert len(ids) % window, "the text should leave a remainder to drop"
    total, count = direct_cross_entropy(folder, list(ids[: full * window].view(full, window)))

    report = evaluate_perplexity(folder, source=TokenSource(text=text_file), window=window, batch_size=3)

    assert report.ppl == pytest.approx(math.exp(total / count), rel=1e-6)
    assert report.windows == full
    assert report.tokens == count == full * (window - 1)
    assert report.stream_tokens == len(ids)
    assert report.dropped_tokens == len(ids) - full * window
    assert report.tokenizer.endswith(f"from {folder}")


def test_max_windows_scores_only_the_first_windows(with_tokenizer, text_file, tokenizer):
    folder = with_tokenizer()
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    total, count = direct_cross_entropy(folder, [ids[:16], ids[16:32]])

    report = evaluate_perplexity(folder, source=TokenSource(text=text_file), window=16, max_windows=2)

    assert (report.windows, report.tokens) == (2, 30)
    assert report.ppl == pytest.approx(math.exp(total / count), rel=1e-6)


def test_windows_are_cut_per_sequence_with_the_remainder_dropped():
    stream, short, single = torch.arange(10), torch.arange(100, 103), torch.tensor([7])
    assert [w.tolist() for w in cut_windows([stream, short, single], window=4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    windows = cut_windows([stream, short, single], window=4, keep_short=True)
    assert [w.tolist() for w in windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [100, 101, 102]]


def test_token_lines_are_separate_sequences_and_short_lines_are_whole_windows(tmp_path, tiny_model):
    folder = tiny_model(vocab=VOCAB)
    generator = torch.Generator().manual_seed(3)
    lines = [torch.randint(0, VOCAB, (length,), generator=generator) for length in (20, 7, 16)]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": ids.tolist()}) + "\n" for ids in lines) + "\n")
    # window 8: the 20-token line gives 2 windows (4 dropped), the 7-token line is one window, the last gives 2.
    expected = [lines[0][:8], lines[0][8:16], lines[1], lines[2][:8], lines[2][8:]]
    total, count = direct_cross_entropy(folder, expected)

    report = evaluate_perplexity(folder, source=TokenSource(tokens=path), window=8, batch_size=4)

    assert (report.windows, report.tokens, report.dropped_tokens) == (5, count, 4)
    assert report.ppl == pytest.approx(math.exp(total / count), rel=1e-6)
    assert report.tokenizer is None


@pytest.mark.parametrize("window", [None, 256])
def test_stories260k_samples_give_the_known_perplexity(stories, window):
    report = evaluate_perplexity(stories, source=TokenSource(tokens=stories / "samples.jsonl"), window=window,
                                 batch_size=16)
    assert (report.windows, report.tokens) == (48, 48 * 255)
    assert report.ppl == pytest.approx(17.66, abs=0.01)
    assert report.kv_elements_per_token == {"model": 5 * 2 * 4 * 8}


def test_a_model_against_itself_has_no_kl_full_agreement_and_no_drift(with_tokenizer, text_file):
    folder = with_tokenizer()
    report = evaluate_perplexity(folder, folder, source=TokenSource(text=text_file), window=32, batch_size=2)
    assert report.kl_per_token == pytest.approx(0.0, abs=1e-9)
    assert report.top1_agreement == 1.0
    assert report.drift == pytest.approx(0.0, abs=1e-12)
    assert report.ppl == pytest.approx(report.baseline_ppl, rel=1e-12)
    assert report.kv_kept == 1.0


def test_comparison_matches_a_direct_computation(with_tokenizer, text_file, tokenizer):
    baseline, model = with_tokenizer("baseline", seed=0), with_tokenizer("model", seed=1, kv_heads=1)
    window = 32
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    windows = ids[: len(ids) // window * window].view(-1, window)
    with torch.no_grad():
        logp_model = torch.log_softmax(load_causal_lm(model)(windows).logits[:, :-1].double(), -1)
        logp_base = torch.log_softmax(load_causal_lm(baseline)(windows).logits[:, :-1].double(), -1)
    labels = windows[:, 1:, None]
    nll_model = -logp_model.gather(-1, labels).mean().item()
    nll_base = -logp_base.gather(-1, labels).mean().item()
    kl = (logp_base.exp() * (logp_base - logp_model)).sum(-1).mean().item()
    agreement = (logp_base.argmax(-1) == logp_model.argmax(-1)).double().mean().item()

    report = evaluate_perplexity(model, baseline, source=TokenSource(text=text_file), window=window)

    assert report.ppl == pytest.approx(math.exp(nll_model), rel=1e-5)
    assert report.baseline_ppl == pytest.approx(math.exp(nll_base), rel=1e-5)
    assert report.drift == pytest.approx(report.ppl / report.baseline_ppl - 1, rel=1e-9)
    assert report.kl_per_token == pytest.approx(kl, rel=1e-4)
    assert report.top1_agreement == pytest.approx(agreement)
    assert 0 < report.kl_per_token and report.top1_agreement < 1
    # Paired standard error of the mean NLL difference: per-window differences, equal window lengths.
    per_window = (-logp_model.gather(-1, labels) + logp_base.gather(-1, labels)).mean((1, 2))
    assert report.nll_diff_stderr == pytest.approx((per_window.std() / math.sqrt(len(per_window))).item(), rel=1e-4)
    # 2 KV heads × 16 dims × 2 (keys and values) × 2 layers against 1 KV head, float32.
    assert report.kv_elements_per_token == {"model": 64, "baseline": 128}
    assert report.kv_bytes_per_token == {"model": 256, "baseline": 512}
    assert report.kv_kept == 0.5


def test_text_is_tokenized_with_the_baselines_tokenizer(tiny_model, with_tokenizer, text_file):
    baseline = with_tokenizer("baseline")
    bare = tiny_model("bare", vocab=VOCAB, seed=1)  # no tokenizer files
    other = tiny_model("other", vocab=VOCAB, seed=1)  # the same weights with a tokenizer of other ids
    word_tokenizer("zebra " * 50 + TEXT).save_pretrained(other)
    source = TokenSource(text=text_file)

    with_bare = evaluate_perplexity(bare, baseline, source=source, window=32)
    with_other = evaluate_perplexity(other, baseline, source=source, window=32)
    other_alone = evaluate_perplexity(other, source=source, window=32)

    assert with_bare.tokenizer.endswith(f"from {baseline}") and with_other.tokenizer == with_bare.tokenizer
    assert with_other.ppl == pytest.approx(with_bare.ppl, rel=1e-9)
    assert other_alone.tokenizer.endswith(f"from {other}")
    assert other_alone.ppl != pytest.approx(with_other.ppl, rel=1e-3)


def test_models_that_do_not_fit_together_run_one_after_the_other(with_tokenizer, text_file, monkeypatch):
    baseline, model = with_tokenizer("baseline", seed=0), with_tokenizer("model", seed=1)
    source = TokenSource(text=text_file)
    together = evaluate_perplexity(model, baseline, source=source, window=32)
    monkeypatch.setattr(evaluate_module, "free_memory_bytes", lambda device: 1)

    sequential = evaluate_perplexity(model, baseline, source=source, window=32)

    assert sequential.ppl == pytest.approx(together.ppl, rel=1e-9)
    assert sequential.baseline_ppl == pytest.approx(together.baseline_ppl, rel=1e-9)
    assert sequential.drift == pytest.approx(together.drift, rel=1e-9)
    assert sequential.kl_per_token is None and sequential.top1_agreement is None
    assert "one after the other" in sequential.notes[0]


def test_dataset_text_is_joined_with_blank_lines(tmp_path, with_tokenizer, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    paragraphs = TEXT.split("\n\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    joined = tmp_path / "joined.txt"
    joined.write_text("\n\n".join(paragraphs))
    folder = with_tokenizer()

    from_dataset = load_eval_tokens(TokenSource(dataset=str(tmp_path / "data")), [folder])
    from_text = load_eval_tokens(TokenSource(text=joined), [folder])

    assert torch.equal(from_dataset.sequences[0], from_text.sequences[0])


def test_a_dataset_missing_from_the_cache_offline_is_a_one_line_error(tmp_path, with_tokenizer, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(MlaconvError, match="cannot load dataset wikitext .config wikitext-2-raw-v1, split test"):
        load_eval_tokens(TokenSource(dataset="wikitext"), [with_tokenizer()])


def test_json_output_parses_and_has_the_documented_keys(with_tokenizer, text_file):
    baseline, model = with_tokenizer("baseline", seed=0), with_tokenizer("model", seed=1)
    result = cli(model, "--baseline", baseline, "--text", text_file, "--window", 32, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == set(REPORT_KEYS)
    for key, kind in REPORT_KEYS.items():
        assert isinstance(report[key], kind), key
    assert set(report["kv_bytes_per_token"]) == {"model", "baseline"}
    assert "perplexity" in result.stderr  # the human report went to stderr

    alone = json.loads(cli(model, "--text", text_file, "--window", 32, "--json").stdout)
    assert set(alone) == set(REPORT_KEYS) - BASELINE_ONLY_KEYS
    assert alone["baseline"] is None and alone["ppl"] == pytest.approx(report["ppl"])


@pytest.mark.parametrize("case, message", [
    ("missing text file", "no such text file"),
    ("empty text", "is empty"),
    ("window longer than the text", "not one full window of 250"),
    ("model without tokenizer", "has no tokenizer"),
    ("window below 2", "--window must be at least 2"),
    ("unknown dtype", "unknown --dtype"),
    ("no token source", "give exactly one of"),
    ("bad token line", "line 2: expected"),
    ("token id outside the vocabulary", "outside the vocabulary of 96"),
])
def test_bad_inputs_are_one_line_errors(case, message, tmp_path, tiny_model, with_tokenizer, text_file):
    folder = with_tokenizer()
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"ids": [1, 2]}\n')
    (tmp_path / "big.jsonl").write_text('{"input_ids": [1, 2, 500]}\n')
    args = {
        "missing text file": [folder, "--text", tmp_path / "missing.txt"],
        "empty text": [folder, "--text", tmp_path / "empty.txt"],
        "window longer than the text": [folder, "--text", text_file, "--window", 250],
        "model without tokenizer": [tiny_model("bare", vocab=VOCAB), "--text", text_file],
        "window below 2": [folder, "--text", text_file, "--window", 1],
        "unknown dtype": [folder, "--text", text_file, "--dtype", "float8"],
        "no token source": [folder],
        "bad token line": [folder, "--tokens", tmp_path / "bad.jsonl"],
        "token id outside the vocabulary": [folder, "--tokens", tmp_path / "big.jsonl"],
    }[case]
    result = cli(*args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert result.stdout == ""


def test_float16_underflows_an_exact_mla_conversion_and_is_refused(tiny_model, tmp_path):
    """Measured through transformers' own DeepseekV3 in float16: an exact conversion's logits move by
    far more than the source's do, so eval (and the loader verify and eval share) refuse float16 for MLA."""
    from transformers import AutoModelForCausalLM

    from mlaconv.conversion.options import ConvertOptions

    from mlaconv.conversion.run import convert

    src = tiny_model(kv_heads=1, head_dim=16)  # MQA with R = d: the conversion is exact
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(rank=16, rope_dim=16, verify=False))
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))

    def logits(folder, dtype):
        model = AutoModelForCausalLM.from_pretrained(str(folder)).to(dtype).eval()
        with torch.no_grad():
            return model(ids).logits.double()

    reference = logits(src, torch.float32)
    scale = reference.abs().max()
    error = {(name, dtype): ((logits(folder, dtype) - reference).abs().max() / scale).item()
             for name, folder in (("source", src), ("converted", out)) for dtype in (torch.float32, torch.float16)}
    assert error["converted", torch.float32] < 1e-4  # exact in float32
    assert error["source", torch.float16] < 0.02
    # the latent before kv_a_layernorm (≤ 3e-6) is subnormal in a float16 activation, whatever the weights hold
    assert error["converted", torch.float16] > 0.02 and error["converted", torch.float16] > 5 * error["source", torch.float16]

    ids_file = tmp_path / "ids.jsonl"
    ids_file.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    for model, baseline in ((out, src), (src, out)):  # refused whichever side the MLA checkpoint is on
        result = cli(model, "--baseline", baseline, "--tokens", ids_file, "--dtype", "float16", "--json")
        assert result.exit_code == 1, result.output
        error_object = json.loads(result.stdout)
        assert error_object["kind"] == "input" and f"--dtype float16 is refused for the MLA checkpoint {out}" in \
            error_object["error"]
        assert result.stderr.strip().splitlines() == [f"error: {error_object['error']}"]
    with pytest.raises(MlaconvError, match="float16 is refused"):
        load_causal_lm(out, torch.float16)
    plain = cli(src, "--tokens", ids_file, "--dtype", "float16", "--json")  # no MLA model: float16 is the user's call
    assert plain.exit_code == 0 and json.loads(plain.stdout)["dtype"] == "float16"
    mla = cli(out, "--baseline", src, "--tokens", ids_file, "--dtype", "bfloat16", "--json", "--quiet")
    assert mla.exit_code == 0 and json.loads(mla.stdout)["dtype"] == "bfloat16"


def test_position_buckets_split_the_figures_exactly(with_tokenizer, text_file, tokenizer, monkeypatch):
    baseline, model = with_tokenizer("baseline", seed=0), with_tokenizer("model", seed=1, kv_heads=1)
    source, window = TokenSource(text=text_file), 32
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    windows = ids[: len(ids) // window * window].view(-1, window)
    with torch.no_grad():  # the loss of the prediction made at each position t of each window: [windows, 31]
        losses = F.cross_entropy(load_causal_lm(model)(windows).logits[:, :-1].transpose(1, 2).double(),
                                 windows[:, 1:], reduction="none")
    whole = evaluate_perplexity(model, baseline, source=source, window=window).to_json()

    report = evaluate_perplexity(model, baseline, source=source, window=window, position_buckets=[8, 20])

    buckets, n = report.by_position, len(windows)
    assert report.to_json() | {"seconds": 0} == whole | {"by_position": report.to_json()["by_position"], "seconds": 0}
    assert [(b.start, b.end, b.predictions) for b in buckets] == [(0, 8, 8 * n), (8, 20, 12 * n), (20, 32, 11 * n)]
    assert sum(b.predictions for b in buckets) == report.tokens
    direct = [math.exp(losses[:, start:end].mean()) for start, end in ((0, 8), (8, 20), (20, 31))]
    assert [b.ppl for b in buckets] == pytest.approx(direct, rel=1e-5)
    combined = {name: sum(b.predictions * value(b) for b in buckets) / report.tokens for name, value in {
        "nll": lambda b: math.log(b.ppl), "baseline_nll": lambda b: math.log(b.baseline_ppl),
        "nll_diff": lambda b: math.log1p(b.drift), "kl_per_token": lambda b: b.kl,
        "top1_agreement": lambda b: b.top1}.items()}
    assert combined == pytest.approx({name: getattr(report, name) for name in combined}, rel=1e-12, abs=1e-15)

    monkeypatch.setattr(evaluate_module, "free_memory_bytes", lambda device: 1)  # one model after the other
    sequential = evaluate_perplexity(model, baseline, source=source, window=window, position_buckets=[8, 20])
    assert [b.drift for b in sequential.by_position] == pytest.approx([b.drift for b in buckets], rel=1e-9)
    assert all(b.kl is None and b.top1 is None for b in sequential.by_position)


def test_position_buckets_on_the_command_line(with_tokenizer, text_file):
    folder, shown = with_tokenizer(), {"start", "end", "predictions", "ppl"}
    for baseline, keys in (([], shown), (["-b", folder], shown | {"baseline_ppl", "drift", "drift_stderr", "kl", "top1"})):
        result = cli(folder, *baseline, "--text", text_file, "--window", 32, "--position-buckets", "8,20", "--json")
        buckets = json.loads(result.stdout)["by_position"]
        assert [(b["start"], b["end"]) for b in buckets] == [(0, 8), (8, 20), (20, 32)] and set(buckets[0]) == keys
        check_documented("eval.by_position[]", buckets[0])  # documented in docs/report.md
        assert "by position in the window" in result.stderr
    for buckets, message in (("8,x", "--position-buckets '8,x': expected token counts"),
                             ("20,8", "the boundaries must rise from above 0 to at most 30"),
                             ("31", "the boundaries must rise"), ("0,8", "the boundaries must rise")):
        result = cli(folder, "--text", text_file, "--window", 32, "--position-buckets", buckets, "--json")
        assert result.exit_code == 1 and json.loads(result.stdout)["kind"] == "input"
        assert message in json.loads(result.stdout)["error"], result.stdout
