"""The sharded strategies that run on CPU, over gloo, against one single-process run: HSDP, tensor
parallelism, FSDP x TP (2-D), and FSDP killed between checkpoints and resumed (tests/strategies.py: the
launches and the assertions every strategy shares; tests/test_strategies_zero.py: DDP and DeepSpeed's
ZeRO stages, launched by the other pytest worker meanwhile).

Each strategy trains llama-tiny for 6 steps with the same global batch (8 sequences of 32 tokens)
and seed as the single-process reference, in fp32, and is launched once (the command ``llmeff
train`` runs), all its assertions sharing that run: one FINISHED MLflow run, the degree tags,
tokens counted once per data-parallel rank, the first 5 training losses equal to the reference's
(relative 1e-5: only the order of floating-point sums differs), the validation loss and benchmark
scores of the end-of-run eval equal too, the model state per device as the sharding says, and the
measured communication.
"""

from __future__ import annotations

import pytest

from strategies import check_fsdp_killed_and_resumed, check_strategy, launch, make_template_db

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """This module's strategies launched (two at a time) beside the session's single-process reference."""
    return launch(request, make_template_db(tmp_path_factory), tmp_path_factory, __name__)


@pytest.mark.parametrize("strategy", ["hsdp", "tp", "fsdp_tp"])
def test_strategy_trains_like_one_process(strategy, launched):
    check_strategy(strategy, launched)


def test_fsdp_killed_between_checkpoints_resumes_into_the_same_run(launched):
    check_fsdp_killed_and_resumed(launched)
