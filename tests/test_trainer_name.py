"""The HF Trainer's run is named from its configuration, with or without the Trainer's own MLflow callback.

The trial (issue 31): ``examples/hf_trainer.py --report-to mlflow`` gave a random MLflow name
(``overjoyed-slug-911``: the Trainer's callback starts the run with ``run_name=None``), while the
same script without the callback gave ``llama-fp32-cpu``, without the batch parts a run of
``llmeff train`` has (they are known at the end of the first step, and the run is named again
then). Both paths must give the one stem of the configuration, with a suffix for the repeat.
"""

from __future__ import annotations

import sys

import mlflow
import pytest

from mlflow_llmeff import names

from conftest import empty_store
from test_autolog_examples import EXAMPLES, run_script

pytestmark = pytest.mark.slow


def test_the_trainers_own_run_and_autologs_run_share_the_configurations_name(tmp_path):
    uri = empty_store(tmp_path / "mlflow.db")
    run_script([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--report-to", "mlflow"], uri)
    run_script([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--report-to", "none"], uri)
    runs = mlflow.MlflowClient(uri).search_runs(["0"], order_by=["attributes.start_time ASC"])
    # the collator pads each batch to its longest row (23 to 32 bytes): the sequence length and the global
    # batch are no condition, so no gbt/s parts (they were the first step's, 'gbt46-s23', whichever
    # sentences the shuffle put first, until a trial split repeats of one script into configurations)
    assert [r.info.run_name for r in runs] == ["llama-fp32-cpu", "llama-fp32-cpu-2"]
    assert {r.data.tags[names.SEQ_LEN] for r in runs} == {"dynamic"}
    assert "loss" in runs[0].data.metrics  # the first is the Trainer's own run (its callback logged into it)
