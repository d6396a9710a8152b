"""The code's shape: no import cycle, one layer loop (modules are split by job, not by length)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src"
LAYER_LOOPS = ROOT / "src" / "mlaconv" / "conversion" / "pipeline.py"
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


def runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The mlaconv modules ``path`` imports at run time (lazy imports included; ``if TYPE_CHECKING:`` blocks not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
               for child in block.body for node in ast.walk(child)}
    imported = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                imported.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {name for name in imported if name in known}


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
    known = modules()
    graph = {name: {m for m in runtime_imports(path, known) if m != name and not name.startswith(m + ".")}
             for name, path in known.items()}
    assert "mlaconv.conversion.plan" in graph["mlaconv.conversion.run"]  # the graph is real
    assert cycles(graph) == []


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
    """Only the pipeline's iterators (``source_layers``, ``checkpoint_layers``) loop over a checkpoint's layers, and
    only they advance a ``SourceStreamer``: every step plugs into them."""
    looping, advancing = {}, []
    for path in python_files("src", "bench"):
        if path == LAYER_LOOPS:
            continue
        code = path.read_text(encoding="utf-8")
        if lines := layer_loops(code):
            looping[str(path.relative_to(ROOT))] = lines
        if re.search(r"streamer\.advance\(", code):
            advancing.append(str(path.relative_to(ROOT)))
    assert looping == {}
    assert advancing == []
    assert len(layer_loops(LAYER_LOOPS.read_text(encoding="utf-8"))) == 2  # the finder sees the pipeline's own
