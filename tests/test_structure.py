"""The code's shape: layers that import only downwards, no import cycle, one layer loop per kind of checkpoint
(modules are split by job, not by length)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT

SRC = ROOT / "src"
# The layers of ``src/mlaconv``, lowest first: a module imports only from its own package and from the layers below
# its own, never from a layer above it nor from another package of its own layer (``TYPE_CHECKING`` imports count).
# A package or top-level module is named by its first name under ``mlaconv`` (``mlaconv`` itself: the root).
LAYERS: list[tuple[str, ...]] = [
    ("mlaconv", "errors"),  # the version and lazy public API; the one error type
    ("progress", "devices"),  # progress callbacks; the dtypes and devices mlaconv computes in
    ("io", "mla", "report"),  # bytes on disk and through transformers; the pure math; the typed report records
    ("source",),  # the source checkpoint: its spec, the family table, its tensor names and weights
    ("target",),  # the DeepSeek-V3 output: format, layout writer, serving targets and engines, absorb, GGUF
    ("calibration", "evaluate", "runtime"),  # the source run on windows; measuring an output; the latent decoder
    ("heal",),  # end-to-end distillation of a converted folder
    ("conversion",),  # options and recipes, plan, the layer pass, the steps, the run and its report
    ("inspect",),  # inspect spectra (it plans and calibrates as a conversion does)
    ("cli",),  # the command line
    ("__main__",),
]
# The layer loops (``test_one_layer_loop``): the one pass over a source's layers and the one over a converted
# checkpoint's, with the iterators every step plugs into.
LAYER_LOOPS = {ROOT / "src" / "mlaconv" / "conversion" / "pipeline.py": 1,
               ROOT / "src" / "mlaconv" / "target" / "deepseek.py": 1}
# What a loop body does to a checkpoint's layers: reads them (a reader, a read_… function, the source's weights, the
# calibration streamer, a layer's tensor names) or writes them (a writer).
CHECKPOINT_ACCESS = re.compile(r"\breader\b|\bread_\w*\(|\bweights\.\w+\(|\bstreamer\b|\blayer_prefix\(|\.layer\(|"
                               r"\bwriter\.add\(")
PIPELINE_ITERATORS = re.compile(r"\b(source_layers|checkpoint_layers)\(")


def python_files(*folders: str) -> list[Path]:
    """The .py files under ``folders`` of the repository, scratch folders (``_work``, ``.venv``, …) left out."""
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py")
                  if not any(part.startswith(("_", ".")) for part in path.relative_to(ROOT).parts[:-1]))


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The mlaconv modules ``path`` imports: at the top, lazily inside functions, and under ``if TYPE_CHECKING:``
    (a type-only import is an edge too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                imported.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {name for name in imported if name in known}


def import_graph() -> dict[str, set[str]]:
    """Module → the mlaconv modules it imports (a package's own ``__init__`` left out of its modules' edges)."""
    known = modules()
    return {name: {m for m in imports(path, known) if m != name and not name.startswith(m + ".")}
            for name, path in known.items()}


def package(module: str) -> str:
    """The layer entry a module belongs to: its first name under ``mlaconv`` (``mlaconv`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_index(layers: list[tuple[str, ...]]) -> dict[str, int]:
    return {name: i for i, layer in enumerate(layers) for name in layer}


def wrong_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Each import that goes up a layer, or sideways to another package of the same layer, as
    ``importer → imported (why)``."""
    level = layer_index(layers)
    found = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            a, b = package(importer), package(target)
            if a == b:
                continue
            if level[b] > level[a]:
                found.append(f"{importer} → {target} (up: {a} is below {b})")
            elif level[b] == level[a]:
                found.append(f"{importer} → {target} (sideways: {a} and {b} are one layer)")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    graph = import_graph()
    assert "mlaconv.conversion.plan" in graph["mlaconv.conversion.run"]  # the graph is real
    assert cycles(graph) == []


def test_every_package_has_its_layer():
    declared = [name for layer in LAYERS for name in layer]
    assert len(declared) == len(set(declared))
    assert {package(name) for name in modules()} == set(declared)


def test_the_layer_checker_catches_an_upward_import():
    """A planted graph: io importing the conversion (up), mla importing io (sideways), and what is allowed (down,
    within a package, type-only or not: the finder counts those, see ``test_the_import_finder_counts_type_only``)."""
    layers = [("errors",), ("io", "mla"), ("conversion",)]
    graph = {"mlaconv.errors": set(), "mlaconv.io.reader": {"mlaconv.errors", "mlaconv.conversion.plan"},
             "mlaconv.io.writer": {"mlaconv.io.reader"}, "mlaconv.mla.rope": {"mlaconv.io.writer"},
             "mlaconv.conversion.plan": {"mlaconv.io.reader", "mlaconv.mla.rope", "mlaconv.errors"}}
    assert wrong_imports(graph, layers) == [
        "mlaconv.io.reader → mlaconv.conversion.plan (up: io is below conversion)",
        "mlaconv.mla.rope → mlaconv.io.writer (sideways: mla and io are one layer)"]
    del graph["mlaconv.io.reader"], graph["mlaconv.mla.rope"]
    assert wrong_imports(graph, layers) == []


def test_the_import_finder_counts_type_only_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from mlaconv.conversion.plan import Plan\ndef f():\n    import mlaconv.io.reader\n")
    known = {"mlaconv.conversion.plan": Path(), "mlaconv.io.reader": Path()}
    assert imports(module, known) == {"mlaconv.conversion.plan", "mlaconv.io.reader"}


def test_layers_import_only_downwards():
    assert wrong_imports(import_graph(), LAYERS) == []


def layer_loops(code: str) -> list[int]:
    """Lines of the loops that iterate a checkpoint's layers to read, convert or write them: ``for`` statements and
    comprehensions over the layers (``range(spec.num_layers)``, ``enumerate(layers)``, …; the pipeline's own
    iterators excepted) whose body reads or writes layer tensors (``CHECKPOINT_ACCESS``). A loop over a model's
    modules (a forward pass) or one that only names tensors (a header check) is none."""
    loops = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.For):
            iterable, body = node.iter, node.body
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            iterable = node.generators[0].iter
            body = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        else:
            continue
        if over_layers(iterable) and not PIPELINE_ITERATORS.search(ast.unparse(iterable)) and \
                CHECKPOINT_ACCESS.search("\n".join(ast.unparse(part) for part in body)):
            loops.append(node.lineno)
    return loops


def over_layers(iterable: ast.expr) -> bool:
    """Whether the loop runs over layers: the iterable takes a name (or key) of layers as a whole (``spec.num_layers``,
    ``enumerate(layers)``, ``config["num_hidden_layers"]``), not one of its attributes (``layers.items()``)."""
    attribute_owners = {id(node.value) for node in ast.walk(iterable) if isinstance(node, ast.Attribute)}
    for node in ast.walk(iterable):
        if isinstance(node, ast.Name) and id(node) not in attribute_owners:
            name = node.id
        elif isinstance(node, ast.Attribute) and id(node) not in attribute_owners:
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if "layers" in name:
            return True
    return False


def test_the_layer_loop_finder_finds_layer_loops():
    found = ["for i in range(spec.num_layers):\n    attention = read_attention(reader, spec, i)",
             "for i in range(layers_total):\n    layers.append(get(deepseek.layer_prefix(i) + 'x'))",
             "for i, mla in enumerate(layers):\n    output.layer(i, {'baseline': mla})",
             "for i in range(n_layers):\n    streamer.advance(i, weights.attention(i))",
             "entries = [Entry(layer_prefix(i)) for i in range(s.layers)]",
             "for i in range(int(config['num_hidden_layers'])):\n    x = reader.get(f'model.layers.{i}.w')"]
    not_found = ["for layer in source_layers(reader, spec):\n    print(reader)",
                 "for i, layer in enumerate(self.layers):\n    h = h + absorbed_attention(layer.attention, x)",
                 "for i in range(self.num_layers):\n    expected.update({layer_name(i, k): 1 for k in keys})",
                 "flags = [int((i + 1) % interval != 0) for i in range(layers)]",
                 "for c, layer in layers.items():\n    errors[c] += streamer.attention_error(layer)"]
    assert [bool(layer_loops(code)) for code in found + not_found] == [True] * len(found) + [False] * len(not_found)


def test_one_layer_loop():
    """Only the pipeline's iterators (``source_layers`` over a source, ``checkpoint_layers`` over a converted
    checkpoint) loop over a checkpoint's layers, and only ``source_layers`` advances a ``SourceStreamer``: every step
    plugs into them."""
    looping, advancing = {}, []
    for path in python_files("src", "bench"):
        code = path.read_text(encoding="utf-8")
        if path in LAYER_LOOPS:
            assert len(layer_loops(code)) == LAYER_LOOPS[path], path  # the finder sees the iterators' own
            continue
        if lines := layer_loops(code):
            looping[str(path.relative_to(ROOT))] = lines
        if re.search(r"streamer\.advance\(", code):
            advancing.append(str(path.relative_to(ROOT)))
    assert looping == {}
    assert advancing == []
