"""The effect of a memory lever in one look: a real study over four levers, compared (issue 50).

``llmeff study`` trains one configuration per lever (torch AdamW, bitsandbytes' 8-bit AdamW, eager attention,
activation checkpointing) and ``llmeff compare`` shows four configurations, each labelled by its lever, with
the memory section's columns: the peak per device, its share of capacity, the model state split in bytes per
parameter and the rest of the peak, beside tokens/s and MFU.
"""

from __future__ import annotations

import mlflow
import pytest
from click.testing import CliRunner

from mlflow_llmeff import names
from mlflow_llmeff.cli import main
from conftest import empty_store, require

pytestmark = pytest.mark.slow

TINY = "--model llama-tiny --dataset synthetic --max-steps 4 --seq-len 64 --warmup-steps 1 --log-every-n-steps 2 " \
       "--measure-energy none --val-fraction 0"
LEVERS = ("--optimizer adamw", "--optimizer bnb-adamw8bit", "--attn-implementation eager",
          "--activation-checkpointing true")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    require("bitsandbytes", "pip install 'mlflow-llmeff[bnb]' (the 8-bit optimizer lever)")
    store = empty_store(tmp_path_factory.mktemp("levers") / "mlflow.db")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", store)
    mlflow.set_tracking_uri(store)
    args = ["study", "--experiment", "levers"]
    for lever in LEVERS:
        args += ["--config", f"{TINY} {lever}"]
    res = CliRunner().invoke(main, args)
    compared = CliRunner().invoke(main, ["compare", "--experiment", "levers", "--out",
                                         str(tmp_path_factory.mktemp("cmp"))])
    yield res, compared, mlflow.MlflowClient()
    mlflow.set_tracking_uri(None)
    mp.undo()


def test_each_lever_is_a_finished_run_named_by_its_lever(study):
    res, _, client = study
    assert res.exit_code == 0, res.output
    exp = client.get_experiment_by_name("levers").experiment_id
    kids = [r for r in client.search_runs([exp], order_by=["attributes.start_time ASC"])
            if names.STUDY not in r.data.tags]
    assert [r.info.status for r in kids] == ["FINISHED"] * 4
    assert [r.info.run_name for r in kids] == ["tiny-fp32-gbt512-s64-cpu", "tiny-bnb8bit-fp32-gbt512-s64-cpu",
                                               "tiny-eager-fp32-gbt512-s64-cpu", "tiny-ckpt-fp32-gbt512-s64-cpu"]
    torch_run, bnb_run = kids[0].data, kids[1].data
    # bytes as stored: fp32 AdamW keeps 8 B/param of moments (+ its 4-byte step counters, a few per million);
    # bitsandbytes' 8-bit moments are far less, though llama-tiny's small tensors (< 4,096 elements) stay fp32
    assert torch_run.metrics[names.SUM_OPT_STATE_BYTES_PER_PARAM] == pytest.approx(8.0, abs=0.01)
    assert bnb_run.metrics[names.SUM_OPT_STATE_BYTES_PER_PARAM] < 6.0
    for r in kids:
        m = r.data.metrics
        split = m[names.SUM_MEM_WEIGHTS_GIB] + m[names.SUM_MEM_GRADIENTS_GIB] + m[names.SUM_MEM_OPT_STATE_GIB]
        params = int(r.data.tags[names.MODEL_PARAMS])
        state = (m[names.SUM_MEM_WEIGHTS_GIB] + m[names.SUM_MEM_GRADIENTS_GIB]) * 2**30 / params \
            + m[names.SUM_OPT_STATE_BYTES_PER_PARAM]
        assert split * 2**30 / params == pytest.approx(state, rel=1e-9)
        # summary/model_state_bytes_per_param leaves out the optimizer's 0-d step counters (4 B a tensor)
        assert 0 <= state - m[names.SUM_MODEL_STATE_BYTES_PER_PARAM] < 1e-3
        assert 0 < m[names.SUM_MEM_PEAK_FRACTION] < 1 and m[names.SUM_MEM_PEAK_GIB] > split


def test_compare_shows_four_configurations_labelled_by_their_lever_with_the_memory_columns(study):
    _, compared, _ = study
    assert compared.exit_code == 0, compared.output
    out = compared.output
    section = out[out.index("Memory per device"):]
    header = next(line for line in section.splitlines() if line.startswith("configuration"))
    for column in ("peak GiB / device", "of capacity", "weights B/param", "gradients B/param",
                   "optimizer state B/param", "model state B/param", "rest of peak GiB", "tokens/s per device", "MFU"):
        assert column in header
    rows = [line for line in section.splitlines() if line.startswith("tiny-")]
    assert len(rows) == 4
    labels = {"tiny-fp32": "AdamW (torch.optim), sdpa, fp32 weights",
              "tiny-bnb8bit": "AdamW8bit (bitsandbytes.optim", "tiny-eager": "AdamW (torch.optim), eager, fp32 weights",
              "tiny-ckpt": "AdamW (torch.optim), sdpa, fp32 weights, ckpt"}
    for stem, label in labels.items():
        row = next(r for r in rows if r.startswith(stem))
        assert label in row
