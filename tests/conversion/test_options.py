"""One option schema: ConvertOptions declares every option; the CLI flags, the recipe keys and inspect spectra's
settings are derived from it."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields, replace

import pytest
import typer
from typer.testing import CliRunner
import yaml

from mlaconv.cli import app
from mlaconv.conversion.options import ConvertOptions, flags, load_recipe, recipe_types
from mlaconv.errors import MlaconvError
from mlaconv.inspect.spectra import SpectraOptions

# Options only the Python API sets (tests, the bench, the library's own callers).
PYTHON_ONLY = {"delta", "layer_search", "refine_tokens", "refine_batch", "refine_check_every", "recipe",
               "eval_batch_size"}


def command(*path: str):
    group = typer.main.get_command(app)
    for name in path:
        group = group.commands[name]
    return group


def option_fields(cmd) -> set[str]:
    return {p.name for p in cmd.params if p.param_type_name == "option"}


def test_every_option_is_declared_with_a_flag_or_as_python_only():
    declared = {f.name for f in fields(ConvertOptions)}
    assert set(flags()) | PYTHON_ONLY == declared
    assert not set(flags()) & PYTHON_ONLY


def test_convert_takes_exactly_the_declared_flags():
    own = {"recipe", "json_out", "quiet", "debug", "help"}
    cli = {name for name, flag in flags().items() if flag.cli is not None}
    assert option_fields(command("convert")) - own == cli
    spelled = {opt for p in command("convert").params for opt in p.opts}
    assert {"--rank", "-r", "--kv-keep", "--verify", "--shard-size", "--calib-dataset", "--target"} <= spelled


def test_inspect_spectra_takes_the_shared_flags_and_spectra_options_have_their_defaults():
    shared = {name for name, flag in flags().items() if flag.spectra}
    own = {"ranks", "energy", "plot", "csv_out", "refine", "json_out", "quiet", "debug", "help"}
    assert option_fields(command("inspect", "spectra")) - own == shared
    assert set(flags(SpectraOptions)) == shared
    defaults, spectra = ConvertOptions(), SpectraOptions()
    assert all(getattr(spectra, name) == getattr(defaults, name) for name in shared)
    assert SpectraOptions(kv_keep=0.5, calib=["a.txt"]).convert_options().calib == ["a.txt"]


def test_recipe_keys_are_the_options_a_recipe_may_set(tmp_path):
    keys = recipe_types()
    assert {"rank", "kv_keep", "rope_dim", "calib", "calib_batch_size", "target"} <= set(keys)
    assert not {"force", "eval_text", "refine_steps"} & set(keys)  # per-run choices, never a recipe's
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"kv_keep": 0.5, "calib_batch_size": 2, "shard_size": "1MB"}))
    assert load_recipe(path).options == {"kv_keep": 0.5, "calib_batch_size": 2, "shard_size": 10**6}
    path.write_text(yaml.safe_dump({"kv_keep": 0.5, "force": True}))
    with pytest.raises(MlaconvError, match="unknown key 'force'"):
        load_recipe(path)


def test_a_flag_given_on_the_command_line_overrides_the_recipe_and_an_absent_one_does_not(tmp_path, monkeypatch):
    import mlaconv.conversion.run

    seen = {}

    def fake_convert(src, out, options, progress):
        seen["options"] = options
        raise MlaconvError("stop here")

    monkeypatch.setattr(mlaconv.conversion.run, "convert", fake_convert)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"kv_keep": 0.5, "calib_window": 256, "verify": False}))
    result = CliRunner().invoke(app, ["convert", "SRC", "OUT", "--recipe", str(recipe),
                                                    "--calib-window", "512", "--shard-size", "2MB", "--json"])
    assert result.exit_code != 0
    options = seen["options"]
    assert (options.kv_keep, options.calib_window, options.verify, options.shard_size) == (0.5, 512, False, 2 * 10**6)
    assert options.calib_tokens == ConvertOptions().calib_tokens and options.recipe == load_recipe(recipe)


def test_from_recipe_reads_the_recipe_once_and_every_given_override_wins(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"source": "org/model", "kv_keep": 0.5, "calib_tokens": 4096,
                                      "calib_dataset": "wikitext", "verify": False}))
    options = ConvertOptions.from_recipe(recipe, calib_tokens=8192, calib=["mine.txt"], rope_dim=None)
    assert (options.kv_keep, options.calib_tokens, options.verify, options.rope_dim) == (0.5, 8192, False, None)
    assert (options.calib, options.calib_dataset) == (["mine.txt"], None)  # calib given: the recipe's dataset goes
    assert ConvertOptions.from_recipe(recipe, verify=True).verify is True  # an override equal to the default wins
    assert ConvertOptions.from_recipe(recipe).verify is False
    assert (options.recipe.path, options.recipe.source) == (recipe, "org/model")  # the recipe as read, kept
    recipe.write_text(yaml.safe_dump({"rank": 8}))  # the options hold what was read, not the file
    assert options.recipe.options["kv_keep"] == 0.5 and options.kv_keep == 0.5
    # frozen: a copy with changes is made by ``replace`` and keeps what it is given
    with pytest.raises(FrozenInstanceError):
        options.verify = True
    assert replace(options, verify=True).verify is True and options.verify is False
    assert replace(options, kv_keep=None, rank=8).kv_keep is None


def test_a_recipe_path_given_as_the_recipe_option_is_refused(tmp_path):
    """A path is not applied silently (``ConvertOptions(recipe=path)`` once filled the fields left at their
    defaults); the error names ``from_recipe``."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"kv_keep": 0.5}))
    for given in (str(recipe), recipe):
        with pytest.raises(TypeError, match=r"ConvertOptions\.from_recipe\(path, \*\*overrides\)"):
            ConvertOptions(recipe=given, rank=12)


def test_the_command_line_applies_a_recipe_through_from_recipe(tmp_path, monkeypatch):
    import mlaconv.conversion.run

    seen = []

    def fake_convert(src, out, options, progress):
        seen.append((src, options))
        raise MlaconvError("stop here")

    monkeypatch.setattr(mlaconv.conversion.run, "convert", fake_convert)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"source": "org/model", "kv_keep": 0.5, "verify": False,
                                      "calib_dataset": "wikitext"}))
    for extra in ([], ["--verify"], ["--weights-only"]):
        CliRunner().invoke(app, ["convert", "OUT", "--recipe", str(recipe), *extra])
    (src, plain), (_, verified), (_, weights_only) = seen
    assert src == "org/model" and plain == ConvertOptions.from_recipe(recipe)
    assert verified == ConvertOptions.from_recipe(recipe, verify=True)  # a flag at its default still wins
    assert weights_only == ConvertOptions.from_recipe(recipe, weights_only=True) and not weights_only.calibrated
    assert plain.calibrated and weights_only.kv_keep == 0.5
