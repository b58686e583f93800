"""llmeff compare: the pure calculators (hand-checked numbers), the report files, and one-line errors."""

from __future__ import annotations

import csv
import io

import pytest
from click.testing import CliRunner

from mlflow_llmeff import names
from mlflow_llmeff.report.calc import (RunRecord, comparability_warnings, header, metric_columns, pareto_front,
                                       round_sig)
from mlflow_llmeff.report.scaling import scaling_efficiency

BASE_TAGS = {names.ACCEL_SHORT: "cpu", names.ACCEL_NAME: "Test CPU", names.PRECISION: "fp32",
             names.MODEL_NAME: "llama-tiny", names.SEQ_LEN: "128", names.MICRO_BATCH_SIZE: "8",
             names.GRAD_ACCUM: "1", names.ACT_CKPT: "false", names.COMPILE: "false", names.DATASET: "python-docs",
             names.FLOPS_FORMULA: "megatron", names.PEAK_SOURCE: "datasheet X", names.V_LLMEFF: "0.1.0"}


def rec(run_id, devices, tps, *, strategy=None, gbt=None, mbs="8", **tags):
    t = {**BASE_TAGS, names.ACCEL_COUNT: str(devices), names.MICRO_BATCH_SIZE: mbs,
         names.PAR_STRATEGY: strategy or ("single" if devices == 1 else "ddp"),
         names.GLOBAL_BATCH_TOKENS: str(gbt if gbt is not None else 128 * int(mbs) * devices), **tags}
    return RunRecord(run_id, f"run-{run_id}", metrics={names.SUM_TOKENS_PER_SEC: tps,
                                                       names.SUM_DEVICE_TOKENS_PER_SEC: tps / devices}, tags=t)


# ------------------------------------------------------------------------------------- calculators
@pytest.mark.parametrize("x, digits, expected", [(1234.5678, 4, 1235.0), (0.000123456, 3, 0.000123),
                                                 (-98765.0, 2, -99000.0), (0.0, 4, 0.0)])
def test_round_sig_keeps_significant_digits(x, digits, expected):
    assert round_sig(x, digits) == expected


def test_round_sig_rejects_zero_digits():
    with pytest.raises(ValueError, match="digits=0"):
        round_sig(1.0, 0)


def test_headers_carry_units():
    assert header(names.SUM_TOKENS_PER_SEC) == "summary/tokens_per_sec [tokens/s]"
    assert header("ttq/val_loss_le_2.0_usd") == "ttq/val_loss_le_2.0_usd [USD]"
    assert header(names.SUM_COST_USD) == "summary/cost_usd [USD]"
    # per-billion-token figures say so (the trial read "[kg CO2e]" on a per-1e9-token column)
    assert header(names.SUM_ESTIMATE_KG_CO2E_PER_BTOK) == \
        "summary/estimate_kg_co2e_per_billion_tokens [kg CO2e/1e9 tokens]"
    assert header(names.SUM_USD_PER_BTOK) == "summary/usd_per_billion_tokens [USD/1e9 tokens]"


def test_metric_columns_are_summary_in_names_order_then_ttq():
    r = RunRecord("a", "a", metrics={names.SUM_GOODPUT: 0.9, "ttq/x_ge_1_usd": 2.0, names.SUM_TOKENS_PER_SEC: 1.0,
                                     "train/loss": 3.0})
    assert metric_columns([r]) == [names.SUM_TOKENS_PER_SEC, names.SUM_GOODPUT, "ttq/x_ge_1_usd"]


def test_final_eval_figures_are_columns_even_when_only_some_runs_evaluated():
    # the trial: two runs, one evaluated during training -> its last HellaSwag acc_norm and val loss
    # are columns (before ttq); the other run's cells stay empty; per-subject MMLU keys are no column
    evaluated = RunRecord("a", "evaluated", metrics={names.SUM_TOKENS_PER_SEC: 10.0, names.EVAL_HELLASWAG_ACC_NORM: 0.25,
                                                      names.EVAL_VAL_LOSS: 2.5, "eval/mmlu_anatomy/acc": 0.3,
                                                      "ttq/val_loss_le_3.0_usd": 0.01})
    plain = RunRecord("b", "plain", metrics={names.SUM_TOKENS_PER_SEC: 12.0})
    cols = metric_columns([plain, evaluated])
    assert cols == [names.SUM_TOKENS_PER_SEC, names.EVAL_VAL_LOSS, names.EVAL_HELLASWAG_ACC_NORM,
                    "ttq/val_loss_le_3.0_usd"]
    assert header(names.EVAL_HELLASWAG_ACC_NORM) == "eval/hellaswag/acc_norm [fraction]"


def test_weak_scaling_efficiency_hand_computed():
    # same micro-batch per device: 1000 tokens/s on 1, 1800 on 2, 3000 on 4 devices
    rows = scaling_efficiency([rec("a", 1, 1000.0), rec("b", 2, 1800.0), rec("c", 4, 3000.0)])
    assert [(r.run_id, r.baseline_id, r.kind, round(r.efficiency, 3)) for r in rows] == [
        ("b", "a", "weak", 0.9), ("c", "a", "weak", 0.75)]


def test_a_failed_run_is_never_a_baseline_and_same_device_counts_give_no_scaling_row():
    # the trial's case: a diverged FAILED run (with a summary, 3764 tokens/s) listed first on 1 device
    import dataclasses

    failed = dataclasses.replace(rec("x", 1, 3764.0), status="FAILED")
    rows = scaling_efficiency([failed, rec("a", 1, 1000.0), rec("b", 2, 1800.0)])
    assert [(r.run_id, r.baseline_id, round(r.efficiency, 3)) for r in rows] == [("b", "a", 0.9)]
    assert not failed.comparable and rec("a", 1, 1000.0).comparable


def test_strong_scaling_is_named_when_the_global_batch_is_the_same():
    rows = scaling_efficiency([rec("a", 1, 1000.0, gbt=2048, mbs="16"), rec("b", 2, 1900.0, gbt=2048, mbs="8")])
    assert len(rows) == 1 and rows[0].kind == "strong" and rows[0].efficiency == pytest.approx(0.95)


def test_baseline_choice_changes_the_reference():
    rows = scaling_efficiency([rec("a", 1, 1000.0), rec("b", 2, 1800.0), rec("c", 4, 3000.0)], baseline="b")
    # c against b: 3000 / (1800 * 4 / 2) = 0.8333; a against b: 1000 / (1800 / 2) = 1.111
    assert {r.run_id: round(r.efficiency, 4) for r in rows} == {"a": 1.1111, "c": 0.8333}


def test_runs_that_differ_in_more_than_device_count_are_not_scaled_together():
    rows = scaling_efficiency([rec("a", 1, 1000.0), rec("b", 2, 1800.0, **{names.PRECISION: "bf16"})])
    assert rows == []


@pytest.mark.parametrize("baseline, match", [("zzz", "'zzz' is not among the compared runs; accepted: 'a', 'b'$")])
def test_unknown_baseline_is_one_line(baseline, match):
    with pytest.raises(ValueError, match=match):
        scaling_efficiency([rec("a", 1, 1000.0), rec("b", 2, 1800.0)], baseline=baseline)


def test_an_unknown_baseline_names_the_accepted_run_ids_ten_then_how_many_more():
    runs = [rec(f"r{i:02d}", 1 + i % 2, 1000.0 + i) for i in range(12)] + [rec("slow", 1, 0.0)]
    with pytest.raises(ValueError) as e:
        scaling_efficiency(runs, baseline="deadbeef")
    assert str(e.value) == ("--baseline 'deadbeef' is not among the compared runs; accepted: "
                            + ", ".join(f"'r{i:02d}'" for i in range(10)) + " and 2 more")
    with pytest.raises(ValueError) as e:  # a compared run without tokens/s: not accepted, and said so
        scaling_efficiency(runs[:2] + [runs[-1]], baseline="slow")
    assert str(e.value) == ("--baseline 'slow' has no summary/tokens_per_sec or device count; accepted: 'r00', 'r01'")


def test_pareto_front_hand_example():
    # (usd per Btok: less is better, tokens/s: more is better)
    pts = [(10.0, 100.0), (5.0, 80.0), (12.0, 90.0), (5.0, 80.0), (20.0, 150.0), (float("nan"), 999.0)]
    # (12, 90) is dominated by (10, 100); the duplicate (5, 80) points are both kept; NaN never on the front
    assert pareto_front(pts, maximize_x=False, maximize_y=True) == [1, 3, 0, 4]


@pytest.mark.parametrize("tag, what, figure", [(names.FLOPS_FORMULA, "FLOPs convention", names.SUM_DEVICE_TFLOPS),
                                               (names.PEAK_SOURCE, "peak source", names.SUM_MFU),
                                               (names.DATASET, "dataset", None)])
def test_runs_differing_in_a_measurement_condition_are_not_comparable(tag, what, figure):
    a, b = rec("a", 1, 1000.0, **{tag: "8"}), rec("b", 1, 1000.0, **{tag: "16"})
    for r in (a, b):
        if figure:
            r.metrics[figure] = 0.5
    warns = comparability_warnings([a, b])
    assert [w.what for w in warns] == [what]
    assert warns[0].text() == f"not comparable: {what} ({tag}) differs: 8 (run-a); 16 (run-b)"


def test_runs_of_different_lengths_are_not_comparable_on_goodput():
    # a trial pooled a 50-step run (goodput 0.12) and two 300-step ones (0.51) as one configuration
    runs = [rec(i, 1, 1000.0) for i in "abc"]
    for r, steps, goodput in zip(runs, (50, 300, 300), (0.12, 0.51, 0.51)):
        r.metrics[names.SUM_STEPS], r.metrics[names.SUM_GOODPUT] = float(steps), goodput
    w, = comparability_warnings(runs)
    assert w.text() == ("not comparable: run length (optimizer steps) (summary/steps) differs: 50 (run-a); "
                        "300 (run-b, run-c)")
    # equal lengths: no warning, whichever path logged them (a trial: only the Trainer logs max_steps,
    # so a max_steps condition called the plain loop's 8 steps 'unknown' beside the Trainer's 8)
    runs[0].metrics[names.SUM_STEPS] = 300.0
    runs[1].params["max_steps"] = "300"
    assert comparability_warnings(runs) == []
    for r in runs:  # no goodput compared: the length changes no figure the runs have
        del r.metrics[names.SUM_GOODPUT]
    assert comparability_warnings(runs) == []


def test_a_condition_that_changes_no_figure_the_runs_have_is_no_warning():
    # a peak source matters where MFU against it is compared; CPU runs without a datasheet MFU: no warning
    a, b = rec("a", 1, 1000.0, **{names.PEAK_SOURCE: "x"}), rec("b", 1, 1000.0, **{names.PEAK_SOURCE: "y"})
    assert comparability_warnings([a, b]) == []


def test_like_runs_give_no_warning():
    assert comparability_warnings([rec("a", 1, 1000.0), rec("b", 2, 1900.0)]) == []


# ------------------------------------------------------------------------------------- against a store
def log_run(client, exp_id, name, devices, tps, *, summary=True, status="FINISHED", **tags):
    t = {**BASE_TAGS, names.ACCEL_COUNT: str(devices), names.PAR_STRATEGY: "single" if devices == 1 else "ddp",
         names.GLOBAL_BATCH_TOKENS: str(1024 * devices), **tags}
    run = client.create_run(exp_id, run_name=name, tags=t)
    rid = run.info.run_id
    for step, loss in ((5, 4.0), (10, 3.5)):
        client.log_metric(rid, names.TRAIN_LOSS, loss, step=step, timestamp=1_000_000 + step * 1000)
        client.log_metric(rid, names.TRAIN_TOKENS, step * 1024.0 * devices, step=step)
    if summary:
        for k, v in {names.SUM_TOKENS_PER_SEC: tps, names.SUM_DEVICE_TOKENS_PER_SEC: tps / devices,
                     names.SUM_USD_PER_BTOK: 50.0 / devices, names.SUM_ESTIMATE_KG_CO2E_PER_BTOK: 3.0 + devices,
                     names.SUM_COST_USD: 0.01 * devices, names.EVAL_VAL_LOSS: 3.0 - 0.1 * devices,
                     names.MEM_MAX_ALLOC: 1.5}.items():
            client.log_metric(rid, k, v, step=10)
    else:
        client.set_tag(rid, names.ERROR, "RuntimeError: injected failure")
    client.set_terminated(rid, status)
    return rid

from conftest import use_store  # noqa: E402


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    """One store for the module (each test that adds runs makes its own experiment)."""
    yield from use_store(module_store, monkeypatch)


_EXPERIMENTS: dict[str, tuple] = {}


def new_experiment(name: str, runs=(("one", 1, 1000.0), ("two", 2, 1800.0))):
    """An experiment of the module's store with ``runs`` ((name, devices, tokens/s)); made once per name."""
    import mlflow

    client = mlflow.MlflowClient()
    if name not in _EXPERIMENTS:
        exp_id = client.create_experiment(name)
        _EXPERIMENTS[name] = (exp_id, [log_run(client, exp_id, n, d, t) for n, d, t in runs])
    exp_id, ids = _EXPERIMENTS[name]
    return client, exp_id, ids


@pytest.fixture
def experiment(tracking_uri):
    new_experiment("empty", runs=())
    return new_experiment("cmp")


def invoke(*args):
    from mlflow_llmeff.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_compare_writes_table_html_and_plots(experiment, tmp_path):
    out = tmp_path / "rep"
    r = invoke("compare", "--experiment", "cmp", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "weak scaling efficiency 0.9 " in r.output  # 1800 / (1000 * 2)
    names_written = sorted(p.name for p in out.iterdir())
    assert {"report.md", "report.csv", "report.html", "tokens_per_device.png", "pareto_cost.png",
            "pareto_carbon.png", "pareto_memory.png", "quality_cost.png", "loss.png"} <= set(names_written)
    rows = list(csv.DictReader(io.StringIO((out / "report.csv").read_text())))
    assert sorted(row["run"] for row in rows) == ["one", "two"]
    assert {row["summary/tokens_per_sec [tokens/s]"] for row in rows} == {"1000", "1800"}
    assert {row["eval/val_loss [nats/token]"] for row in rows} == {"2.9", "2.8"}  # 3.0 - 0.1 x devices
    html = (out / "report.html").read_text()
    assert html.count("<tr class='run'") == 2 and html.count("data:image/png;base64,") == 6
    assert "#/experiments/" in html and "/runs/" in html and "?workflowType=machine_learning" in html
    # the interval method said once, single runs carry the cpu floor, and sources ship with the package
    md = (out / "report.md").read_text()
    assert "Student's t across a configuration's repeats" in md and "1,000 [190, 1,810] floor" in md
    assert "../" not in html + md and "docs/stability.md" in html


def test_crashed_run_is_a_marked_row(tracking_uri, tmp_path):
    client, exp_id, _ = new_experiment("cmp-crashed")
    log_run(client, exp_id, "crashed", 1, 0.0, summary=False, status="FAILED")
    r = invoke("compare", "--experiment", "cmp-crashed", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    assert "marked row: crashed" in r.output
    assert "FAILED: no summary/* metrics (RuntimeError: injected failure)" in r.output
    html = (tmp_path / "o" / "report.html").read_text()
    assert html.count("<tr class='nosummary'") == 1


def test_log_to_mlflow_makes_one_comparison_run(tracking_uri, tmp_path):
    client, exp_id, ids = new_experiment("cmp-logged")
    r = invoke("compare", "--experiment", "cmp-logged", "--out", str(tmp_path / "o"), "--log-to-mlflow")
    assert r.exit_code == 0, r.output
    run_id = r.output.strip().split()[-1]
    run = client.get_run(run_id)
    assert set(run.data.tags[names.COMPARE_RUN_IDS].split(",")) == set(ids)
    assert {"report.html", "run_ids.txt"} <= {a.path for a in client.list_artifacts(run_id)}
    # a second comparison leaves the comparison run out
    r2 = invoke("compare", "--experiment", "cmp-logged", "--out", str(tmp_path / "o2"))
    assert "2 runs of 'cmp-logged' compared" in r2.output


def test_the_run_ids_tag_holds_whole_ids_and_says_how_many_of_how_many():
    from mlflow_llmeff.report.compare import compared_ids_tag

    ids = [f"{i:032x}" for i in range(1001)]  # MLflow's run ids: 32 hex characters
    assert compared_ids_tag(ids[:3]) == ",".join(ids[:3])  # what fits is the plain list
    tag = compared_ids_tag(ids)
    note, listed = tag.split(": ")
    # 8,000 characters: the 51-character note and 240 ids (51 + 240 x 33 - 1 = 7,970; 241 take 8,003);
    # the old cut kept 242 whole ids and 14 characters of the 243rd, and said nothing
    assert note == "240 of 1001 run ids (all in artifact run_ids.txt)"
    assert listed.split(",") == ids[:240] and len(tag) <= 8000
    assert compared_ids_tag(ids[:5], limit=80) == "1 of 5 run ids (all in artifact run_ids.txt): " + ids[0]
    with pytest.raises(ValueError, match="tag value limit 40 is not accepted"):
        compared_ids_tag(ids[:5], limit=40)


def test_a_comparison_of_1001_runs_logs_every_id_as_an_artifact(tracking_uri, tmp_path):
    from types import SimpleNamespace

    import mlflow

    from mlflow_llmeff.report.compare import log_report

    client = mlflow.MlflowClient()
    exp_id = client.create_experiment("cmp-many-ids")
    ids = [f"{i:032x}" for i in range(1001)]  # the report is not read: only its selection's ids
    sel = SimpleNamespace(runs=[SimpleNamespace(run_id=i) for i in ids], experiment_id=exp_id,
                          experiment_name="cmp-many-ids", filter_string="")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "report.md").write_text("# report")
    run = client.get_run(log_report(client, SimpleNamespace(selection=sel), str(tmp_path / "o")))
    assert run.data.tags[names.COMPARE_RUN_IDS].startswith("240 of 1001 run ids (all in artifact run_ids.txt): ")
    listed = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/run_ids.txt")
    assert listed.splitlines() == ids


@pytest.mark.parametrize("what, tag, values", [
    # the trial: 20 seeded documents against all of them look equally authoritative in the table
    ("eval documents", names.EVAL_DOCUMENTS, {"d20": "20 drawn with seed 0", "dall": "all"}),
    ("few-shot count", names.EVAL_NUM_FEWSHOT, {"k0": "0", "k5": "5"}),
])
def test_eval_condition_difference_is_warned_once_in_output_html_and_md(tracking_uri, tmp_path, what, tag, values):
    import mlflow

    client = mlflow.MlflowClient()
    exp = f"mixed-{tag}"
    exp_id = client.create_experiment(exp)
    for name, value in values.items():
        rid = log_run(client, exp_id, name, 1, 1000.0, **{tag: value})
        client.log_metric(rid, names.EVAL_MMLU_ACC, 0.25, step=10)
    log_run(client, exp_id, "no-evals", 1, 1000.0)  # never scored a benchmark: not an "unknown" beside them
    r = invoke("compare", "--experiment", exp, "--out", str(tmp_path / "o"))
    line = next(ln for ln in r.output.splitlines() if ln.startswith(f"WARNING: not comparable: {what} ({tag}) differs: "))
    assert all(f"{v} ({n})" in line for n, v in values.items()) and "unknown" not in r.output
    html = (tmp_path / "o" / "report.html").read_text()
    assert html.count(f"class='warn'>WARNING: not comparable: {what}") == 1
    assert f"**WARNING** not comparable: {what}" in (tmp_path / "o" / "report.md").read_text()
    rows = list(csv.DictReader(io.StringIO((tmp_path / "o" / "report.csv").read_text())))
    assert {row["run"]: row["note"] for row in rows} == {"no-evals": "", **{n: "" for n in values}}  # said once
    assert {row["run"]: row[tag] for row in rows} == {"no-evals": "", **values}


def test_an_eval_batch_size_that_differs_is_a_column_not_a_warning(tracking_uri, tmp_path):
    import mlflow

    client = mlflow.MlflowClient()
    exp_id = client.create_experiment("mixed-eval-bs")
    for name, bs in (("bs8", "8"), ("bs16", "16")):
        rid = log_run(client, exp_id, name, 1, 1000.0, **{names.EVAL_BATCH_SIZE: bs})
        client.log_metric(rid, names.EVAL_MMLU_ACC, 0.25, step=10)
    r = invoke("compare", "--experiment", "mixed-eval-bs", "--out", str(tmp_path / "o"))
    assert "WARNING" not in r.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "o" / "report.csv").read_text())))
    assert {row["run"]: row[names.EVAL_BATCH_SIZE] for row in rows} == {"bs8": "8", "bs16": "16"}


def test_an_unknown_experiment_names_the_ones_there_are():
    from types import SimpleNamespace

    from mlflow_llmeff.report.source import _known_experiments

    class Client:
        def __init__(self, names_, fail=False):
            self.names, self.fail = names_, fail

        def search_experiments(self, max_results, order_by):
            if self.fail:
                raise ConnectionError("down")
            assert order_by == ["creation_time DESC"]
            return [SimpleNamespace(name=n) for n in self.names][:max_results]

    assert _known_experiments(Client(["cmp", "empty", "Default"])) == "accepted: 'cmp', 'empty', 'Default'"
    many = [f"e{i}" for i in range(12)]
    assert _known_experiments(Client(many)) == ("accepted: " + ", ".join(repr(n) for n in many[:10])
                                                + " and more (mlflow experiments search lists them)")
    assert _known_experiments(Client([], fail=True)) == "give an experiment name or id that exists in this tracking store"


@pytest.mark.parametrize("args, message", [
    (["--experiment", "nope"], "Error: experiment 'nope' not found; accepted: "),
    (["--experiment", "empty"], "Error: experiment 'empty' has no runs to compare"),
    (["--experiment", "cmp", "--filter", "metrics.x >>> 1"], "Error: bad filter 'metrics.x >>> 1': "),
    (["--experiment", "cmp", "--filter", "tags.`llmeff.precision` = 'fp8'"],
     "Error: no run of experiment 'cmp' matches the filter \"tags.`llmeff.precision` = 'fp8'\""),
    (["--experiment", "cmp", "--group-by", "colour"], "Error: --group-by 'colour' is not an llmeff tag"),
    (["--experiment", "cmp", "--baseline", "abc"], "Error: --baseline 'abc' is not among the compared runs; accepted: '"),
])
def test_bad_input_is_one_line(experiment, tmp_path, args, message):
    from mlflow_llmeff.cli import main

    r = CliRunner().invoke(main, ["compare", *args, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    err_lines = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(err_lines) == 1 and err_lines[0].startswith(message), r.output
    assert "Traceback" not in r.output
    if args[1] == "nope":  # the experiments there are, by name
        assert "'cmp'" in err_lines[0] and "'empty'" in err_lines[0]


@pytest.mark.slow
def test_mlproject_compare_entry_point_logs_the_report_on_the_launcher_run(tracking_uri, tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    client, exp_id, ids = new_experiment("cmp-project")
    r = subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO), "-e", "compare", "--env-manager", "local",
                        "--experiment-id", exp_id, "-P", "experiment=cmp-project", "-P", f"out={tmp_path / 'o'}"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "weak scaling efficiency 0.9 " in r.stdout
    comparisons = client.search_runs([exp_id], f"tags.`{names.COMPARE_RUN_IDS}` != ''")
    assert len(comparisons) == 1 and comparisons[0].info.status == "FINISHED"
    assert set(comparisons[0].data.tags[names.COMPARE_RUN_IDS].split(",")) == set(ids)  # not itself
    assert "report.html" in [a.path for a in client.list_artifacts(comparisons[0].info.run_id)]


def test_a_run_without_summary_does_not_make_every_condition_a_column():
    from mlflow_llmeff.report.calc import differing_tags

    parent = RunRecord("p", "sweep-parent", tags={})  # no llmeff tags, no summary
    assert differing_tags([rec("a", 1, 1000.0), rec("b", 2, 1800.0), parent]) == [
        names.ACCEL_COUNT, names.PAR_STRATEGY, names.GLOBAL_BATCH_TOKENS]


def test_quality_against_cost_and_ttq_bars_use_the_targets():
    from mlflow_llmeff.report import plots
    from mlflow_llmeff.report.render import build_report
    from mlflow_llmeff.report.source import Selection

    runs = []
    for i, (acc, usd, wall) in enumerate(((0.31, 2.0, 600.0), (0.33, 1.5, 500.0), (0.30, 3.0, 900.0))):
        r = rec(str(i), 1 + i, 1000.0 * (1 + i))
        r.metrics.update({"eval/hellaswag/acc_norm": acc, "ttq/hellaswag_acc_norm_ge_0.30_usd": usd,
                          "ttq/hellaswag_acc_norm_ge_0.30_wall_s": wall, names.MEM_MAX_ALLOC: 2.0})
        runs.append(r)
    assert plots._quality_pairs(runs[1]) == [("eval/hellaswag/acc_norm", "ttq/hellaswag_acc_norm_ge_0.30_usd",
                                              0.33, 1.5)]
    rep = build_report(None, Selection("1", "e", "", runs), plots=False)
    figs, notes = plots.draw_all(rep, lambda run_id, key: [])
    assert {"quality_cost.png", "ttq.png", "tokens_per_device.png"} <= set(figs)
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in figs.values())
    assert notes == ["pareto_cost.png: no run has both summary/device_tokens_per_sec and summary/usd_per_billion_tokens",
                     "pareto_carbon.png: no run has a kg-CO2e per billion tokens figure (measured or estimate)",
                     "loss.png: no run has a train/loss history"]
    # run 1 (0.33 for 1.5 USD) dominates runs 0 and 2: the front is run 1 alone
    assert pareto_front([(2.0, 0.31), (1.5, 0.33), (3.0, 0.30)], maximize_x=False, maximize_y=True) == [1]


def test_figure_labels_are_cut_between_parts_and_keep_the_repeat_suffix():
    from mlflow_llmeff.report.plots import short

    # a trial's pareto_carbon.png read 'tiny-single-fp32-gbt512-s128-cp...' for both repeats
    assert short("tiny-single-fp32-gbt512-s128-cpu-2", 32) == "tiny-single-fp32-gbt512-\u2026cpu-2"
    assert short("tiny-single-fp32-gbt512-s128-cpu", 32) == "tiny-single-fp32-gbt512-s128-cpu"  # fits: whole
    assert short("hellaswag_acc_norm_ge_0.30", 24) == "hellaswag_acc_\u2026ge_0.30"
    assert short("a" * 50, 10) == "a" * 9 + "\u2026"  # no parts: cut and marked


def test_a_run_without_a_memory_figure_is_drawn_hollow_not_at_the_smallest_marker():
    from mlflow_llmeff.report import plots
    from mlflow_llmeff.report.render import build_report
    from mlflow_llmeff.report.source import Selection

    # 4 GiB is the largest: 30 + 300 x 1 = 330; 1 GiB: 30 + 300 / 4 = 105; none: the middle, 180, hollow
    assert plots.marker_sizes([1.0, None, 4.0]) == ([105.0, 180.0, 330.0], [False, True, False])
    assert plots.marker_sizes([None]) == ([180.0], [True])
    runs = []
    for i, mem in enumerate((2.0, None)):
        r = rec(str(i), 1, 1000.0)
        r.metrics.update({names.EVAL_VAL_LOSS: 3.0 - i, names.SUM_COST_USD: 1.0 + i})
        if mem is not None:
            r.metrics[names.MEM_MAX_ALLOC] = mem
        runs.append(r)
    rep = build_report(None, Selection("1", "e", "", runs), plots=False)
    fig = plots.fig_quality_cost(rep, lambda run_id, key: [])
    ax = fig.axes[0]
    assert ax.get_ylabel() == ("final eval/val_loss (marker area: memory per device; hollow: no memory figure)")
    from matplotlib.collections import PathCollection  # the scatter's points (the error bars are lines)

    faces = {tuple(off): (fc[3], size) for sc in ax.collections if isinstance(sc, PathCollection)
             for off, fc, size in zip(sc.get_offsets(), sc.get_facecolors(), sc.get_sizes())}
    assert faces[(1.0, 3.0)] == (1.0, 330.0)  # 2 GiB, the largest: filled, the largest marker
    assert faces[(2.0, 2.0)] == (0.0, 180.0)  # no memory figure: an outline of the middle size


def test_reports_mask_secrets_in_tags_logged_by_anyone(tracking_uri, tmp_path, monkeypatch):
    # a run logged by another tool (no llmeff masking): its error names a URL with credentials and
    # the value of a secret environment variable, and it has a secret-named param
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefgh123456")
    client, exp_id, _ = new_experiment("cmp-secrets")
    rid = log_run(client, exp_id, "leaky", 1, 0.0, summary=False, status="FAILED")
    client.set_tag(rid, names.ERROR, "OSError: https://alice:hunter2pass@hub.example/x with hf_abcdefgh123456")
    client.log_param(rid, "db_password", "hunter3pass")
    out = tmp_path / "o"
    r = invoke("compare", "--experiment", "cmp-secrets", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "OSError: https://hub.example/x with ***" in r.output
    written = r.output + "".join((out / f).read_text() for f in ("report.md", "report.csv", "report.html"))
    assert not any(s in written for s in ("hunter2pass", "hunter3pass", "hf_abcdefgh123456", "alice"))


def test_a_label_past_the_figure_edge_is_found_and_turned_inward():
    from mlflow_llmeff.report import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    label = "a long point label that runs past the right edge"
    ax.annotate(label, (1, 1), xytext=(4, 4), textcoords="offset points")
    assert plots.clipped_texts(fig) == [label]  # as drawn, with matplotlib's default margins
    plots.lay_out(fig)
    assert plots.clipped_texts(fig) == []
    plt.close(fig)


def test_the_flops_method_is_compared_by_method_not_by_model_type():
    formula = "formula: llama config fields (flops.flops_per_token; docs/formulas.md)"
    same = [rec("a", 1, 1.0, **{names.FLOPS_METHOD: formula}),
            rec("b", 1, 1.0, **{names.FLOPS_METHOD: formula.replace("llama", "qwen3")})]
    counted = rec("c", 1, 1.0, **{names.FLOPS_METHOD: "meta_count: model_type 'bloom' is not in the formula"})
    for r in (*same, counted):
        r.metrics[names.SUM_MFU] = 0.3
    assert comparability_warnings(same) == []
    w, = comparability_warnings([*same, counted])
    assert w.what == "FLOPs method" and w.values == {"formula": ["run-a", "run-b"], "meta_count": ["run-c"]}


# ----------------------------------------------------------------------------------------- network
# what a two-host run of tests/test_two_hosts.py logs: busbw through the interface toward the head,
# its tc shaper's rate as the link's peak, the straggler by host and phase
LINK = "eth0 toward the head 10.0.0.1: tc shaper rate 200Mbit (0.025 GB/s)"
STRAGGLER = ("rank 1 on host node-1: backward 2.3x the median rank (41.2 vs 17.9 ms/step); compute (forward + "
             "backward + optimizer) 2.1x (60.1 vs 28.6 ms/step)")
TWO_HOSTS = {names.NODES: "2", names.COMM_PEAK_GBPS: "0.025", names.COMM_PEAK_SOURCE: LINK,
             names.STRAGGLER_RANK: STRAGGLER}
NETWORK_METRICS = {names.COMM_ALLREDUCE_BUSBW: 0.0207, names.COMM_BUSBW_UTIL: 0.828, names.SUM_COMM_EXPOSED: 0.314,
                   names.SUM_STRAGGLER_RATIO: 2.1}


def _network_experiment():
    """A one-host single-process run and a two-host 2-process run carrying the network keys."""
    import mlflow

    client = mlflow.MlflowClient()
    if "network" not in _EXPERIMENTS:
        exp_id = client.create_experiment("network")
        one = log_run(client, exp_id, "tiny-fp32-gbt1k-s128-cpu", 1, 1000.0, **{names.NODES: "1"})
        two = log_run(client, exp_id, "tiny-ddp2-fp32-gbt2k-s128-cpu", 2, 1200.0, **TWO_HOSTS)
        for k, v in NETWORK_METRICS.items():
            client.log_metric(two, k, v)
        _EXPERIMENTS["network"] = (exp_id, [one, two])
    return client, *_EXPERIMENTS["network"]


def test_a_two_host_runs_busbw_utilisation_and_link_source_are_in_compare_md_and_html(tracking_uri, tmp_path):
    _network_experiment()
    out = tmp_path / "net"
    r = invoke("compare", "--experiment", "network", "--out", str(out))
    assert r.exit_code == 0, r.output
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    row = "| tiny-ddp2-fp32-gbt2k-s128-cpu | 2 | 2 | 0.0207 | 0.025 | 82.8% | " + LINK + " | 31.4% | 2.1 | " \
          "rank 1 on host node-1: backward 2.3x the median rank (41.2 vs 17.9 ms/step) |"
    assert "## Network" in md and row in md
    assert md.count("| tiny-fp32-gbt1k-s128-cpu | 1 | 1 |") == 0  # one host, no collective: not in the section
    # the terminal: the same row, padded
    assert "Network (collectives, the link they cross, the straggler):" in r.output
    line = next(x for x in r.output.splitlines() if LINK in x)
    assert line.split()[:8] == ["tiny-ddp2-fp32-gbt2k-s128-cpu", "2", "2", "0.0207", "0.025", "82.8%", "eth0", "toward"]
    assert line.split("(0.025 GB/s)")[1].split()[:3] == ["31.4%", "2.1", "rank"] and "on host node-1: backward 2.3x" in line
    import html as _html

    assert "<table id='network' class='sortable'>" in page
    for text in ("82.8%", "0.0207", LINK, "rank 1 on host node-1: backward 2.3x the median rank", STRAGGLER):
        assert _html.escape(text) in page, text


def test_the_efficiency_page_shows_the_two_host_runs_network_figures(tracking_uri, monkeypatch):
    import html as _html

    from flask import Flask

    from mlflow_llmeff.report import server as srv
    from mlflow_llmeff.tracking import store

    client, exp_id, _ = _network_experiment()
    monkeypatch.setattr(srv, "_store", lambda: store.client(tracking_uri)._tracking_client.store)
    app = Flask("t")
    srv.register(app)
    page = app.test_client().get(f"/llmeff/experiments/{exp_id}").get_data(as_text=True)
    section = page.split("<table id='network'", 1)[1].split("</table>", 1)[0]
    cells = ["tiny-ddp2-fp32-gbt2k-s128-cpu", "0.0207", "0.025", "82.8%", _html.escape(LINK), "31.4%", "2.1",
             "rank 1 on host node-1: backward 2.3x the median rank (41.2 vs 17.9 ms/step)"]
    assert all(c in section for c in cells) and "tiny-fp32-gbt1k-s128-cpu" not in section


def test_runs_without_network_figures_have_no_network_section(experiment, tmp_path):
    out = tmp_path / "plain"
    assert invoke("compare", "--experiment", "cmp", "--out", str(out)).exit_code == 0
    assert "## Network" not in (out / "report.md").read_text()
    assert "id='network'" not in (out / "report.html").read_text()
