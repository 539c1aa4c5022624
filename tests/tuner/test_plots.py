"""The benchmark figures (coconet.tuner.plots): plotly figures, written as a page or, through kaleido and the
machine's Chromium, as an image."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from coconet.errors import CoconetError, MissingDependency, NotAvailable
from coconet.tuner import plots


def _point(n: int, best_s: float | None, torch_s: float | None = 4e-3) -> dict:
    result = {"median_s": best_s} if best_s else None
    return {
        "sizes": {"N": n},
        "torch": {"median_s": torch_s} if torch_s else None,
        "results": [{"median_s": 8e-3}],
        "best_gloo": result,
        "best_shm": {"median_s": 1e-3},
        "floor_s": 5e-4,
        "compute_floor_s": 0.0,
        "best_speedup": torch_s / 1e-3 if torch_s else None,
        "best_over_floor": 2.0,
    }


REPORT = {
    "workload": "adam",
    "world": 2,
    "backends": ["gloo", "shm"],
    "kernels": "eager",
    "floor_device": "cpu, 2 cores",
    # the first size has no gloo winner and no torch baseline (both failed): those series start at the second
    "points": [_point(1024, None, None), _point(4096, 2e-3), _point(16384, 3e-3)],
}


def test_the_bench_figure_has_each_series_on_the_sizes_it_has():
    fig = plots.bench_figure(REPORT)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name) == [
        "torch baseline",
        "program as written (gloo)",
        "best schedule, gloo",
        "best schedule, shm",
        "memory-bandwidth floor",
        "best / torch baseline (speed-up)",
        "best / floor (distance)",
    ]
    assert list(by_name["best schedule, gloo"].x) == ["N=4096", "N=16384"]
    assert list(by_name["best schedule, gloo"].y) == [2e-3, 3e-3]
    assert list(by_name["best schedule, shm"].x) == ["N=1024", "N=4096", "N=16384"]
    assert by_name["best / floor (distance)"].xaxis == "x2"
    # a series that starts late must not move the sizes: the axis keeps the report's order
    assert list(fig.layout.xaxis.categoryarray) == ["N=1024", "N=4096", "N=16384"]
    assert fig.layout.yaxis.type == fig.layout.yaxis2.type == "log"
    assert "adam: world 2, gloo+shm, eager kernels (cpu, 2 cores)" in [a.text for a in fig.layout.annotations]


def test_a_page_is_written_without_a_browser(tmp_path):
    path = plots.bench_plot(REPORT, tmp_path / "deep" / "adam.html")
    page = path.read_text()
    assert "<html>" in page[:100] and "Plotly.newPlot" in page and "best schedule, shm" in page
    assert "<script src=" not in page  # plotly's script is inside: the page opens offline
    assert len(page) > 1_000_000


def test_a_path_that_is_neither_a_page_nor_an_image_is_refused(tmp_path):
    with pytest.raises(NotAvailable, match=r"adam\.txt: a plot is written as \.html or as an image"):
        plots.bench_plot(REPORT, tmp_path / "adam.txt")
    assert not (tmp_path / "adam.txt").exists()


@pytest.mark.parametrize("blocked, suffix", [("plotly", "html"), ("kaleido", "png")])
def test_a_missing_package_names_the_bench_extra(monkeypatch, tmp_path, blocked, suffix):
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(MissingDependency, match=rf"needs {blocked}, which coconet\[bench\] installs"):
        plots.bench_plot(REPORT, tmp_path / f"adam.{suffix}")


def test_an_image_without_a_browser_says_so(monkeypatch, tmp_path):
    pytest.importorskip("kaleido", reason="the image export needs kaleido (coconet[bench])")
    monkeypatch.setattr(plots, "chromium", lambda: None)
    with pytest.raises(NotAvailable, match="needs Chromium .* or write .html"):
        plots.bench_plot(REPORT, tmp_path / "adam.png")


def test_a_png_is_written_through_the_machines_chromium(tmp_path):
    pytest.importorskip("kaleido", reason="the PNG export needs kaleido (coconet[bench])")
    plotly = pytest.importorskip("plotly")
    if tuple(int(p) for p in plotly.__version__.split(".")[:2]) < (6, 1):
        pytest.skip(f"plotly {plotly.__version__} cannot drive kaleido 1 (6.1 can; coconet[bench] installs it)")
    if plots.chromium() is None:
        pytest.skip("no Chromium or Chrome on this machine for kaleido to drive (apt-get install chromium)")
    path = plots.bench_plot(REPORT, tmp_path / "adam.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_plotting_stack():
    """The dashboard draws with plotly, and so do the bench figures and the benchmark scripts: nothing imports
    another plotting library."""
    root = Path(__file__).resolve().parents[2]
    sources = [
        p
        for d in ("coconet", "schedules", "codegen", "kernels", "tuner", "server", "benchmarks")
        for p in (root / d).rglob("*.py")
    ]
    importers = [
        str(p.relative_to(root))
        for p in sources
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(n.split(".")[0] in ("matplotlib", "seaborn", "bokeh") for n in _imported(node))
    ]
    assert len(sources) > 100 and importers == []


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]


class _Flaky:
    """A figure whose image export fails the first ``fails`` times, as kaleido's does now and then."""

    def __init__(self, fails: int) -> None:
        self.fails, self.calls = fails, 0

    def write_image(self, path, **size) -> None:
        self.calls += 1
        if self.calls <= self.fails:
            raise RuntimeError("ReferenceError: kaleido_scopes is not defined")
        Path(path).write_bytes(b"\x89PNG")


def test_an_image_export_that_fails_once_is_tried_again(monkeypatch, tmp_path):
    monkeypatch.setattr(plots, "can_write", lambda path: None)  # no browser needed: the figure is a fake
    once = _Flaky(1)
    plots.write_figure(once, tmp_path / "a.png")
    assert once.calls == 2 and (tmp_path / "a.png").exists()
    always = _Flaky(5)
    with pytest.raises(CoconetError, match=r"b\.png: plotly's image export \(kaleido\) failed: ReferenceError"):
        plots.write_figure(always, tmp_path / "b.png")
    assert always.calls == 2
