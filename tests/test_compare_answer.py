"""``llmeff compare`` answers on the terminal (the headline table), and every report lists the best
configuration first (the trial: report.md listed it last, the order the runs were made)."""

from __future__ import annotations

import csv
import io

from click.testing import CliRunner

from mlflow_llmeff import names

# the five standard runs (tests/five_runs.py), four configurations by tokens/s per device, best first:
# grad-accum 4 (47,500), the default and its evals repeat (42,358 = mean of 42,816 and 41,900),
# 2-process DDP (61,000 / 2 = 30,500), llama-160m (1,950)
BEST_FIRST = ["llama-tiny-cpu-1x-single-fp32-s128-gbt4096", "llama-tiny-cpu-1x-single-fp32-s128-gbt1024 (+1 repeat)",
              "llama-tiny-cpu-2x-ddp-fp32-s128-gbt2048", "llama-160m-cpu-1x-single-fp32-s128-gbt1024"]


def _compare(tmp_path):
    import mlflow

    from five_runs import log_five_runs
    from mlflow_llmeff.cli import main

    log_five_runs(mlflow.MlflowClient(), "five")
    r = CliRunner().invoke(main, ["compare", "--experiment", "five", "--out", str(tmp_path / "o")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output, tmp_path / "o"


def _order(text: str) -> list[str]:
    return sorted(BEST_FIRST, key=text.index)


def test_compare_prints_the_headline_table_best_first(tracking_uri, tmp_path):
    out, _ = _compare(tmp_path)
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("configuration "))
    assert lines[head].split()[:3] == ["configuration", "devices", "layout"]
    rows = lines[head + 2:head + 6]
    assert [r[:len(b)] for r, b in zip(rows, BEST_FIRST)] == BEST_FIRST
    # a single run carries the machine's between-run floor (+-81% on CPU, docs/stability.md), not its own
    # interval: the default's repeats and the 2-process run (30,500) are within noise of it
    assert "47,500 [9,025, 85,975] floor" in rows[0] and "best (2 within noise)" in rows[0]
    assert "0.0411x best" in rows[3]  # 1,950 / 47,500


def test_report_md_and_html_list_the_best_configuration_first(tracking_uri, tmp_path):
    _, folder = _compare(tmp_path)
    md = (folder / "report.md").read_text()
    # the cells' '*' marker keeps its character in the footnote (unescaped, '- * MFU' is a nested bullet)
    assert "\n- \\* MFU against the measured matmul peak of the device" in md
    answer = md[md.index("## Configurations"):md.index("## All runs")]
    assert _order(answer) == BEST_FIRST
    html = (folder / "report.html").read_text()
    table = html[html.index("<table id='headline'"):html.index("</table>", html.index("<table id='headline'"))]
    assert _order(table) == BEST_FIRST
    # every run, in the same order: the best configuration's repeats first (newest first within one)
    runs = ["llama-tiny-cpu-1x-single-fp32-s128-gbt4096", "llama-tiny-cpu-1x-single-fp32-s128-gbt1024-2",
            "llama-tiny-cpu-1x-single-fp32-s128-gbt1024", "llama-tiny-cpu-2x-ddp-fp32-s128-gbt2048",
            "llama-160m-cpu-1x-single-fp32-s128-gbt1024"]
    assert [row["run"] for row in csv.DictReader(io.StringIO((folder / "report.csv").read_text()))] == runs
    all_runs = md[md.index("## All runs"):]
    assert [ln.split("[")[1].split("]")[0] for ln in all_runs.splitlines() if ln.startswith("| [")] == runs


def _records():
    """Seven runs: three configurations (tokens/s per device 30, 20, 10; the middle one has three
    repeats) and one FAILED run without summary figures, newest first."""
    from mlflow_llmeff.report.calc import RunRecord

    def run(i, tps, model, status="FINISHED"):
        metrics = {} if tps is None else {names.SUM_TOKENS_PER_SEC: tps, names.SUM_DEVICE_TOKENS_PER_SEC: tps}
        return RunRecord(f"id{i}", f"r{i}", status, "1", metrics, {names.MODEL_NAME: model, names.ACCEL_COUNT: "1",
                                                                   names.STABILITY: "stable"}, {})

    return [run(0, None, "x", "FAILED"), run(1, 10.0, "c"), run(2, 20.0, "b"), run(3, 21.0, "b"), run(4, 30.0, "a"),
            run(5, 19.0, "b"), run(6, 11.0, "c")]


def test_the_pages_runs_table_shows_the_first_runs_and_says_how_many_of_how_many():
    from mlflow_llmeff.report.render import build_report, to_csv, to_html, to_markdown
    from mlflow_llmeff.report.source import Selection

    rep = build_report(None, Selection("1", "seven", "", _records()), group_by="model.name", plots=False)
    page = to_html(rep, max_runs=3, rest_html="<a href='?all_runs=1'>every run</a>")
    assert "All runs: 3 of 7 runs shown x " in page
    note = page[page.index("<p class='warn' id='runs-shown'>"):].split("</p>")[0]
    assert note.endswith("3 of 7 runs shown (the best configuration's repeats first, in report.csv's order); 1 of "
                         "the runs not shown is unfinished or without summary figures. Every run: "
                         "<a href='?all_runs=1'>every run</a>.")
    # the best configuration (a: 30) then b's repeats (20, 21, 19 in the selection's order)
    assert [row.split("'")[0] for row in page.split("data-run-id='")[1:]] == ["id4", "id2", "id3"]
    # the files keep every run, the unfinished one last
    rows = list(csv.DictReader(io.StringIO(to_csv(rep))))
    assert [row["run_id"] for row in rows] == ["id4", "id2", "id3", "id5", "id1", "id6", "id0"]
    assert sum(ln.startswith("| [") or ln.startswith("| **[") for ln in to_markdown(rep).splitlines()) == 7
    whole = to_html(rep)  # report.html: every run, nothing to say
    assert "All runs: 7 runs x " in whole and whole.count("data-run-id=") == 7 and "runs-shown" not in whole


def test_configurations_without_the_figure_come_last_in_their_order():
    from mlflow_llmeff.report.calc import RunRecord
    from mlflow_llmeff.report.render import best_first
    from mlflow_llmeff.report.repeats import configurations

    def run(i, tps=None, model="m"):
        metrics = {names.SUM_TOKENS_PER_SEC: 1.0}
        if tps is not None:
            metrics[names.SUM_DEVICE_TOKENS_PER_SEC] = tps
        return RunRecord(f"r{i}", f"r{i}", "FINISHED", "1", metrics,
                         {names.MODEL_NAME: model, names.ACCEL_COUNT: "1"}, {})

    configs = configurations([run(0, None, "a"), run(1, 10.0, "b"), run(2, None, "c"), run(3, 30.0, "d")])
    assert [c.tag(names.MODEL_NAME) for c in best_first(configs)] == ["d", "b", "a", "c"]


def test_a_filter_with_backticks_is_one_code_span_in_report_md():
    # a study's printed filter, tags.`llmeff.study.parent` = '...', fenced with one backtick broke the line
    from mlflow_llmeff.report.render import _md_code, build_report, to_markdown
    from mlflow_llmeff.report.source import Selection

    query = "tags.`llmeff.study.parent` = 'p1'"
    rep = build_report(None, Selection("1", "seven", query, _records()), group_by="model.name", plots=False)
    assert "Filter: `` tags.`llmeff.study.parent` = 'p1' ``\n" in to_markdown(rep)
    assert _md_code("a``b") == "``` a``b ```" and _md_code("plain = 'x'") == "`plain = 'x'`"
