"""The ``inspect spectra`` report's keys, types and list lengths, as docs/report.md ("spectra") documents them."""

from __future__ import annotations

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
