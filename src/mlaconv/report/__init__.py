"""The reports of the measuring commands, typed: ``ConversionReport`` (``convert``, ``OUT/mlaconv.json``),
``SpectraReport`` (``inspect spectra``), ``EvalReport`` (``eval perplexity``) and ``RetrievalReport``
(``eval retrieval``).

Each is a dataclass whose fields are its JSON keys, in order (docs/report.md lists them); ``to_json()`` gives the
object ``--json`` prints and ``from_json`` reads one back. Sections of a fixed shape are dataclasses of their own;
the rest (option settings, per-engine figures, per-variant errors) stay dicts.
"""

from mlaconv.report.conversion import ConversionReport
from mlaconv.report.evaluation import EvalReport, RetrievalReport
from mlaconv.report.spectra import SpectraReport

__all__ = ["ConversionReport", "EvalReport", "RetrievalReport", "SpectraReport"]
