"""``inspect spectra --refine``: convert's calibrated steps, layer by layer, without writing anything.

The same preparation as ``conversion.run.convert`` (``calibrated.CalibratedPipeline``: the (r, R) split search for
--kv-keep, the refinement plan) and the same ``calibrated.calibrate_layer`` on every layer: the variant kept on the
select windows, its refinement, and both measured on the audit windows. What it adds to the spectra is what
refinement recovers, per layer: the attention error and the rotary figures of the closed form and of the refined
layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaconv.calibration.rotary_audit import RotaryAudit
from mlaconv.calibration.streamer import SourceStreamer
from mlaconv.conversion.calibrated import CalibratedPipeline, RefinementPlan, calibrate_layer
from mlaconv.conversion.pipeline import SourceLayer
from mlaconv.conversion.plan import Plan
from mlaconv.errors import MlaconvError
from mlaconv.mla.layer import LayerReport
from mlaconv.progress import Progress, no_progress
from mlaconv.report.conversion import ShapeSearch
from mlaconv.report.spectra import LayerAudit, LayerRefinement, SpectraRefinement


@dataclass
class RefinementPass:
    streamer: SourceStreamer
    refinement: RefinementPlan
    search: bool  # convert's per-layer variant search
    shape_search: ShapeSearch | None
    layers: list[LayerRefinement] = field(default_factory=list)

    def add(self, source: SourceLayer, plan: Plan, rotary: RotaryAudit) -> None:
        """Layer ``source.index`` through ``calibrate_layer``, as convert runs it."""
        record = calibrate_layer(source, plan, self.search, self.refinement, rotary).record
        self.layers.append(LayerRefinement(source.index, record.selection, layer_audit(record.closed),
                                           layer_audit(record.refined) if record.refined is not None else None))

    def report(self, plan: Plan) -> SpectraRefinement:
        return SpectraRefinement(plan.shapes.rank, plan.shapes.rope_dim, self.shape_search, self.refinement.note,
                                 self.refinement.steps, self.refinement.batch, self.layers)


def start_refinement(plan: Plan, progress: Progress = no_progress) -> tuple[Plan, RefinementPass]:
    """Convert's preparation (``CalibratedPipeline``): the calibration windows, the split search (--kv-keep without
    --rope-dim), the streamer, the refinement plan and the rope stride → the plan at convert's split, and the pass to
    feed each layer to."""
    settings = plan.options
    if settings.kv_keep is None:
        raise MlaconvError("--refine converts each layer at the split convert chooses for a budget: give --kv-keep")
    if not settings.calibrated:
        raise MlaconvError("--refine measures on calibration windows: give --calib or --calib-dataset")
    pipeline = CalibratedPipeline(plan, progress)
    return pipeline.plan, RefinementPass(pipeline.streamer, pipeline.refinement, settings.layer_search,
                                         pipeline.shape_search)


def layer_audit(report: LayerReport) -> LayerAudit:
    score = report.rope_score
    return LayerAudit(report.attention_error, report.energy_retained, report.rope_energy_kept,
                      report.rope_loss_weighted_kept, report.rope_energy_kept_per_frequency, score.compensated,
                      score.uncompensated, score.recovered, score.compensated_per_frequency)
