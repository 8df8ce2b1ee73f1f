"""The HF support table: the sweep's rows (``hf_sweep``) rendered into docs/hf_models.md
between its markers, with the counts above it; and the representative subset chosen from
the rows' classes (one architecture per distinct form)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from composer.testing.harness import ROOT
from composer.testing.hf_sweep import SHOWN

PAGE = ROOT / "docs" / "hf_models.md"
BEGIN, END = "<!-- hf sweep: begin -->", "<!-- hf sweep: end -->"
FORMS = ("attention", "norm", "mlp", "moe", "position")


def _reasons(rows: list[dict]) -> dict[str, str]:
    """Each distinct refusal or failure line -> its label (R1.., F1..), in table order."""
    labels: dict[str, str] = {}
    for row in rows:
        for out in row["cells"].values():
            if out["result"] in ("refused", "failed") and out["line"] not in labels:
                kind = "R" if out["result"] == "refused" else "F"
                labels[out["line"]] = f"{kind}{sum(v[0] == kind for v in labels.values()) + 1}"
    return labels


def _cell(out: dict | None, labels: dict[str, str]) -> str:
    if out is None:
        return "-"
    if out["result"] in ("refused", "failed"):
        return f"{out['result']} ({labels[out['line']]})"
    text = f"{out['result']} {out['error']:.0e}"
    if out.get("sequence_parallel") is False:
        text += " (sequence parallel off)"
    return f"{text} (float32: {', '.join(out['float32'])})" if "float32" in out else text


def table(rows: list[dict]) -> str:
    labels = _reasons(rows)
    lines = ["| architecture | " + " | ".join(SHOWN) + " |", "|" + " --- |" * (len(SHOWN) + 1)]
    for row in rows:
        cells = [_cell(row["cells"].get(name), labels) for name in SHOWN]
        lines.append(f"| {row['arch']} | " + " | ".join(cells) + " |")
    lines += ["", "Refusals (R) and failures (F), each line as the run printed it:", ""]
    lines += [f"- {label}: `{line}`" for line, label in labels.items()]
    return "\n".join(lines)


def summary(result: dict) -> str:
    """The counts: listed, built, per layout passing / refused / failed / differing, and
    the worst error of those passing; overrides used; the date, version and wall time."""
    rows = result["rows"]
    built = [row for row in rows if "build" not in row]
    overrides = [row["arch"] for row in rows if row.get("overrides")]
    dates = sorted({row["date"] for row in rows})
    versions = sorted({row["transformers"] for row in rows})
    when = " to ".join(dates[::max(1, len(dates) - 1)])
    out = [f"transformers {', '.join(versions)}, swept {when}"
           f" in {result['seconds'] / 60:.0f} min on 2 CPU cores: {len(rows)} causal-LM "
           f"model types listed, {len(built)} built from their config; per-architecture "
           f"overrides used by {len(overrides)} ({', '.join(overrides)}).", "",
           "| layout | ran | pass | refused | failed | differs | worst error of a pass |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in SHOWN:
        cells = [row["cells"][name] for row in rows if name in row["cells"]]
        counts = Counter(c["result"] for c in cells)
        worst = max((c["error"] for c in cells if c["result"] == "pass"), default=None)
        out.append(f"| {name} | {len(cells)} | {counts['pass']} | {counts['refused']} | "
                   f"{counts['failed']} | {counts['differs']} | "
                   f"{'-' if worst is None else f'{worst:.1e}'} |")
    return "\n".join(out)


def render(result: dict) -> str:
    return f"{BEGIN}\n{summary(result)}\n\n{table(result['rows'])}\n{END}"


def page_with(result: dict, page: str) -> str:
    """``page`` with the text between the markers rendered from ``result``."""
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{render(result)}{tail}"


def write_page(result: dict, page: Path = PAGE) -> None:
    page.write_text(page_with(result, page.read_text()))


def choose_subset(rows: list[dict]) -> list[str]:
    """Fewest architectures (greedily) that between them show every form (``forms``) of
    those that pass on one process and FSDP2, preferring those that pass TP2, then the
    quickest to train (the suite trains them)."""
    def passes(row, name):
        return row["cells"].get(name, {}).get("result") == "pass"

    good = [row for row in rows if passes(row, "1 process") and passes(row, "FSDP2 x2")]
    left = set().union(*(forms(row) for row in good))
    chosen = []
    while left:
        best = max(good, key=lambda row: (len(left & forms(row)), passes(row, "TP2"),
                                          -row.get("seconds", 0)))
        chosen.append(best["arch"])
        left -= forms(best)
    return sorted(chosen)


def forms(row: dict) -> set[tuple[str, str]]:
    """A row's forms, each part of a combined one on its own (``gqa+window``: ``gqa``,
    ``window``): the subset shows each, not each combination."""
    return {(kind, part) for kind in FORMS for part in row["class"][kind].split("+")}
