"""Figures of a benchmark report (``coconet bench --plot``) and the benchmark scripts' figures, drawn with
plotly, the dashboard's plotting library: a ``.html`` path is written as an interactive page (plotly alone),
any other (``.png``, ``.svg``, ``.pdf``) through plotly's static export (kaleido, which drives a Chromium
installed on the machine). Both come with the ``bench`` extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coconet.errors import CoconetError, NotAvailable
from coconet.extras import require

PLOT = ("plotly",)  # what drawing a figure and writing it as a page imports
EXPORT = ("plotly", "kaleido")  # and writing it as an image
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp")
# plotly's default colours, in matplotlib's order of use (C0, C1, ...): the figures keep the colours they had
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def figure(rows: int = 1, cols: int = 1, **subplots: Any) -> Any:
    """An empty plotly figure of ``rows`` x ``cols`` panels (``plotly.subplots.make_subplots``'s keywords),
    white, with a grid: the look the benchmark figures share."""
    require(PLOT, "a plot", extra="bench")
    from plotly.subplots import make_subplots  # plotly: a quarter of a second to import, and an extra

    fig = make_subplots(rows=rows, cols=cols, **subplots)
    fig.update_layout(template="plotly_white", font={"size": 11}, margin={"l": 60, "r": 20, "t": 60, "b": 60})
    return fig


def write_figure(fig: Any, path: Path, *, width: int = 1000, height: int = 450) -> Path:
    """Write ``fig`` to ``path``: an interactive page for ``.html`` (plotly's script inside it, so it opens
    offline), an image otherwise, ``width`` x ``height`` CSS pixels at twice that resolution."""
    path = Path(path)
    can_write(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".html":
        fig.update_layout(width=None, height=height)  # a page fills the window's width
        fig.write_html(path, include_plotlyjs=True, full_html=True)
    else:
        _write_image(fig, path, width, height)
    return path


def _write_image(fig: Any, path: Path, width: int, height: int, tries: int = 2) -> None:
    """``fig.write_image``, tried again once: on a loaded machine kaleido's page now and then runs the export
    before its own script has loaded (a JavascriptError, "kaleido_scopes is not defined"; 1 in 16 exports
    with four at once on 2 cores), and the next try, in a new page, succeeds."""
    for attempt in range(tries):
        try:
            fig.write_image(path, width=width, height=height, scale=2)
            return
        except RuntimeError as e:  # kaleido's JavascriptError is one; its class is private to kaleido
            if attempt == tries - 1:
                raise CoconetError(f"writing {path}: plotly's image export (kaleido) failed: {e}") from e


def can_write(path: Path) -> None:
    """Refuse, naming why, a figure path this install could not write: neither a page nor an image, or an image
    without kaleido, a plotly that drives it, or a browser for it. A benchmark checks before it measures."""
    suffix = path.suffix.lower()
    if suffix != ".html" and suffix not in IMAGE_SUFFIXES:
        raise NotAvailable(f"{path}: a plot is written as .html or as an image ({', '.join(IMAGE_SUFFIXES)})")
    if suffix == ".html":
        require(PLOT, f"writing {path}", extra="bench")
        return
    require(EXPORT, f"writing {path}", extra="bench")
    import plotly  # plotly: a quarter of a second to import, and an extra

    if tuple(int(p) for p in plotly.__version__.split(".")[:2]) < (6, 1):
        raise NotAvailable(
            f"writing {path} needs plotly 6.1 or later (plotly {plotly.__version__} cannot drive kaleido 1): "
            "pip install 'coconet[bench]', or write .html"
        )
    if chromium() is None:
        raise NotAvailable(
            f"writing {path} needs Chromium (or Chrome), which plotly's image export (kaleido) drives, and none "
            "is installed: install it (apt-get install chromium), set $BROWSER_PATH to one, or write .html"
        )


def chromium() -> str | None:
    """The Chromium (or Chrome) kaleido would drive: its path, or None when there is none."""
    require(EXPORT, "writing an image", extra="bench")
    from choreographer.browsers.chromium import Chromium  # kaleido's browser driver; imported with it

    return Chromium.find_browser(skip_local=False)


def bench_plot(report: dict[str, Any], path: Path) -> Path:
    """``coconet bench --plot``: ``bench_figure`` written to ``path`` (``write_figure``)."""
    return write_figure(bench_figure(report), path, width=1200, height=480)


def bench_figure(report: dict[str, Any]) -> Any:
    """``coconet bench``'s figure: step time per size (the baseline, the program as written, the best schedule
    per backend, the floor), and the best's speed-up and its distance to the floor."""
    points = report["points"]
    labels = [",".join(f"{k}={v}" for k, v in p["sizes"].items()) for p in points]
    where = f" ({report['floor_device']})" if report.get("floor_device") else ""
    fig = figure(
        1,
        2,
        subplot_titles=(
            f"{report['workload']}: world {report['world']}, {'+'.join(report['backends'])}, "
            f"{report['kernels']} kernels{where}",
            "ratios",
        ),
    )
    floor = "floor (memory or matmul)" if any(p.get("compute_floor_s") for p in points) else "memory-bandwidth floor"
    series = {
        "torch baseline": [p["torch"]["median_s"] if p["torch"] else None for p in points],
        f"program as written ({report['backends'][0]})": [p["results"][0]["median_s"] for p in points],
        **{
            f"best schedule, {b}": [p[f"best_{b}"]["median_s"] if p.get(f"best_{b}") else None for p in points]
            for b in report["backends"]
        },
        floor: [p["floor_s"] for p in points],
    }
    symbols = ["circle", "square"] + ["triangle-up", "triangle-down", "diamond"][: len(report["backends"])]
    for i, (name, ys) in enumerate(series.items()):
        last = name == floor
        _line(fig, labels, ys, name, 1, "x" if last else symbols[i], "black" if last else COLOURS[i % 8], last)
    _line(
        fig,
        labels,
        [p["best_speedup"] for p in points],
        "best / torch baseline (speed-up)",
        2,
        "triangle-up",
        COLOURS[0],
    )
    _line(fig, labels, [p["best_over_floor"] for p in points], "best / floor (distance)", 2, "x", "black", True)
    fig.add_hline(y=1.0, line={"color": "grey", "width": 1}, row=1, col=2)
    fig.update_yaxes(type="log", title_text="step time (s), median", row=1, col=1)
    fig.update_yaxes(type="log", title_text="ratio (log)", row=1, col=2)
    # the sizes in the report's order, whichever series has a point at each
    fig.update_xaxes(tickangle=20, categoryorder="array", categoryarray=labels)
    fig.update_annotations(font_size=12)
    return fig


def _line(
    fig: Any, x: list, ys: list, name: str, col: int, symbol: str, colour: str | None = None, dotted: bool = False
) -> None:
    """One series of ``bench_plot``, its missing points (a failed or absent run) left out."""
    import plotly.graph_objects as go  # loaded by ``figure`` already: the figure exists

    pts = [(xi, y) for xi, y in zip(x, ys) if y]
    if not pts:
        return
    line = {"dash": "dot"} if dotted else {"dash": "dash"} if symbol == "square" else {}
    if colour:
        line["color"] = colour
    fig.add_trace(
        go.Scatter(
            x=[p[0] for p in pts],
            y=[p[1] for p in pts],
            name=name,
            mode="lines+markers",
            marker={"symbol": symbol, "size": 8},
            line=line,
        ),
        row=1,
        col=col,
    )
