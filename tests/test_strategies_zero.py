"""Data parallelism, replicated (DDP) and partitioned (DeepSpeed's ZeRO stages 1-3), on CPU over gloo, against
one single-process run (tests/strategies.py: the launches and the assertions every strategy shares;
tests/test_strategies.py: HSDP, TP, 2-D and FSDP's kill and resume, launched by the other pytest worker).
Each trains llama-tiny for 6 steps with the reference's global batch and seed, in fp32, launched once,
and must match it: losses and end-of-run scores within 1e-5, tokens once per data-parallel rank, the
model state per device as the plan says, the communication measured.
"""

from __future__ import annotations

import pytest

from strategies import check_strategy, launch, make_template_db

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """This module's strategies launched (two at a time) beside the session's single-process reference."""
    return launch(request, make_template_db(tmp_path_factory), tmp_path_factory, __name__)


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_strategy_trains_like_one_process(strategy, launched):
    check_strategy(strategy, launched)
