"""Recipes: plain YAML files of ``mlaconv convert`` settings for a known source model.

A recipe is flat: its keys are the ``mlaconv convert`` option names with dashes turned into
underscores (``rank`` or ``kv_keep``, ``rope_dim``, ``dtype``, ``calib_dataset``, …), plus
``source`` (the hub id it was written for, an informational default) and ``kv_cache`` (the KV
cache per token before and after, informational, and checked against the computed values so that
a recipe cannot lie). ``recipes/*.yaml`` ships one per supported model size.

Use: ``recipe = load_recipe(path)``, ``check_recipe(recipe, spec)`` against the source model,
then ``merge_options(recipe.options, cli_options)`` (explicit command-line values win).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from mlaconv.arch import SourceSpec
from mlaconv.conversion import Shapes, output_dtype, plan_shapes
from mlaconv.errors import MlaconvError
from mlaconv.io import parse_size
from mlaconv.mla import rope

# Recipe keys that become ConvertOptions fields, with the YAML types each accepts.
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "kv_keep": (float, int),
    "rope_dim": (int,),
    "rope_stride": (int,),
    "dtype": (str,),
    "shard_size": (int, str),
    "calib": (list,),
    "calib_dataset": (str,),
    "calib_tokens": (int,),
    "calib_window": (int,),
    "calib_batch_size": (int,),
    "device": (str,),
    "verify": (bool,),
    "verify_windows": (int,),
    "verify_window": (int,),
    "allow_sliding_window": (bool,),
    "revision": (str,),
    "target": (str,),
}
INFORMATIONAL_KEYS = ("source", "kv_cache")
KV_CACHE_KEYS = {
    "elements_per_token_per_layer": ("source", "converted"),
    "bytes_per_token": ("source", "converted"),
}
# Options that name the same choice: a command-line value for one removes the recipe's other.
ALTERNATIVES = {"rank": "kv_keep", "kv_keep": "rank", "calib": "calib_dataset", "calib_dataset": "calib"}


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: the convert options it sets and its informational fields."""

    path: Path
    options: dict  # ConvertOptions field → value (shard_size in bytes, calib paths resolved)
    source: str | None = None
    kv_cache: dict | None = None


def load_recipe(path: str | Path) -> Recipe:
    """Read and type-check a recipe file; raise a one-line ``MlaconvError`` for anything wrong in it.

    Relative ``calib`` file paths are taken relative to the recipe's folder.
    """
    path = Path(path)
    label = f"recipe {path.name}"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MlaconvError(f"cannot read {label}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise MlaconvError(f"{label} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise MlaconvError(f"{label} must be a mapping of option names to values")

    options = {}
    for key, value in data.items():
        if key in INFORMATIONAL_KEYS:
            continue
        if key not in OPTION_TYPES:
            known = ", ".join([*OPTION_TYPES, *INFORMATIONAL_KEYS])
            raise MlaconvError(f"{label}: unknown key {key!r} (known: {known})")
        if value is None:
            continue
        options[key] = _typed(label, key, value, OPTION_TYPES[key])
    if ("rank" in options) == ("kv_keep" in options):
        raise MlaconvError(f"{label} must set exactly one of rank and kv_keep")
    if "kv_keep" in options:
        options["kv_keep"] = float(options["kv_keep"])
    if isinstance(options.get("shard_size"), str):
        options["shard_size"] = parse_size(options["shard_size"])
    if "calib" in options:
        options["calib"] = [str(_under(path.parent, _typed(label, "calib entry", item, (str,))))
                            for item in options["calib"]]

    source = data.get("source")
    if source is not None and not isinstance(source, str):
        raise MlaconvError(f"{label}: source must be a string (a hub id), got {type(source).__name__}")
    return Recipe(path=path, options=options, source=source, kv_cache=_kv_cache_block(label, data.get("kv_cache")))


def check_recipe(recipe: Recipe, spec: SourceSpec) -> Shapes:
    """Refuse a recipe whose shapes do not fit ``spec`` or whose ``kv_cache`` block is wrong; return the shapes.

    The shapes are planned by ``mlaconv.conversion.plan_shapes``, the code the conversion runs.
    """
    o = recipe.options
    prefix = f"recipe {recipe.path.name} does not fit {describe_model(spec)}"
    try:
        shapes = plan_shapes(spec, o.get("rank"), o.get("kv_keep"), o.get("rope_dim"))
        dtype = output_dtype(spec, o.get("dtype"))
    except MlaconvError as exc:
        raise MlaconvError(f"{prefix}: {exc}") from None
    stride = o.get("rope_stride")
    if stride is not None and stride not in rope.strides(spec.rotary_dim, shapes.rope_dim):
        raise MlaconvError(f"{prefix}: rope_stride {stride} does not fit {shapes.rope_dim} rope dims in "
                           f"{'head_dim' if spec.rotary_dim == spec.head_dim else 'the rotary dims'} {spec.rotary_dim}")
    if recipe.kv_cache:
        computed = kv_cache_figures(spec, shapes, dtype)
        for group, fields in recipe.kv_cache.items():
            for name, value in fields.items():
                if value != computed[group][name]:
                    raise MlaconvError(f"{prefix}: kv_cache.{group}.{name} says {value}, the shapes give "
                                       f"{computed[group][name]}")
    return shapes


def kv_cache_figures(spec: SourceSpec, shapes: Shapes, dtype: torch.dtype) -> dict:
    """The ``kv_cache`` block a recipe should carry: per token per layer, and bytes per token over all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    source, converted = spec.kv_elements_per_token_per_layer, shapes.rank + shapes.rope_dim
    return {
        "elements_per_token_per_layer": {"source": source, "converted": converted},
        "bytes_per_token": {"source": source * spec.num_layers * element,
                            "converted": converted * spec.num_layers * element},
    }


def merge_options(recipe_options: dict, cli_options: dict) -> dict:
    """Recipe options overlaid with the command-line values that are not None.

    ``rank`` and ``kv_keep`` are one choice, as are ``calib`` and ``calib_dataset``: a command-line
    value for one drops the recipe's value for the other.
    """
    given = {key: value for key, value in cli_options.items() if value is not None}
    merged = {key: value for key, value in recipe_options.items() if ALTERNATIVES.get(key) not in given}
    merged.update(given)
    return merged


def describe_model(spec: SourceSpec) -> str:
    """A short name for a source model, from its shapes (config.json rarely names the model)."""
    return (f"this {spec.family.label} model ({spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.num_heads} heads, {spec.num_kv_heads} KV heads × {spec.head_dim})")


def _typed(label: str, key: str, value, types: tuple[type, ...]):
    # bool is an int in Python; a YAML true/false is never a number here.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        wanted = " or ".join("a list" if t is list else t.__name__ for t in types)
        raise MlaconvError(f"{label}: {key} must be {wanted}, got {value!r}")
    return value


def _under(folder: Path, name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else folder / path


def _kv_cache_block(label: str, block) -> dict | None:
    if block is None:
        return None
    if not isinstance(block, dict):
        raise MlaconvError(f"{label}: kv_cache must be a mapping")
    checked = {}
    for group, fields in block.items():
        if group not in KV_CACHE_KEYS:
            raise MlaconvError(f"{label}: unknown key kv_cache.{group!r} (known: {', '.join(KV_CACHE_KEYS)})")
        if not isinstance(fields, dict):
            raise MlaconvError(f"{label}: kv_cache.{group} must be a mapping with {' and '.join(KV_CACHE_KEYS[group])}")
        for name, value in fields.items():
            if name not in KV_CACHE_KEYS[group]:
                raise MlaconvError(f"{label}: unknown key kv_cache.{group}.{name!r} "
                                   f"(known: {', '.join(KV_CACHE_KEYS[group])})")
            _typed(label, f"kv_cache.{group}.{name}", value, (int,))
        checked[group] = dict(fields)
    return checked
