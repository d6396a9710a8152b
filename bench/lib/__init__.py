"""What the benches share: the repository's paths (``REPO``, ``WORK``), the evaluation helpers (``bench.lib.eval``)
and the result files (``bench.lib.results``). Every bench runs as a module from the repository root, e.g.
``python -m bench.fidelity.run``; mlaconv itself is imported as the installed package."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "bench" / "_work"  # models, checkpoints and scratch outputs of the benches (git-ignored)
RESULTS = REPO / "bench" / "results"  # the figures, one JSON file per bench run (bench/tables.py renders them)
