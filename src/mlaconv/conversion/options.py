"""The conversion's options, declared once, and the recipe files that set them.

``ConvertOptions`` is the single source: each field's ``Flag`` says how the ``convert`` command spells it, whether
a recipe may set it (and with which YAML types), and whether ``inspect spectra`` shares it. The command-line flags
(``cli_parameters``), the recipe keys (``recipe_types``) and ``SpectraOptions``' conversion settings are derived
from these fields; nothing lists the options a second time.

A recipe (``recipes/*.yaml``) is a flat YAML file of those keys, plus ``source`` (the hub id it was written for, an
informational default) and ``kv_cache`` (the KV cache per token before and after, informational, and checked
against the computed values by ``plan.check_recipe`` so that a recipe cannot lie). ``load_recipe`` reads and
type-checks one; ``merge_options`` overlays the command-line values (explicit values win);
``ConvertOptions.from_recipe`` applies a recipe, read once: the options keep the loaded ``Recipe``.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from mlaconv.devices import default_device
from mlaconv.errors import MlaconvError
from mlaconv.io.writer import DEFAULT_SHARD_BYTES
from mlaconv.mla.latent_norm import DEFAULT_DELTA
from mlaconv.mla.refine import CHECK_EVERY, REFINE_BATCH
from mlaconv.target.targets import DEFAULT_TARGET


@dataclass(frozen=True)
class Flag:
    """How one option is given outside Python."""

    help: str
    cli: type | None = None  # the flag's value type on the command line (None: not a flag)
    names: tuple[str, ...] = ()  # default: --field-name
    recipe: tuple[type, ...] = ()  # YAML types a recipe may give (empty: not a recipe key)
    spectra: bool = False  # ``inspect spectra`` takes it too
    parse: Callable[[Any], Any] | None = None  # command-line text → field value


def option(default: Any = None, help: str = "", cli: type | None = None, *, names: tuple[str, ...] = (),
           recipe: tuple[type, ...] = (), spectra: bool = False, parse: Callable[[Any], Any] | None = None,
           factory: Callable[[], Any] | None = None):
    flag = Flag(help, cli, names, recipe, spectra, parse)
    if factory is not None:
        return field(default_factory=factory, metadata={"flag": flag})
    return field(default=default, metadata={"flag": flag})


def _size(text: str) -> int:
    from mlaconv.io import parse_size

    return parse_size(text)


@dataclass(frozen=True)
class ConvertOptions:
    """Every setting of a conversion, fixed once made (a recipe is applied by ``from_recipe``)."""

    rank: int | None = option(None, "Latent rank r (kv_lora_rank).", int, names=("--rank", "-r"), recipe=(int,))
    kv_keep: float | None = option(None, "Fraction of the source KV cache to keep, in (0, 1]; picks r and R.", float,
                                   recipe=(float, int), spectra=True)
    rope_dim: int | None = option(None, "Shared RoPE key dims R (qk_rope_head_dim); default min(64, the rotary "
                                        "dims), with --kv-keep at most half the budget.", int,
                                  recipe=(int,), spectra=True)
    rope_stride: int | None = option(None, "Keep source frequencies 0, s, 2s, … (default: chosen from the weights).",
                                     int, recipe=(int,), spectra=True)
    dtype: str | None = option(None, "Output dtype: float32 or bfloat16 (default: the source's).", str, recipe=(str,))
    shard_size: int = option(DEFAULT_SHARD_BYTES, "Largest output shard, e.g. 5GB (default) or 500MB.", str,
                             recipe=(int, str), parse=_size)
    force: bool = option(False, "Replace OUT if it exists.", bool)
    verify: bool = option(True, "Compare OUT with the source through AutoModelForCausalLM (default on).", bool,
                          names=("--verify/--no-verify",), recipe=(bool,))
    verify_windows: int = option(4, "Windows the built-in check runs (default 4).", int, recipe=(int,))
    verify_window: int = option(128, "Tokens per check window (default 128).", int, recipe=(int,))
    allow_sliding_window: bool = option(False, "Convert a sliding-window model with full attention.", bool,
                                        recipe=(bool,), spectra=True)
    delta: float = DEFAULT_DELTA
    revision: str | None = option(None, "Hub revision when SRC is a hub id.", str, recipe=(str,), spectra=True)
    calib: list[str] = option(help="Calibration text file (or .jsonl of token ids); repeatable (default: mlaconv's "
                                   "bundled general text, for a source with a tokenizer).", cli=list[str],
                              recipe=(list,), spectra=True, factory=list)
    weights_only: bool = option(False, "Convert from the weights alone, ignoring any calibration data or a recipe's "
                                       "(minutes instead of hours; exact at full rank, fine for shapes, speed and "
                                       "tests, but broken at a real cut of a pretrained model: SmolLM2-135M at half "
                                       "its KV cache goes from perplexity 24.5 to 3,905 on WikiText-2).",
                                bool, names=("--weights-only/--no-weights-only",), recipe=(bool,))
    calib_dataset: str | None = option(None, "Calibration from a Hugging Face dataset NAME[:CONFIG[:SPLIT]] (local "
                                             "cache when offline).", str, recipe=(str,), spectra=True)
    calib_tokens: int = option(65536, "Calibration tokens (default 65536).", int, recipe=(int,), spectra=True)
    calib_window: int = option(2048, "Calibration window length (default 2048, capped at the context).", int,
                               recipe=(int,), spectra=True)
    context: int | None = option(None, "The longest context the output will serve (default: the source's "
                                       "max_position_embeddings): --kv-keep's split folds into the latent only rotary "
                                       "frequencies that turn little over it.", int, recipe=(int,))
    calib_batch_size: int = option(4, "Calibration windows per forward batch.", recipe=(int,))
    device: str | None = option(None, "Where calibration and refinement run (default: cuda when torch sees a GPU, else "
                                      "cpu), and, when given, the --eval-* evaluation too: cpu, cuda, cuda:1 …", str,
                                recipe=(str,), spectra=True)
    layer_search: bool = True  # calibrated: keep, per layer, the variant with the least measured error
    refine_steps: int | None = option(None, "With calibration: gradient steps per layer on its measured attention "
                                            "error, kept only if it measures better on held-out windows (default: 150 "
                                            "steps of 8 windows on CUDA, or on a CPU where that is estimated within "
                                            "--refine-minutes; else as many steps of 1 window as fit in them, at least "
                                            "25, else none; 0 = closed form only).", int, spectra=True)
    refine_minutes: float = option(30.0, "On a CPU, the default refinement's time budget by estimate, in minutes (more "
                                         "steps of 1 window fit in a longer one, up to the full plan's 1200 "
                                         "windows, and fit each layer closer to the source).", float, recipe=(float, int))
    calib_sequential: str | None = option(None, "Choose and refine each layer on the inputs the converted layers before "
                                                "it produce, towards the source's attention outputs (outputs) or its "
                                                "residual stream (residual); default off.", str, recipe=(str,))
    refine_tokens: int = 48 * 2048  # the fit windows those steps train on hold at most this many tokens: every fit
    # window of the default calibration and of the recipes' 64 × 2048; the cap bounds the source outputs held for
    # them (tokens·H·4 bytes). More training windows measured better on the audit windows (bench/refine/README.md, issue 16)
    refine_batch: int = REFINE_BATCH  # windows per step when refine_steps is given (the default plan chooses its own)
    refine_check_every: int = CHECK_EVERY  # steps between select-window measurements when refine_steps is given
    heal_tokens: int | None = option(None, "Heal the converted model (`mlaconv heal`): train its attention tensors end "
                                           "to end towards the source on this many tokens of the calibration data "
                                           "(default: 4 per calibration token, on a CPU at most what fits in 30 min; "
                                           "0: off).", int, recipe=(int,))
    heal_window: int | None = option(None, "Tokens per healing window (default 512; at most --calib-window); each step "
                                           "trains on 2048 tokens, so fewer windows per step when they are longer.",
                                     int, recipe=(int,))
    heal_written: int | None = option(None, "Tokens of text the source writes itself (sampled from it, seeded) that "
                                            "healing trains on beside the calibration data (default: 65,536, at "
                                            "most as many as the calibration tokens it trains on; 0: none).",
                                      int, recipe=(int,))
    heal_lr_schedule: str | None = option(None, "Healing's step through training: constant, or linear (falling "
                                                "from its start to 0; default linear).", str, recipe=(str,))
    heal_precision: str | None = option(None, "What healing's forward passes multiply in: float32, or bfloat16 (the "
                                              "trained tensors stay float32; default bfloat16 where the device "
                                              "computes it natively, else float32).", str, recipe=(str,))
    heal_position_span: int | None = option(None, "Place each healing window at positions spread over this many, "
                                                  "in two chunks with a seeded skip between (PoSE), so short "
                                                  "windows train long distances (default 4,096, or the served context "
                                                  "where shorter; 0: none).", int,
                                            recipe=(int,))
    absorbed: bool = option(False, "Also write absorbed inference weights (W^UK in the query, W^UV in o_proj) to "
                                   "OUT/absorbed.", bool)
    recipe: Recipe | None = None  # the recipe applied (``from_recipe``), which the plan checks against the source
    eval_text: str | None = option(None, "After converting, run `mlaconv eval perplexity` on this text file against "
                                         "the source.", str)
    eval_dataset: str | None = option(None, "… or on this dataset (wikitext = WikiText-2 raw test).", str)
    eval_tokens: str | None = option(None, "… or on these token ids (JSON lines of input_ids).", str)
    eval_window: int | None = option(None, "Evaluation window (default 2048 or the context).", int)
    eval_max_windows: int | None = option(None, "Evaluate at most this many windows.", int)
    eval_batch_size: int = 1
    eval_retrieval: str | None = option(None, "After converting, run `mlaconv eval retrieval` (passkey) at these lengths "
                                              "against the source, e.g. 1k,2k,4k.", str, recipe=(str,))
    target: str = option(DEFAULT_TARGET, "Serving target: portable (default: the same function on transformers, vLLM, "
                                         "SGLang and llama.cpp: no bias tensors, a rope_scaling they all compute, and "
                                         "with --kv-keep an r + R vLLM runs where the budget holds one), transformers "
                                         "(biases and the source's rope_scaling kept), vllm (as portable, refusing "
                                         "shapes vLLM does not run), sglang, llamacpp.", str, recipe=(str,))

    def __post_init__(self) -> None:
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise TypeError(f"ConvertOptions(recipe={self.recipe!r}): apply a recipe file with "
                            "ConvertOptions.from_recipe(path, **overrides)")

    @classmethod
    def from_recipe(cls, path: str | Path, **overrides) -> "ConvertOptions":
        """The options a ``recipes/*.yaml`` file sets, with ``overrides`` (not None) winning, as on the command line
        (also an override equal to the field's default)."""
        recipe = load_recipe(path)
        return cls(**merge_options(recipe.options, overrides), recipe=recipe)

    @property
    def evaluated(self) -> bool:
        return any((self.eval_text, self.eval_dataset, self.eval_tokens))

    @property
    def calibration_device(self) -> str:
        """Where calibration and refinement run: the given device, else the GPU when torch sees one."""
        return self.device or default_device()

    @property
    def calibrated(self) -> bool:
        """Calibrated unless --weights-only: on the data given, else on the bundled general text (``Plan``)."""
        return not self.weights_only

    @property
    def calibration_given(self) -> bool:
        return bool(self.calib or self.calib_dataset)


def flags(cls: type = ConvertOptions) -> dict[str, Flag]:
    """Field name → its ``Flag``, for the fields of ``cls`` that have one, in declaration order."""
    return {f.name: f.metadata["flag"] for f in fields(cls) if "flag" in f.metadata}


def shared(name: str):
    """A field of another options class that means what ``ConvertOptions.<name>`` means: its default and its flag."""
    declared = {f.name: f for f in fields(ConvertOptions)}[name]
    if not declared.metadata["flag"].spectra:
        raise ValueError(f"{name} is not an option inspect spectra shares")
    if declared.default_factory is not MISSING:
        return field(default_factory=declared.default_factory, metadata=declared.metadata)
    return field(default=declared.default, metadata=declared.metadata)


def recipe_types() -> dict[str, tuple[type, ...]]:
    """The keys a recipe may set, with the YAML types each accepts."""
    return {name: flag.recipe for name, flag in flags().items() if flag.recipe}


def cli_parameters(only_spectra: bool = False) -> list[inspect.Parameter]:
    """Typer parameters for the command-line flags of ``ConvertOptions`` (those ``inspect spectra`` shares, with
    ``only_spectra``). Every flag but --force defaults to None, so that only a flag actually given overrides a recipe
    value or the option's own default (``given_options``)."""
    import typer

    parameters = []
    for name, flag in flags().items():
        if flag.cli is None or (only_spectra and not flag.spectra):
            continue
        default = False if name == "force" else None  # --force is a plain switch: a recipe cannot set it
        names = flag.names or ("--" + name.replace("_", "-"),)
        annotation = flag.cli if default is not None else Optional[flag.cli]
        parameters.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation,
                                            default=typer.Option(default, *names, help=flag.help)))
    return parameters


def given_options(values: dict[str, Any]) -> dict[str, Any]:
    """The ``ConvertOptions`` fields among command-line ``values`` that were given (not None, not an empty list),
    each parsed as its flag says."""
    declared = flags()
    given = {}
    for name, value in values.items():
        if name not in declared or value is None or value == []:
            continue
        parse = declared[name].parse
        given[name] = parse(value) if parse is not None else value
    return given


COMMON_FLAGS = ("json_out", "quiet", "debug")  # every command's own flags, listed after the options


def with_options(parameters: list[inspect.Parameter]) -> Callable[[Callable], Callable]:
    """Decorate a command so that Typer sees ``parameters`` after its own: the command receives them in ``**kwargs``."""
    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        common = next((k for k, p in enumerate(own) if p.name in COMMON_FLAGS), len(own))  # --json etc. go last
        ordered = own[:common] + parameters + own[common:]
        command.__signature__ = signature.replace(parameters=ordered)
        command.__annotations__ = {p.name: p.annotation for p in ordered}
        return command

    return decorate


# ------------------------------------------------------------------------------------------- recipe files


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: the convert options it sets and its informational fields."""

    path: Path
    options: dict  # ConvertOptions field → value (shard_size in bytes, calib paths resolved)
    source: str | None = None
    kv_cache: dict | None = None


INFORMATIONAL_KEYS = ("source", "kv_cache")
KV_CACHE_KEYS = {
    "elements_per_token_per_layer": ("source", "converted"),
    "bytes_per_token": ("source", "converted"),
}
# Options that name the same choice: a command-line value for one removes the recipe's other.
ALTERNATIVES = {"rank": "kv_keep", "kv_keep": "rank", "calib": "calib_dataset", "calib_dataset": "calib"}


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

    options, types = {}, recipe_types()
    for key, value in data.items():
        if key in INFORMATIONAL_KEYS:
            continue
        if key not in types:
            known = ", ".join([*types, *INFORMATIONAL_KEYS])
            raise MlaconvError(f"{label}: unknown key {key!r} (known: {known})")
        if value is None:
            continue
        options[key] = _typed(label, key, value, types[key])
    if ("rank" in options) == ("kv_keep" in options):
        raise MlaconvError(f"{label} must set exactly one of rank and kv_keep")
    if "kv_keep" in options:
        options["kv_keep"] = float(options["kv_keep"])
    if isinstance(options.get("shard_size"), str):
        options["shard_size"] = _size(options["shard_size"])
    if "calib" in options:
        options["calib"] = [str(_under(path.parent, _typed(label, "calib entry", item, (str,))))
                            for item in options["calib"]]

    source = data.get("source")
    if source is not None and not isinstance(source, str):
        raise MlaconvError(f"{label}: source must be a string (a hub id), got {type(source).__name__}")
    return Recipe(path=path, options=options, source=source, kv_cache=_kv_cache_block(label, data.get("kv_cache")))


def merge_options(recipe_options: dict, cli_options: dict) -> dict:
    """Recipe options overlaid with the command-line values that are not None.

    ``rank`` and ``kv_keep`` are one choice, as are ``calib`` and ``calib_dataset``: a command-line
    value for one drops the recipe's value for the other.
    """
    given = {key: value for key, value in cli_options.items() if value is not None}
    merged = {key: value for key, value in recipe_options.items() if ALTERNATIVES.get(key) not in given}
    merged.update(given)
    return merged


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
    for group, entries in block.items():
        if group not in KV_CACHE_KEYS:
            raise MlaconvError(f"{label}: unknown key kv_cache.{group!r} (known: {', '.join(KV_CACHE_KEYS)})")
        if not isinstance(entries, dict):
            raise MlaconvError(f"{label}: kv_cache.{group} must be a mapping with {' and '.join(KV_CACHE_KEYS[group])}")
        for name, value in entries.items():
            if name not in KV_CACHE_KEYS[group]:
                raise MlaconvError(f"{label}: unknown key kv_cache.{group}.{name!r} "
                                   f"(known: {', '.join(KV_CACHE_KEYS[group])})")
            _typed(label, f"kv_cache.{group}.{name}", value, (int,))
        checked[group] = dict(entries)
    return checked
