"""``ConversionReport``: what ``mlaconv.convert`` returns and writes to ``OUT/mlaconv.json``, with its sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaconv.report.evaluation import EvalReport, RetrievalReport
from mlaconv.report.record import Failure, Record, WindowSets, optional


@dataclass
class SourceShape(Record):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    layers_without_rope: list[int]


@dataclass
class KVFigures(Record):
    source: int
    converted: int


@dataclass
class EnergyFigures(Record):
    per_layer: list[float]
    mean: float


@dataclass
class LatentNorm(Record):
    eps: float
    delta: float
    max_bound: float


@dataclass
class Serving(Record):
    """What each stack reproduces (``{biases_kept, rope_scaling_exact}``), the MLA kernels the shapes fit."""

    transformers: dict[str, bool]
    vllm: dict[str, bool]
    sglang: dict[str, bool]
    kernels: dict[str, bool]
    warnings: list[str]


@dataclass
class TargetReport(Record):
    name: str
    engines: list[str]
    biases_written: bool
    biases_left_out: list[str]
    rope_rewrite: dict | None
    note: str | None


@dataclass
class SplitCandidate(Record):
    kv_lora_rank: int
    qk_rope_head_dim: int
    mean_attention_error: float


@dataclass
class ShapeSearch(Record):
    candidates: list[SplitCandidate]
    chosen: str | None
    windows: dict[str, list[int]] | None = optional()
    refine_steps: int | None = optional()  # each split's refinement steps before the comparison (0: none)
    context: int | None = optional()  # the served context the splits were held to (``calibrated.served_candidates``)


@dataclass
class RefinementOutcome(Record):
    before: float
    after: float
    kept: bool


@dataclass
class LayerSelection(Record):
    """One layer's choices on the select windows: each variant's attention error, the one kept, the refinement's."""

    variants: dict[str, float]
    kept: str
    refinement: RefinementOutcome | None = None


@dataclass
class LayerFigures(Record):
    """Per-layer audit figures of one whole model (None where it has no layer of its own)."""

    attention_error: list[float | None]
    energy_retained: list[float | None]
    key_error: list[float | None]
    value_error: list[float | None]
    layer_variant: list[str | None]
    objective_retained: list[float | None]
    rope_energy_kept: list[float | None]  # from the layer's own rotated weights (docs/report.md)
    rope_loss_weighted_kept: list[float | None]
    rope_score_loss: list[float | None]


@dataclass
class Agreement(Record):
    kl: float
    top1: float


@dataclass
class WholeModel(Record):
    windows: int
    tokens: int
    closed_form: Agreement = field(metadata={"key": "closed form"})
    refined: Agreement | None
    written: str
    reason: str


@dataclass
class Calibration(Record):
    windows: int
    window: int
    tokens: int
    window_sets: WindowSets
    refine_steps: int
    refine_batch: int
    refinement: str
    selection: list[LayerSelection]
    closed_form: LayerFigures
    refined: LayerFigures
    whole_model: WholeModel
    refine_queries: int | None = optional()  # positions of each window a step's error is taken at (None: all)
    refine_windows: int | None = optional()  # fit windows the steps draw from (when steps run)
    sequential: str | None = optional()  # --calib-sequential: what each layer was chosen and refined towards


@dataclass
class Verification(Record):
    """The built-in check: transformers' figures and each engine's (``engines``), or why it was ``skipped``."""

    max_abs_logit_diff: float | None = optional()
    max_rel_logit_diff: float | None = optional()
    kl: float | None = optional()
    top1: float | None = optional()
    dtype: str | None = optional()
    windows: int | None = optional()
    tokens: int | None = optional()
    loader: str | None = optional()
    engines: dict[str, dict] | None = optional()
    skipped: str | None = optional()


@dataclass
class Verdict(Record):
    """Close, degraded or broken (``mlaconv.evaluate.verdict``), the figures and the measurement it rests on; "none" where no
    measurement was made."""

    level: str
    basis: str
    message: str
    kl: float | None = optional()
    top1: float | None = optional()


@dataclass
class HealFigures(Record):
    """A model against its source on the healing's held-out windows (``eval perplexity``'s figures)."""

    drift: float | None
    kl: float | None
    top1: float | None
    tokens: int


@dataclass
class HealReport(Record):
    """What ``mlaconv heal`` did (docs/report.md, "convert.heal")."""

    source: str
    calibration_data: str
    window: int
    batch: int
    lr: float
    top_k: int
    device: str
    trained: list[str]
    tokens: int
    steps: int
    best_step: int
    data_window: int  # the windows of the data the next three index, each cut into ``window``-token chunks
    train_windows: list[int]
    select_windows: list[int]
    held_out_windows: list[int]
    select_kl_before: float
    select_kl_after: float
    curve: list[list[float]]
    held_out_before: HealFigures
    held_out_after: HealFigures
    latent_bound: float
    rescaled_layers: list[int]
    estimated_seconds: float
    seconds: float
    written_windows: int = 0  # windows the source wrote itself (``heal.generate``), trained on beside the train windows
    lr_schedule: str = "constant"  # ``heal.distill.SCHEDULES``; reports older than the key healed at a constant step
    position_span: int | None = None  # training windows spread over this many positions (``heal --position-span``)
    precision: str = "float32"  # what the forward passes multiplied in (``heal.distill.PRECISIONS``); reports older than
    # the key healed in float32
    recompute: bool = False  # each layer recomputed in the backward pass (a window's activations over half the free
    # memory: ``heal.distill.RECOMPUTE_SHARE``)
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = optional()


@dataclass
class Absorbed(Record):
    folder: str
    tensors: int
    max_relative_nonlinearity: float


@dataclass
class ConversionReport(Record):
    """What ``mlaconv.convert`` returns and writes to ``OUT/mlaconv.json`` (docs/report.md, "convert")."""

    mlaconv_version: str
    transformers_version: str
    output: str
    source: str
    source_id: str | None
    source_revision: str | None
    settings: dict
    architecture: str
    source_shape: SourceShape
    recipe: str | None
    mode: str
    dtype: str
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    shape_choice: str
    rope_theta: float
    rope_stride: int
    kv_elements_per_token_per_layer: KVFigures
    kv_bytes_per_token: KVFigures
    kv_keep: float
    energy_retained: EnergyFigures
    rope_energy_kept: list[float]
    rope_energy_kept_mean: float
    rope_energy_kept_per_frequency: list[list[float]]
    rope_loss_weighted_kept: list[float]
    key_error: list[float]
    attention_error: list[float | None]
    layer_variant: list[str]
    value_error: list[float]
    objective_retained: list[float | None]
    latent_norm: LatentNorm
    residual_scale: float
    source_rms_norm_eps: float
    dropped_bias: list[str]
    tokenizer_files: list[str]
    serving: Serving
    target: TargetReport
    shape_search: ShapeSearch | None = optional()
    calibration_data: str | None = optional()  # what it was calibrated on, or why not
    calibration: Calibration | None = optional()
    verify: Verification | Failure | None = None
    eval: EvalReport | Failure | None = optional()
    retrieval: RetrievalReport | Failure | None = optional()
    verdict: Verdict | None = optional()
    heal: HealReport | Failure | None = optional()
    absorbed: Absorbed | None = optional()
    seconds: float | None = optional()
