"""Score converted SmolLM2-135M folders on the development texts: the only texts a default of mlaconv is chosen on.

The real-model bench reports on WikiText-2 and *Moby Dick* (``bench.real.fidelity``), which choose nothing; a
change of a default is chosen on these three texts instead, one narrative, one technical and one of factual history
(``data/README.md``). Each row is one converted folder of ``bench/_work/real`` (named as its fidelity row), scored by
``mlaconv eval perplexity`` against the source on 20 windows of 1,024 tokens of each text; a rerun of a name scores
the texts its row lacks (``--again``: all of them).

    python -m bench.real.dev defaults-50 general2-50
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.lib import RESULTS, WORK
from bench.lib.results import read_result, write_result
from bench.real.build import DEFAULT_OUT as SOURCE

DATA = Path(__file__).resolve().parent / "data"
TEXTS = {"pride_and_prejudice": DATA / "pride_and_prejudice.txt",
         "python_reference": DATA / "python_language_reference.txt",
         "tz_commentary": DATA / "tz_commentary.txt"}
WINDOW, MAX_WINDOWS = 1024, 20
COLUMNS = [["run", "{name}"],
           ["Pride and Prejudice drift", "{pride_and_prejudice[drift]:+.1%}"], ["KL", "{pride_and_prejudice[kl]:.3f}"],
           ["Python reference drift", "{python_reference[drift]:+.1%}"], ["KL", "{python_reference[kl]:.3f}"],
           ["tz history drift", "{tz_commentary[drift]:+.1%}"], ["KL", "{tz_commentary[kl]:.3f}"],
           ["mean KL", "{mean_kl:.3f}"]]
NOTES = ("`mlaconv eval perplexity` in transformers (float32) against the source, 20 windows of 1,024 tokens of each "
         "development text; the converted folders are the fidelity rows' (`real-fidelity.json`, same names).")


def score(folder: Path, row: dict) -> dict:
    """``row`` with the texts it lacks scored on ``folder``, and the mean KL over all texts."""
    from mlaconv.evaluate.perplexity import evaluate_perplexity
    from mlaconv.io.text import TokenSource

    row = dict(row)
    for name, text in TEXTS.items():
        if name in row:
            continue
        report = evaluate_perplexity(folder, SOURCE, source=TokenSource(text=text), window=WINDOW,
                                     max_windows=MAX_WINDOWS)
        row[name] = {"drift": report.drift, "kl": report.kl_per_token, "top1": report.top1_agreement}
    row["mean_kl"] = sum(row[name]["kl"] for name in TEXTS) / len(TEXTS)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="converted folders of bench/_work/real (fidelity row names)")
    parser.add_argument("--again", action="store_true", help="score every text again, not only those a row lacks")
    args = parser.parse_args()
    path = RESULTS / "real-dev.json"
    rows = read_result("real-dev")["rows"] if path.is_file() else []
    for name in args.names:
        folder = WORK / "real" / name
        if not (folder / "config.json").is_file():
            raise SystemExit(f"no converted folder {folder}: run python -m bench.real.fidelity --name {name} first")
        old = next((row for row in rows if row["name"] == name and not args.again), {"name": name})
        rows = [row for row in rows if row["name"] != name] + [score(folder, old)]
        write_result("real-dev", "real", rows, COLUMNS, NOTES,
                     title="SmolLM2-135M conversions on the development texts (what defaults are chosen on)")
        print(name, f"mean KL {rows[-1]['mean_kl']:.3f}")


if __name__ == "__main__":
    main()
