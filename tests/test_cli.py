"""The llmeff command line's usage errors: one line ``Error: <message>`` naming the value and the accepted
ones, exit code 2, no usage block or ``Try '... --help'`` hint; the help unchanged."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from mlflow_llmeff.cli import OneLineErrors, main

COMMANDS = "compare, energy-probe, eval, flops, models, peak, plan, prepare-data, prices, study, sync, train"


@pytest.mark.parametrize("args, line", [
    # a missing option
    (["compare"], "Error: Missing option '--experiment'."),
    # an unknown option: Click's close match stays on the line, and every accepted one follows (a trial's
    # '--sort' named only '--out')
    (["compare", "--experiment", "x", "--group-bi", "a"],
     "Error: No such option '--group-bi'. Did you mean '--group-by'? Options: --baseline, --experiment, --filter, "
     "--group-by, --help, --log-to-mlflow, --out, --ui-url."),
    (["--bogus"], "Error: No such option '--bogus'. Options: --help, --version."),
    # a bad integer, float, integer range and choice
    (["train", "--max-steps", "1.5"], "Error: Invalid value for '--max-steps': '1.5' is not a valid integer."),
    (["train", "--learning-rate", "abc"], "Error: Invalid value for '--learning-rate': 'abc' is not a valid float."),
    (["flops", "--model", "llama-tiny", "--seq-len", "abc"],
     "Error: Invalid value for '--seq-len': 'abc' is not an integer in the range x>=1."),
    (["flops", "--model", "llama-tiny", "--seq-len", "0"],
     "Error: Invalid value for '--seq-len': 0 is not in the range x>=1."),
    (["peak", "--dtype", "fp64"],
     "Error: Invalid value for '--dtype': 'fp64' is not one of 'fp32', 'tf32', 'bf16', 'fp16', 'fp8'."),
    # a missing argument
    (["sync"], "Error: Missing argument 'FOLDER'."),
    # an unknown command: the close one and every accepted one
    (["trian"], f"Error: No such command 'trian'. Did you mean 'train'? Commands: {COMMANDS}."),
    (["nosuchcmd"], f"Error: No such command 'nosuchcmd'. Commands: {COMMANDS}."),
])
def test_a_usage_error_is_one_line_naming_the_value_and_the_accepted_ones(args, line):
    r = CliRunner().invoke(main, args, prog_name="llmeff")
    assert (r.exit_code, r.output) == (2, line + "\n")


def test_a_commands_own_usage_error_is_one_line():
    r = CliRunner().invoke(main, ["train", "--model", "llama-99b"], prog_name="llmeff")
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert r.output.startswith("Error: unknown model 'llama-99b'; accepted: a preset (llama-tiny, ")


def test_a_missing_choice_joins_clicks_list_of_choices_onto_the_line():
    @click.group(cls=OneLineErrors)
    def cli():
        pass

    @cli.command()
    @click.option("--kind", type=click.Choice(["a", "b"]), required=True)
    def go(kind):
        pass

    r = CliRunner().invoke(cli, ["go"], prog_name="x")
    assert (r.exit_code, r.output) == (2, "Error: Missing option '--kind'. Choose from: a, b\n")


def test_help_is_unchanged():
    r = CliRunner().invoke(main, ["compare", "--help"], prog_name="llmeff")
    assert r.exit_code == 0 and r.output.startswith("Usage: llmeff compare [OPTIONS]\n\n  Compare runs on efficiency")
    flops_help = CliRunner().invoke(main, ["flops", "--help"]).output  # the metavar is still Click's
    assert "  --seq-len INTEGER RANGE         Tokens per sequence.  [x>=1; required]\n" in flops_help


@pytest.mark.parametrize("args, want", [(["--dry-run"], (True, False)), (["--dry-run", "true"], (True, False)),
                                        (["--dry-run", "false"], (False, False)),
                                        (["--compile", "--dry-run"], (True, True)), ([], (False, False))])
def test_a_switch_works_alone_and_with_the_value_mlproject_passes(monkeypatch, args, want):
    # a trial's `llmeff train ... --dry-run` (as docs/training.md writes it) failed: "Option '--dry-run'
    # requires an argument"; MLflow Projects passes "--dry-run true"
    from mlflow_llmeff.train import launch as launch_mod

    seen = {}
    monkeypatch.setattr(launch_mod, "launch", lambda spec, **kw: seen.setdefault("cfg", spec.options) and 0)
    r = CliRunner().invoke(main, ["train", *args, "--max-steps", "3"])
    assert r.exit_code == 0, r.output
    assert (seen["cfg"].dry_run, seen["cfg"].compile) == want


def test_project_run_whose_relative_store_holds_no_such_run_stops_with_one_line(tmp_path, monkeypatch):
    """``python -m mlflow_llmeff`` under ``mlflow run`` (``MLFLOW_RUN_ID``) with ``sqlite:///mlflow.db``: the store
    is the one of the folders that started it holding the run (tests/test_store.py); none holds it here, and the
    line names the URI instead of MLflow's 'Run with id=... not found' traceback."""
    from mlflow_llmeff import cli

    monkeypatch.setitem(cli._PROCESS_ENTRY, "on", False)  # run_as_project marks this process an entry; put back
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    monkeypatch.setenv("MLFLOW_RUN_ID", "f" * 32)
    monkeypatch.setattr("sys.argv", ["llmeff", "train"])
    with pytest.raises(SystemExit) as e:
        cli.run_as_project()
    assert str(e.value).startswith("Error: MLFLOW_TRACKING_URI=sqlite:///mlflow.db is a relative path and no store "
                                   f"it names from the folders that started this run holds run {'f' * 32} (looked in: ")
    assert "\n" not in str(e.value) and not (tmp_path / "mlflow.db").exists()
