"""MkDocs hooks (mkdocs.yml `hooks:`), run by every build:

- the benchmark plots, drawn with matplotlib from the result tables committed on the benchmark
  pages (docs/benchmarks/results.md: the tables `bench/bench_zero.py` writes to
  bench/results/latest.md; more.md: `bench/bench_zeropp.py`'s), added to the site as generated
  files (PNGs are not committed);
- the command-line reference: `zeroshard <command> --help` of each command, put in place of the
  `<!-- cli-help -->` comment of docs/reference/cli.md;
- lists written as GitHub renders them (the pages were the README): a list may follow its
  paragraph without a blank line and nests by 2 spaces, where Python-Markdown wants a blank line
  and 4 spaces. The hook adds both before rendering; the sources stay as they are.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent
PLOTS = {  # site path -> function drawing it
    "benchmarks/img/step-time.png": "step_time",
    "benchmarks/img/peak-memory.png": "peak_memory",
    "benchmarks/img/zeropp.png": "zeropp",
}


# -- the result tables -----------------------------------------------------------------------------
def table_after(text: str, heading: str) -> list[dict[str, str]]:
    """The first markdown table after the heading line starting with `heading`, as dicts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    head, body = rows[0], [r for r in rows[2:]]
    return [dict(zip(head, r)) for r in body]


def _num(cell: str) -> float:
    return float(re.sub(r"[^\d.]", "", cell.replace("**", "")))


def peer_results() -> dict[str, list[dict[str, str]]]:
    text = (DOCS / "benchmarks" / "results.md").read_text(encoding="utf-8")
    return {"small (3.3 M parameters)": table_after(text, "## small:"),
            "large (57 M parameters)": table_after(text, "## large:")}


def _color(impl: str) -> str:
    if impl.startswith("zeroshard"):
        return "#2b7bba"
    if impl.startswith("deepspeed"):
        return "#d9822b"
    if impl.startswith("fsdp2"):
        return "#5a9e4b"
    return "#8c8c8c"


def _bars(column: str, xlabel: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = peer_results()
    fig, axes = plt.subplots(1, len(sizes), figsize=(11, 5), constrained_layout=True)
    for ax, (size, rows) in zip(axes, sizes.items()):
        rows = [r for r in rows if r.get(column, "").strip() not in ("", "—", "FAILED")]
        names = [r["impl"] for r in rows]
        _barh(ax, names, [_num(r[column]) for r in rows], [_color(n) for n in names], xlabel)
        ax.set_title(size)
    fig.suptitle("bench/bench_zero.py, 2 CPU ranks, fp32 AdamW (zeroshard blue, DeepSpeed "
                 "orange, FSDP2 green, torch DDP / ZeRO optimizer grey)", fontsize=9)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _barh(ax, names: list[str], values: list[float], colors: list[str], xlabel: str) -> None:
    """Horizontal bars, first row on top, each labelled with its value."""
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:g}", va="center", fontsize=8)
    ax.margins(x=0.15)


def step_time(path) -> None:
    _bars("step ms", "step time, ms (median; lower is better)", path)


def peak_memory(path) -> None:
    _bars("peak RSS MiB/rank", "peak RSS per rank, MiB (lower is better)", path)


def zeropp_results() -> list[dict[str, str]]:
    text = (DOCS / "benchmarks" / "more.md").read_text(encoding="utf-8")
    return table_after(text, "### Results with qgZ's cross-host exchange overlapping backward")


def zeropp(path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in zeropp_results() if re.fullmatch(r"[\d.]+", r["step ms"])]
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, column, label in ((axes[0], "step ms", "step time, ms"),
                              (axes[1], "inter-host MB/step (wire)", "inter-host MB per step")):
        _barh(ax, names, [_num(r[column]) for r in rows],
              ["#d9822b" if "deepspeed" in n else "#2b7bba" for n in names],
              label + " (lower is better)")
    fig.suptitle("bench/bench_zeropp.py: stage 3 and ZeRO++ on 2 simulated hosts x 2 ranks, "
                 "1 Gbit/s link", fontsize=9)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


# -- the command line ------------------------------------------------------------------------------
def cli_help() -> str:
    os.environ.setdefault("COLUMNS", "100")
    from zeroshard.cli import COMMANDS, main

    parts = []
    for argv in ([], *([c] for c in COMMANDS)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main([*argv, "--help"])
        title = "zeroshard " + " ".join(argv) if argv else "zeroshard"
        parts += [f"### `{title} --help`", "", "```text", out.getvalue().rstrip(), "```", ""]
    return "\n".join(parts)


# -- GitHub-style lists ---------------------------------------------------------------------------
_ITEM = re.compile(r"^( *)([-*+]|\d+\.) ")


def gfm_lists(markdown: str) -> str:
    """Blank line before a list that follows a paragraph; list-internal indentation doubled."""
    out: list[str] = []
    fence = in_list = False
    for line in markdown.split("\n"):
        if line.lstrip(" ").startswith("```"):
            fence = not fence
            out.append(line)
            continue
        if fence:
            out.append(line)
            continue
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        item = _ITEM.match(line)
        if not stripped:
            out.append(line)
            continue
        if item and indent == 0:
            if not in_list and out and out[-1].strip() and not out[-1].lstrip().startswith(("<!--", "|")):
                out.append("")
            in_list = True
        elif indent == 0 and (not out or not out[-1].strip()):
            in_list = False           # a paragraph after a blank line ends the list
        if in_list and indent:
            line = " " * (2 * indent) + stripped
        out.append(line)
    return "\n".join(out)


# -- MkDocs events ---------------------------------------------------------------------------------
def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, name in PLOTS.items():
        buf = io.BytesIO()
        globals()[name](buf)
        files.append(File.generated(config, uri, content=buf.getvalue()))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "reference/cli.md" and "<!-- cli-help -->" in markdown:
        markdown = markdown.replace("<!-- cli-help -->", cli_help())
    return gfm_lists(markdown)
