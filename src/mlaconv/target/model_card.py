"""The model card (README.md) written next to a converted checkpoint, from the conversion report.

Hugging Face model-card style: YAML front-matter (``base_model``, ``library_name``, ``tags``), then
what the folder is, every setting, the KV cache before and after, the per-layer approximation
figures, the verification and evaluation results present in the report, what each serving stack
keeps, and how to load and serve it. The card only restates the report (``mlaconv.json``); parts
the report lacks are left out rather than guessed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from mlaconv.report import ConversionReport, EvalReport, RetrievalReport
from mlaconv.report.conversion import Calibration, Verification
from mlaconv.report.record import Failure
from mlaconv.target.engines import VLLM_MLA_HEAD_SIZES, head_sizes_text

# The Hugging Face cache keeps a hub model in .../models--ORG--NAME/snapshots/REVISION.
_HUB_CACHE_FOLDER = re.compile(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]")
KERNELS = {
    "flashmla": "FlashMLA (vLLM, SGLang; Hopper): needs r + R = 512 + 64",
    "cutlass_mla": "CUTLASS MLA (vLLM; Blackwell): needs 512 + 64",
    "flashinfer_mla": "FlashInfer MLA (vLLM, SGLang): needs 512 + 64 and P ∈ {64, 128, 192}",
    "deepseek_r1_prefill_fast_path": "vLLM DeepSeek-R1 prefill fast paths (Blackwell): need P = V = 128",
    "vllm_head_size_whitelist": f"vLLM's MLA head sizes: r + R ∈ {head_sizes_text(VLLM_MLA_HEAD_SIZES)} "
                                "(vLLM 0.32; older releases: 576 only)",
    "triton_mla": "Triton MLA (vLLM, SGLang; any GPU): generic",
}
STACKS = {"transformers": "transformers", "vllm": "vLLM", "sglang": "SGLang"}


def write_model_card(folder: Path, report: ConversionReport) -> None:
    """Write ``folder/README.md`` describing the converted checkpoint that ``report`` describes."""
    (Path(folder) / "README.md").write_text(render_model_card(report), encoding="utf-8")


def render_model_card(report: ConversionReport) -> str:
    """The model card as Markdown text."""
    sections = [
        _front_matter(report), _introduction(report), _verdict(report), _kv_cache(report), _settings(report), _per_layer(report),
        _whole_model(report.calibration), _healing(report), _verification(report.verify), _evaluation(report.eval), _retrieval(report.retrieval), _serving(report),
        _usage(report), _quality(report),
    ]
    return "\n\n".join(section for section in sections if section) + "\n"


def hub_id(report: ConversionReport) -> str | None:
    """The source's hub id: ``source_id`` when the report has it, else read off a HF-cache path."""
    if report.source_id:
        return report.source_id
    match = _HUB_CACHE_FOLDER.search(report.source)
    return f"{match[1]}/{match[2]}" if match else None


def _front_matter(report: ConversionReport) -> str:
    meta = {"library_name": "transformers", "tags": ["mla", "deepseek_v3", "mlaconv"]}
    base = hub_id(report)
    if base:
        meta = {"base_model": base, **meta}
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---"


def _introduction(report: ConversionReport) -> str:
    base = hub_id(report)
    source = f"[{base}](https://huggingface.co/{base})" if base else f"`{report.source}`"
    revision = report.source_revision or report.settings.get("revision")
    calibration = report.calibration
    how = "weights only (no calibration data)" if report.mode == "weights-only" else report.mode
    if calibration:
        sets = calibration.window_sets
        how += (f", on {calibration.tokens:,} calibration tokens ({calibration.windows} windows of "
                f"{calibration.window}: {len(sets.fit)} to fit, {len(sets.select)} to select, {len(sets.audit)} to "
                "audit; the window indices are in `mlaconv.json`)")
        refined = sum("refined" in v for v in report.layer_variant)
        if refined:
            how += (f", with {refined} of {len(report.layer_variant)} layers refined by gradient steps on their own "
                    "attention-output error")
    return "\n".join([
        f"# {Path(report.output).name}",
        "",
        f"This is {source}{f' (revision `{revision}`)' if revision else ''}, a {report.architecture} model, "
        f"converted by mlaconv {report.mlaconv_version} from grouped-query / "
        "multi-head attention to **Multi-head Latent Attention** in the native DeepSeek-V3 layout. It loads as "
        "`DeepseekV3ForCausalLM` in stock transformers (≥ 4.53), vLLM and SGLang, with no custom code "
        "and no `trust_remote_code`.",
        "",
        f"Conversion: {how}; the model as a whole was not trained or fine-tuned afterwards. The KV cache holds one latent of rank "
        f"r = {report.kv_lora_rank} plus one shared RoPE key of R = {report.qk_rope_head_dim} dims per "
        "token and layer, instead of a key and a value per KV head. Every figure below is also in "
        "`mlaconv.json` in this folder.",
    ])


def _verdict(report: ConversionReport) -> str:
    verdict = report.verdict
    if verdict is None:
        return ""
    mark = {"close": "Close to the source", "degraded": "Degraded", "broken": "**Broken: do not serve**"}
    heading = mark.get(verdict.level, "No verdict")
    return "\n".join(["## Verdict", "", f"{heading}. {verdict.message[0].upper()}{verdict.message[1:]}.",
                      "", "(Thresholds: `mlaconv.evaluate.verdict`; close = KL < 0.05 per token and top-1 agreement ≥ 90%, "
                      "broken = KL ≥ 1 or top-1 < 40%.)"])


def _kv_cache(report: ConversionReport) -> str:
    elements, kv_bytes = report.kv_elements_per_token_per_layer, report.kv_bytes_per_token
    layers = len(report.energy_retained.per_layer)
    return "\n".join([
        "## KV cache per token",
        "",
        "| | source | converted |",
        "|---|---:|---:|",
        f"| elements per layer | {elements.source:,} | {elements.converted:,} "
        f"(r + R = {report.kv_lora_rank} + {report.qk_rope_head_dim}) |",
        f"| bytes, all {layers} layers, {report.dtype} | {kv_bytes.source:,} | {kv_bytes.converted:,} |",
        "",
        f"The converted cache is {report.kv_keep:.1%} of the source's.",
    ])


def _settings(report: ConversionReport) -> str:
    shape = {
        "kv_lora_rank (r)": report.kv_lora_rank,
        "qk_rope_head_dim (R)": report.qk_rope_head_dim,
        "qk_nope_head_dim (P)": report.qk_nope_head_dim,
        "v_head_dim (V)": report.v_head_dim,
        "shape choice": report.shape_choice,
        "rope_theta of the shared key": report.rope_theta,
        "rope stride (source frequencies 0, s, 2s, … kept rotated)": report.rope_stride,
        "output dtype": report.dtype,
        "rms_norm_eps (source → converted)": f"{_fmt(report.source_rms_norm_eps)} → {_fmt(report.latent_norm.eps)}",
        "residual-stream scale": report.residual_scale,
        "tiny-latent bound max mean(c²)/ε": report.latent_norm.max_bound,
    }
    lines = ["## Settings", "", "| shape | value |", "|---|---|"]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in shape.items()]
    lines += ["", "| `mlaconv convert` option | value |", "|---|---|"]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in report.settings.items()]
    return "\n".join(lines)


def _per_layer(report: ConversionReport) -> str:
    columns = {
        "latent energy retained": report.energy_retained.per_layer,
        "RoPE energy kept": report.rope_energy_kept,
        "key error": report.key_error,
        "value error": report.value_error,
        "attention error": report.attention_error,
    }
    columns = {name: values for name, values in columns.items() if values and None not in values}
    variants = report.layer_variant
    calibrated_note = (
        "Calibrated: each layer kept the conversion variant with the least attention error on the select "
        "calibration windows; every figure in this table is measured on the audit windows, which the fit "
        "and every per-layer choice never saw, for the layers as written"
        + (" (refined layers measured after their refinement, the RoPE energy from their trained rotary key; "
           "the energy and key/value errors compare them with the source's keys and values, which refinement "
           "does not aim at)"
           if any("refined" in v for v in variants) else "")
        + ". *Attention error*: ‖MLA − source‖² / ‖source‖² of the layer's attention output, on the source's "
        "own inputs to the layer."
    )
    lines = [
        "## Approximation per layer",
        "",
        "*Latent energy retained*: 1 − the balanced relative error of the non-rotated keys and the values "
        "through the rank-r latent (keys and values scaled to equal energy, so it is 1 − the mean of the key "
        "and value errors), whatever variant a layer kept. *RoPE energy kept*: share of the source's rotary key "
        "energy the shared R-dim key carries (per KV head and frequency, the best multiple of the shared key's "
        "component at that frequency). *Key / value error*: relative error of the keys and values "
        "through the latent, in the metric of the layer's inputs. "
        + (calibrated_note if report.mode == "calibrated"
           else "Weights-only: the input is taken as isotropic after the input norm."),
        "",
        "| layer | " + " | ".join(columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    if variants:
        lines[-2] = lines[-2][:-2] + " | variant |"
        lines[-1] = lines[-1] + "---|"
    for i, row in enumerate(zip(*columns.values())):
        variant = f" {variants[i]} |" if variants else ""
        lines.append(f"| {i} | " + " | ".join(f"{value:.4f}" for value in row) + " |" + variant)
    means = [sum(values) / len(values) for values in columns.values()]
    lines.append("| **mean** | " + " | ".join(f"**{value:.4f}**" for value in means) + " |" + (" |" if variants else ""))
    return "\n".join(lines)


def _whole_model(calibration: Calibration | None) -> str:
    if calibration is None:
        return ""
    whole = calibration.whole_model
    lines = [
        "## Whole-model check",
        "",
        f"The closed-form conversion and, where layers were refined, the refined one were run end to end on the "
        f"{whole.windows} audit windows ({whole.tokens:,} tokens) against the source (final norm and head "
        f"included) while converting. Written: **{whole.written}**, because {whole.reason}.",
        "",
        "| model | KL(source ‖ model) per token | top-1 agreement |",
        "|---|---:|---:|",
    ]
    for name, figures in (("closed form", whole.closed_form), ("refined", whole.refined)):
        lines.append(f"| {name}{' (written)' if name == whole.written else ''} | "
                     + (f"{_metric('kl', figures.kl)} | {_metric('top1', figures.top1)} |" if figures
                        else "— | — (no layer refined) |"))
    lines += ["", "The choice between these two models is the only one the audit windows made."]
    return "\n".join(lines)


def _healing(report: ConversionReport) -> str:
    heal = report.heal
    if heal is None:
        return ""
    if isinstance(heal, Failure):
        return f"## Healing\n\nHealing did not run: {heal.error}. The model is the conversion as written."
    before, after = heal.held_out_before, heal.held_out_after
    lines = [
        "## Healing",
        "",
        f"After the conversion, `mlaconv heal` trained every layer's {', '.join(f'`{t}`' for t in heal.trained)} end "
        f"to end towards the source's next-token distributions (KL on its top-{heal.top_k} log-probabilities), "
        f"everything else frozen: {heal.tokens:,} tokens of {heal.calibration_data} in {heal.steps} steps of "
        f"{heal.batch} windows of {heal.window}"
        + (f", each spread over {heal.position_span:,} positions so that it trains longer distances (PoSE)"
           if heal.position_span else "")
        + f" (the best step on {len(heal.select_windows)} select windows kept: "
        f"{heal.best_step}), on {heal.device} (the time it took is in `mlaconv.json`, so that the same inputs write the same card). "
        f"On {len(heal.held_out_windows)} held-out "
        "windows of the same data, which nothing was trained or chosen on:",
        "",
        "| | before healing | after |",
        "|---|---:|---:|",
        f"| perplexity drift | {_metric('drift', before.drift)} | {_metric('drift', after.drift)} |",
        f"| KL(source ‖ model) per token | {_metric('kl', before.kl)} | {_metric('kl', after.kl)} |",
        f"| top-1 agreement | {_metric('top1', before.top1)} | {_metric('top1', after.top1)} |",
        "",
        f"The tiny-latent guarantee was re-proved on the trained weights (max mean(c²)/ε {heal.latent_bound:.3g})"
        + (f"; layers {heal.rescaled_layers} had their latent rows scaled back under it." if heal.rescaled_layers
           else "."),
    ]
    return "\n".join(lines)


def _verification(check: Verification | Failure | None) -> str:
    if check is None:
        return "## Verification\n\nThe built-in check was not run (`--no-verify`)."
    if isinstance(check, Failure):
        check = Verification()  # a failed check renders as one that measured nothing (the error is in mlaconv.json)
    if check.skipped is not None:
        return f"## Verification\n\nThe built-in check was skipped: {check.skipped}."
    where = f" on {check.windows} window(s), {check.tokens:,} tokens" if check.tokens is not None else ""
    engines = check.engines or {}
    measured = {name: figures for name, figures in engines.items() if "kl" in figures}
    header = ["", "transformers"] + [f"as {name} computes it" for name in measured]
    lines = [
        "## Verification",
        "",
        f"The converted folder was loaded through `AutoModelForCausalLM` (as `{check.loader or '?'}`) "
        f"and compared with the source{where}, in {check.dtype or '?'}; each engine's column is that "
        "transformers model with the engine's rewrites applied (`mlaconv.target.engines`):",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    rows = {"max \\|Δ logit\\|": "max_abs_logit_diff", "max relative Δ logit": "max_rel_logit_diff",
            "KL(source ‖ converted) per token": "kl", "top-1 agreement": "top1"}
    for label, key in rows.items():
        if getattr(check, key) is not None:
            values = [getattr(check, key)] + [figures.get(key) for figures in measured.values()]
            lines.append(f"| {label} | " + " | ".join(_metric(key, v) for v in values) + " |")
    lines.append("")
    for name, figures in engines.items():
        if "same_as" in figures:
            lines.append(f"- {name}: same as {figures['same_as']} ({figures['reason']}).")
        elif "refused" in figures:
            lines.append(f"- {name}: refuses this checkpoint: {figures['refused']}.")
        elif "differences" in figures:
            lines.append(f"- {name}: {'; '.join(figures['differences'])}.")
        if "shape_refused" in figures:
            lines.append(f"- {name}: does not run this checkpoint: {figures['shape_refused']}.")
    return "\n".join(lines).rstrip()


def _evaluation(result: EvalReport | Failure | None) -> str:
    if result is None:
        return ""
    lines = ["## Evaluation", ""]
    lines += _table(result.to_json()) if isinstance(result, Failure) else _perplexity_run(result)
    return "\n".join(lines).rstrip()


def _perplexity_run(run: EvalReport) -> list[str]:
    """A report of ``mlaconv eval perplexity`` (baseline = the source) as a side-by-side table."""
    scope = (f"{run.data}, {run.windows} windows of {run.window} tokens, {run.tokens:,} scored predictions, "
             f"{run.dtype}, as {run.engine} computes it")
    lines = [f"Perplexity ({scope}):", ""]
    if run.baseline_ppl is not None:
        lines += ["| | source | converted |", "|---|---:|---:|",
                  f"| perplexity | {_with_error(run.baseline_ppl, run.baseline_ppl_stderr)} | "
                  f"{_with_error(run.ppl, run.ppl_stderr)} |"]
        comparison = {"drift": ("relative PPL drift", run.drift_stderr),
                      "kl_per_token": ("KL(source ‖ converted) per token", None),
                      "top1_agreement": ("top-1 agreement", None)}
        for key, (label, error) in comparison.items():
            value = getattr(run, key)
            if value is not None:
                shown = f"{value:+.2%}" if key == "drift" else _metric(key, value)
                lines.append(f"| {label} | | {shown}{f' ± {error:.2%}' if error is not None else ''} |")
    else:
        lines += [f"Perplexity {_with_error(run.ppl, run.ppl_stderr)}."]
    if run.notes:
        lines += [""] + [f"- {note}" for note in run.notes]
    return lines


def _retrieval(result: RetrievalReport | Failure | None) -> str:
    if result is None:
        return ""
    if isinstance(result, Failure):
        return "## Long-context retrieval\n\n" + "\n".join(_table(result.to_json()))
    lines = ["## Long-context retrieval", "",
             f"Synthetic passkey retrieval (`mlaconv eval retrieval`: a 5-digit key hidden at {result.trials} evenly "
             f"spread depths of filler text, greedy, {result.dtype}), the very same prompts for both models:", "",
             "| prompt length (tokens) | source | converted |", "|---:|---:|---:|"]
    for length in result.lengths:
        lines.append(f"| {length.length:,} | {_metric('top1', length.baseline_accuracy)} | "
                     f"{_metric('top1', length.accuracy)} |")
    return "\n".join(lines)


def _serving(report: ConversionReport) -> str:
    serving = report.serving
    lines = ["## Serving caveats", ""]
    lines += [f"- {warning}" for warning in serving.warnings] or ["- None: every stack computes the same model."]
    lines += ["", "| stack | attention biases kept | rope_scaling reproduced exactly |", "|---|---|---|"]
    stacks = {label: getattr(serving, key) for key, label in STACKS.items()}
    lines += [f"| {label} | {_fmt(stack['biases_kept'])} | {_fmt(stack['rope_scaling_exact'])} |"
              for label, stack in stacks.items()]
    lines += ["", f"MLA kernels these shapes fit (r = {report.kv_lora_rank}, R = {report.qk_rope_head_dim}, "
                  f"P = {report.qk_nope_head_dim}, V = {report.v_head_dim}):", "", "| kernel | fits |", "|---|---|"]
    lines += [f"| {KERNELS.get(name, name)} | {_fmt(fits)} |" for name, fits in serving.kernels.items()]
    return "\n".join(lines)


def _usage(report: ConversionReport) -> str:
    path = report.output
    fast = report.serving.kernels["flashmla"]
    vllm = f"vllm serve {path} --dtype bfloat16" + ("" if fast else " --attention-backend TRITON_MLA   # older vLLM: "
                                                    "VLLM_ATTENTION_BACKEND=TRITON_MLA")
    if not report.serving.kernels["vllm_head_size_whitelist"]:
        vllm = (f"# vLLM does not run this checkpoint: r + R = {report.kv_lora_rank + report.qk_rope_head_dim}, and it "
                f"runs MLA only at {head_sizes_text(VLLM_MLA_HEAD_SIZES)}")
    sglang = f"python -m sglang.launch_server --model-path {path} --dtype bfloat16" + (
        "" if fast else " --attention-backend triton")
    source = hub_id(report) or report.source
    tokenizer = path if report.tokenizer_files else source
    return "\n".join([
        "## How to use",
        "",
        "transformers ≥ 4.53 (5.x keeps the latent in its KV cache; 4.x caches the expanded keys and values):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{path}", dtype="bfloat16")  # torch_dtype= before 4.56',
        f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer}")'
        + ("" if tokenizer == path else "  # no tokenizer files were copied: the source's"),
        "```",
        "",
        "Use bfloat16 or float32, never float16: the latent is kept tiny (so that DeepSeek's latent RMSNorm "
        "acts linearly) and underflows in float16 activations (the weights fit float16, and llama.cpp's f16, q8_0 "
        "and Q4_K_M GGUFs, which compute in float32, are fine). Pass the dtype explicitly to the engines, whose `auto` "
        "may pick float16 for a float32 checkpoint:",
        "",
        "```bash",
        vllm,
        sglang,
        "```",
        "",
        "Evaluate it with lm-evaluation-harness, giving the source's tokenizer so that both models see the "
        "same token ids:",
        "",
        "```bash",
        f"lm_eval --model hf --model_args pretrained={path},tokenizer={source},"
        "dtype=bfloat16 --tasks wikitext",
        "```",
    ])


def _quality(report: ConversionReport) -> str:
    measured = ["the per-layer approximation figures"]
    if report.calibration:
        measured.append("the whole-model check on the audit windows")
    check = report.verify
    if isinstance(check, Failure):
        measured.append("the built-in check on ? tokens")
    elif check and check.skipped is None:
        measured.append(f"the built-in check on {check.tokens} tokens")
    if report.eval:
        measured.append("the evaluation above")
    return "\n".join([
        "## Quality",
        "",
        f"Quality was measured only by {', '.join(measured[:-1]) + ' and ' if len(measured) > 1 else ''}"
        f"{measured[-1]}. No fine-tuning was done after the conversion, and mlaconv ran no downstream "
        "benchmarks; measure the tasks you care about before relying on this model. The converted model has "
        "not been run on vLLM or SGLang GPUs by mlaconv.",
    ])


def _table(values: dict) -> list[str]:
    lines = ["| key | value |", "|---|---|"]
    lines += [f"| {key} | {_fmt(value)} |" for key, value in values.items()]
    return lines


def _metric(key: str, value) -> str:
    if value is None:
        return "—"
    return f"{value:.2%}" if key in ("top1", "top1_agreement") else f"{value:.4g}"


def _with_error(value: float, error: float | None) -> str:
    return f"{value:.4f}" + (f" ± {error:.4f}" if error is not None else "")


def _fmt(value) -> str:
    """One table cell: numbers compact, None as a dash, containers as JSON; '|' escaped."""
    if value is None:
        text = "—"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False) if value else "—"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")
