import json
import subprocess
import sys

import pytest

from mlflow_llmeff.calc.flops import ModelShape
from mlflow_llmeff.planning.plan import activation_bytes, model_state_bytes

from conftest import REPO
from test_plan_history import DEFAULTS


@pytest.mark.parametrize("strategy, expected", [
    ("ddp", (400, 400, 800)),              # 4 + 4 + 8 bytes per parameter, replicated
    ("fsdp", (100, 100, 200)),             # everything / dp
    # 16-bit weights and grads, 12 B of fp32 state / dp, and the fp32 gradient partition (4 B / dp) the
    # optimizer steps on (DeepSpeed's estimators count it: 2 + 18/dp bytes per parameter for ZeRO-2)
    ("deepspeed_zero1", (200, 200 + 100, 300)),
    ("deepspeed_zero2", (200, 50 + 100, 300)),
    ("deepspeed_zero3", (50, 50 + 100, 300)),
])
def test_model_state_bytes_by_strategy(strategy, expected):
    assert model_state_bytes(100, strategy, dp=4) == expected


def test_activation_bytes_hand_computed():
    # h=8, n=2, g=1, d=4 -> hq=8, hk=4; gated MLP f=16; L=2; V=10; s=4, b=2 (8 tokens). Issue 50 corrected the
    # old count (208 B/token/layer, fp32 logits added) by transformers 5's Llama as measured on CPU
    # (tests/test_plan_memory.py): bf16 autocast over fp32 weights (c=2, r=4) keeps per token and layer two
    # RMSNorms 2*(4h + 4h + 2h) = 160, attention (2*8 + 2*4)*2 = 48, the gated MLP 4*16*2 = 128 -> 336 B;
    # outside the layers the final norm 80 + RoPE tables 2*d*4 = 32 -> 112 B; the loss path is apart
    shape = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10)
    full, ckpt = activation_bytes(shape, 4, 2, precision="bf16")
    assert full == 8 * (336 * 2 + 112)
    assert ckpt == 8 * (4 * 8 * 2 + 112)                 # fp32 layer inputs + final norm + RoPE tables
    full32, _ = activation_bytes(shape, 4, 2, precision="fp32")
    assert full32 == 8 * ((2 * 96 + 24 * 4 + 64 * 4) * 2 + 96 + 32)
    eager, _ = activation_bytes(shape, 4, 2, eager_attention=True)
    assert eager == full + 8 * 2 * 2 * 4 * (4 + 2)        # softmax probs n*s per token and layer, fp32 + bf16 cast


def test_loss_path_hand_computed():
    from mlflow_llmeff.planning.plan import loss_path_bytes

    shape = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10)
    tv = 8 * 10  # tokens x vocabulary
    # bf16: logits 2 B; forward: the .float() copy + log_softmax's output; backward start: 3 fp32 tensors
    assert loss_path_bytes(shape, 4, 2, precision="bf16") == (2 * tv, 8 * tv, 12 * tv)
    assert loss_path_bytes(shape, 4, 2, precision="fp32") == (4 * tv, 4 * tv, 12 * tv)  # .float() is a no-op


def test_unknown_strategy_rejected():
    with pytest.raises(ValueError, match="strategy='pp' is not accepted"):
        model_state_bytes(1, "pp", 1)


@pytest.mark.parametrize("strategy, kw, per_param", [
    ("ddp", dict(dp=2), 16.0),                                 # fp32 AdamW: 4 + 4 + 8, replicated
    ("fsdp", dict(dp=2), 8.0),                                 # all of it / 2
    ("hsdp", dict(dp=4, dp_shard=2), 8.0),                     # / the shard group, not / dp
    ("deepspeed_zero1", dict(dp=2, precision="fp32"), 4 + 4 + 6.0),   # fp32 working copy + 12 B / 2
    ("deepspeed_zero2", dict(dp=2, precision="fp32"), 4 + 2 + 6.0),
    # + the fp32 copy of the gradient partition ZeRO-3's step makes (flatten copies, in fp32 too): 4 / 2
    ("deepspeed_zero3", dict(dp=2, precision="fp32"), 2 + 2 + 2 + 6.0),
])
def test_model_state_bytes_per_parameter_by_sharding(strategy, kw, per_param):
    assert sum(model_state_bytes(1000, strategy, **kw)) / 1000 == per_param


def test_tensor_parallel_splits_only_the_planned_matrices():
    # 1000 parameters, 600 of them in the planned layer matrices: a TP rank of 2 holds 400 + 300
    assert model_state_bytes(1000, "tp", 1, tp=2, tp_params=600) == (4 * 700, 4 * 700, 8 * 700)
    assert model_state_bytes(1000, "fsdp_tp", 2, tp=2, tp_params=600) == (4 * 350, 4 * 350, 8 * 350)


def test_llama_tiny_parameter_split_matches_the_model():
    from mlflow_llmeff.planning.plan import parameter_split
    from mlflow_llmeff.models.presets import load_config

    split = parameter_split(load_config("llama-tiny"))
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up/down 3 x 64x176 = 46,080 planned; + 2 norms of 64
    assert split == {"total": 125_632, "layers": 2 * (46_080 + 128), "tensor_parallel": 2 * 46_080}


def test_tensor_parallel_activations_divide_the_block_insides():
    shape = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10)
    full1, _ = activation_bytes(shape, 4, 2, precision="bf16")
    full2, _ = activation_bytes(shape, 4, 2, precision="bf16", tp=2)
    # per token per layer 336 B of which the norms' 160 stay whole and 176 (Q, K, V, attention out, MLP) halve
    assert full1 - full2 == (176 / 2) * 8 * 2


@pytest.mark.slow
def test_dry_run_of_llama_7b_works_on_cpu(tracking_uri, tmp_path):
    import mlflow

    r = subprocess.run([sys.executable, "-m", "mlflow", "run", str(REPO), "--env-manager", "local",
                        "-P", "model=llama-7b", "-P", "dry_run=true"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "6,738,415,616" in r.stdout  # Llama-2-7B parameters, built on the meta device
    run = mlflow.MlflowClient().search_runs(["0"])[0]
    assert run.data.tags["llmeff.dry_run"] == "true"
    assert run.data.metrics["plan/params_total"] == 6_738_415_616
    # the stem llmeff train gives the configuration (was plan-llama-7b-cpu-1x-single-fp32)
    assert run.info.run_name == "plan-7b-fp32-gbt1k-s128-cpu"


def test_plan_json_for_another_accelerator(tracking_uri):
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    # in this process (a fresh one costs 10-20 s of imports; the one below checks a fresh process's stdout)
    r = CliRunner().invoke(main, ["plan", "--model", "llama-7b", "--seq-len", "4096", "--micro-batch-size", "1",
                                  "--num-processes", "8", "--parallelism", "fsdp", "--accelerator", "H100-SXM", "--json"])
    assert r.exit_code == 0, (r.output + r.stderr)[-2000:]
    plan = json.loads(r.stdout)
    assert plan["precision"] == "bf16" and plan["strategy"] == "fsdp"
    assert plan["flops_per_token_megatron"] == pytest.approx(42.8637e9, rel=1e-5)  # METRICS.md reference
    assert plan["memory_weights_gib"] == pytest.approx(6_738_415_616 * 4 / 8 / 2**30)


def test_plan_prefers_runs_of_the_same_sequence_length_and_micro_batch(tracking_uri):
    # the trial: llama-tiny at seq 256 was predicted from the median of seq 128 and 256 runs
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.planning.predict import history_tflops

    client = mlflow.MlflowClient()
    exp = client.create_experiment("plan-seq")
    for seq, tflops in (("128", 0.02), ("128", 0.025), ("256", 0.04)):
        rid = client.create_run(exp, tags={names.ACCEL_SHORT: "cpu-x", names.MODEL_NAME: "llama-tiny",
                                           names.PAR_STRATEGY: "single", names.ACCEL_COUNT: "1",
                                           names.SEQ_LEN: seq, names.MICRO_BATCH_SIZE: "8"}).info.run_id
        client.log_metric(rid, names.SUM_DEVICE_TFLOPS, tflops)
        client.set_terminated(rid, "FINISHED")
    got = history_tflops(client, "cpu-x", "llama-tiny", "single", 1, None, 256, 8)
    assert got == (0.04, 1, "runs of llama-tiny's shape with single on 1 device, seq_len 256, micro batch 8")
    got = history_tflops(client, "cpu-x", "llama-tiny", "single", 1, None, 512, 8)  # none at 512: all three
    assert got == (0.025, 3, "runs of llama-tiny's shape with single on 1 device (other sequence lengths or "
                             "micro batches)")


def test_plan_predicts_from_earlier_runs_on_the_same_accelerator(tracking_uri):
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.planning.plan import make_plan
    from mlflow_llmeff.planning.predict import add_predictions
    from mlflow_llmeff.train.config import TrainConfig

    client = mlflow.MlflowClient()
    bf16 = {**DEFAULTS, names.PRECISION: "bf16"}  # the plan's speed conditions: only such runs predict it
    for tflops in (300.0, 400.0, 500.0):  # three earlier llama-7b runs on H100-SXM; median 400
        rid = client.create_run("0", tags={names.ACCEL_SHORT: "H100-SXM", names.MODEL_NAME: "llama-7b",
                                           **bf16}).info.run_id
        client.log_metric(rid, names.SUM_DEVICE_TFLOPS, tflops)
        client.log_metric(rid, names.SUM_TFLOPS_PER_W, tflops / 600.0)  # 600 W per device
        client.set_terminated(rid, "FINISHED")
    other = client.create_run("0", tags={names.ACCEL_SHORT: "A100-80GB", names.MODEL_NAME: "llama-7b",
                                         **bf16}).info.run_id
    client.log_metric(other, names.SUM_DEVICE_TFLOPS, 100.0)
    client.set_terminated(other, "FINISHED")
    diverged = client.create_run("0", tags={names.ACCEL_SHORT: "H100-SXM", names.MODEL_NAME: "llama-7b",
                                            **bf16}).info.run_id
    client.log_metric(diverged, names.SUM_DEVICE_TFLOPS, 9000.0)  # a FAILED run never feeds a prediction
    client.set_terminated(diverged, "FAILED")
    cfg = TrainConfig(model="llama-7b", seq_len=4096, micro_batch_size=1, grad_accum=4, num_processes=8, max_steps=1000)
    plan = add_predictions(make_plan(cfg, accelerator_short="H100-SXM", precision="bf16", strategy="ddp"), cfg,
                           client=client, accelerator_short="H100-SXM", strategy="ddp", device_hour_usd=2.0)
    fpt = 42.8637e9  # Llama-2-7B at 4096, METRICS.md
    tps = 400e12 * 8 / fpt
    assert plan["prediction_basis"] == ("median of 3 runs of llama-7b's shape; all with precision bf16, optimizer adamw, "
                                        "fp32 weights, every weight trained, sdpa attention, not compiled, no "
                                        "activation checkpointing; threads intra-op 2, inter-op 2")
    assert plan["predicted_tokens_per_sec"] == pytest.approx(tps, rel=1e-5)
    wall = 1000 * 4096 * 4 * 8 / tps
    assert plan["predicted_wall_s"] == pytest.approx(wall, rel=1e-5)
    # the trial's dry run predicted less than the run took: the prediction says what it leaves out
    assert plan["predicted_wall_covers"].startswith("1000 steps at the steady-state rate; start-up")
    assert plan["predicted_usd"] == pytest.approx(2.0 * 8 * wall / 3600, rel=1e-5)
    assert plan["predicted_kwh"] == pytest.approx(600 * 8 * wall / 3.6e6, rel=1e-5)


def test_plan_rejects_an_unknown_accelerator(tracking_uri):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    with pytest.raises(ValueError, match=r"accelerator 'TPUv5' is not known; use one of: .*H100-SXM"):
        dry_run(TrainConfig(model="llama-7b"), accelerator_short="TPUv5")


def test_plan_takes_a_family_name_as_its_table_row_and_says_so(tracking_uri, capsys):
    # a user typed "--accelerator H100": planned as the H100-SXM row (80 GiB), with a note, not refused
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    assert dry_run(TrainConfig(model="llama-7b", seq_len=4096, micro_batch_size=1), accelerator_short="h100",
                   as_json=True) == 0
    got = capsys.readouterr()
    assert "llmeff: accelerator 'h100' taken as H100-SXM (also: H100-NVL, H100-PCIe)\n" in got.err
    plan = json.loads(got.out)  # stdout is the plan alone
    assert plan["precision"] == "bf16" and plan["memory_available_gib"] == 80


def test_plan_takes_a_family_name_with_a_size_as_the_part_of_that_size_and_checks_its_fit(tracking_uri, capsys):
    # a fresh user's "--accelerator A100-40GB" was the size-less A100 row: "the memory of a A100 is unknown, so
    # it is not checked", exit 0 and no fit line
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    assert dry_run(TrainConfig(model="llama-7b"), accelerator_short="A100-40GB", as_json=True) == 0  # a plan, not a run
    got = capsys.readouterr()
    assert ("llmeff: accelerator 'A100-40GB' taken as A100-SXM4-40GB (also A100-PCIe-40GB: the same peaks and "
            "memory)\n") in got.err
    plan = json.loads(got.out)
    assert plan["memory_available_gib"] == 40 and plan["fits"] is False
    assert plan["fit"].startswith("does not fit a 40 GiB A100-SXM4-40GB: llama-7b needs about 126 GiB per device")


@pytest.mark.parametrize("word, article", [("80", "an"), ("40", "a"), ("11", "an"), ("8", "an"), ("141", "a"),
                                           ("A100", "an"), ("H200", "an"), ("MI300X", "an"), ("L4", "an"),
                                           ("B200", "a"), ("GB200", "a"), ("V100-SXM2", "a")])
def test_the_fit_lines_article_is_read_aloud(word, article):
    from mlflow_llmeff.train.launch import _a

    assert _a(word) == article


def test_a_prediction_from_other_models_says_it_is_scaled_by_flops(tracking_uri):
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.planning.plan import make_plan
    from mlflow_llmeff.planning.predict import add_predictions
    from mlflow_llmeff.train.config import TrainConfig

    client = mlflow.MlflowClient()
    rid = client.create_run("0", tags={names.ACCEL_SHORT: "cpu", names.MODEL_NAME: "llama-tiny",
                                       names.MODEL_PARAMS: "125632", **DEFAULTS}).info.run_id
    client.log_metric(rid, names.SUM_DEVICE_TFLOPS, 0.02)
    client.set_terminated(rid, "FINISHED")
    cfg = TrainConfig(model="llama-7b")
    plan = add_predictions(make_plan(cfg, accelerator_short="cpu", precision="fp32", strategy="single"), cfg,
                           client=client, accelerator_short="cpu", strategy="single", device_hour_usd=1.0)
    assert plan["prediction_basis"].startswith("median of 1 runs of other models on cpu, scaled by FLOPs per token")
    assert "llama-tiny, 125,632 params" in plan["prediction_basis"] and "rough guess" in plan["prediction_basis"]
    assert plan["predicted_tokens_per_sec"] == pytest.approx(0.02e12 / plan["flops_per_token_megatron"])
    assert plan["predicted_usd"] == pytest.approx(plan["predicted_wall_s"] / 3600)  # printed: a price is known


def test_plan_json_states_its_assumptions_and_the_accelerator_it_took(tracking_uri, capsys):
    # issue 28/30: "precision bf16" above weights at 4 B/param said nothing of fp32 master weights;
    # "--accelerator H100" was silently the H100-SXM row
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    cfg = TrainConfig(model="llama-7b", seq_len=4096, micro_batch_size=1, num_processes=8, parallelism="fsdp")
    assert dry_run(cfg, accelerator_short="H100", as_json=True) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["accelerator_given"], plan["accelerator_assumed"], plan["accelerator_alias_taken"]) == \
        ("H100", "H100-SXM", True)
    assert plan["accelerator_alias"] == "'H100' taken as H100-SXM (also: H100-NVL, H100-PCIe)"
    assert plan["precision"] == "bf16" and plan["master_weights"] == "fp32" and plan["weights"] == "fp32"
    assert plan["optimizer"] == "AdamW (torch.optim.AdamW, two fp32 moments)"
    assert plan["optimizer_states"] == "two moments in the weights' dtype (fp32: 8 B/param)"
    assert (plan["bytes_per_param_weights"], plan["bytes_per_param_gradients"], plan["bytes_per_param_optimizer"],
            plan["bytes_per_param_model_state"]) == (4, 4, 8, 16)
    assert plan["weights_held_as"] == "fp32 weights, the master copy; autocast runs the matmuls in bf16 (4 B)"
    assert plan["model_state_sharding"] == "all of it divided over the 8 ranks of a shard group"
    # the figures follow the stated bytes: 16 B/param over 8 shards (+ 4 B of step per tensor, 291 tensors)
    params = plan["params_total"]
    assert plan["memory_weights_gib"] + plan["memory_gradients_gib"] + plan["memory_optimizer_gib"] == \
        pytest.approx(params * 16 / 8 / 2**30)
    # the peak is one phase's, under the run's checkpointing (off): at seq 4096 the loss path's start
    assert plan["memory_peak_phase"] == "backward (loss)"
    assert plan["memory_peak_gib"] == plan["memory_total_gib"] > plan["memory_total_ckpt_gib"]


def test_plan_text_names_the_assumptions_and_a_short_name_is_no_alias(tracking_uri, capsys):
    from mlflow_llmeff.train.config import TrainConfig
    from mlflow_llmeff.train.launch import dry_run

    assert dry_run(TrainConfig(model="llama-7b", seq_len=4096, micro_batch_size=1), accelerator_short="H100-SXM") == 0
    out = capsys.readouterr().out
    assert "master_weights" in out and "bytes_per_param_optimizer" in out and "AdamW" in out
    assert any(line.split() == ["accelerator_alias_taken", "no"] for line in out.splitlines())
    assert any(line.split() == ["accelerator_given", "H100-SXM"] for line in out.splitlines())


@pytest.mark.parametrize("strategy, precision, per_param, sharding", [
    ("deepspeed_zero2", "bf16", (2, 2 + 4, 12), "gradients and optimizer state divided over the 4 data-parallel ranks"),
    ("deepspeed_zero1", "fp32", (4, 4, 12), "optimizer state divided over the 4 data-parallel ranks"),
    ("ddp", "bf16", (4, 4, 8), "a whole copy on every rank"),
])
def test_state_assumptions_by_strategy(strategy, precision, per_param, sharding):
    from mlflow_llmeff.parallel.degrees import Degrees
    from mlflow_llmeff.planning.plan import state_assumptions

    a = state_assumptions(strategy, precision, Degrees(dp_shard=4) if "zero" in strategy else Degrees(dp_replicate=4))
    assert (a["bytes_per_param_weights"], a["bytes_per_param_gradients"], a["bytes_per_param_optimizer"]) == per_param
    assert a["master_weights"] == "fp32" and a["model_state_sharding"] == sharding
    if strategy == "deepspeed_zero2":  # the 12 B hold the fp32 master copy
        assert a["optimizer_state"] == "fp32 master weights (4 B) + AdamW exp_avg and exp_avg_sq in fp32 (8 B)"
        assert a["weights_held_as"] == "bf16 working weights (2 B)"


def test_plan_json_for_a_deepspeed_strategy_is_json_alone_on_stdout():
    # a fresh process: DeepSpeed's import logs "Setting accelerator to CPU" to stdout (a trial's jq failed)
    from conftest import require

    require("deepspeed", "pip install 'mlflow-llmeff[deepspeed]' after torch")
    r = subprocess.run([sys.executable, "-m", "mlflow_llmeff", "plan", "--model", "llama-7b", "--seq-len", "4096",
                        "--micro-batch-size", "1", "--num-processes", "8", "--parallelism", "deepspeed_zero2",
                        "--precision", "bf16", "--accelerator", "H100", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert (plan["accelerator_assumed"], plan["bytes_per_param_gradients"]) == ("H100-SXM", 2 + 4)  # bf16 + fp32 copy


@pytest.mark.parametrize("as_json", [True, False])
def test_plan_of_a_deepspeed_strategy_needs_no_deepspeed(tracking_uri, monkeypatch, as_json):
    # a machine without DeepSpeed: `import deepspeed` fails (a None entry in sys.modules), the plan is arithmetic
    from click.testing import CliRunner

    from mlflow_llmeff.cli import main

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    args = ["plan", "--model", "llama-tiny", "--seq-len", "128", "--micro-batch-size", "1", "--num-processes", "2",
            "--parallelism", "deepspeed_zero3", "--precision", "bf16", "--accelerator", "H100-SXM"]
    r = CliRunner().invoke(main, args + (["--json"] if as_json else []))
    assert r.exit_code == 0, r.output
    install = "parallelism='deepspeed_zero3' needs the deepspeed package: install it after torch " \
              "(pip install 'mlflow-llmeff[deepspeed]')"
    if as_json:
        plan = json.loads(r.stdout)
        assert (plan["engine_installed"], plan["engine_missing"]) == (False, install)
        # bf16 ZeRO-3 over 2 ranks: 2/2 weights + (2 + 4)/2 gradients + 12/2 optimizer = 10 B/param
        p = plan["params_total"]
        assert plan["memory_weights_gib"] * 2**30 == 1.0 * p and plan["memory_gradients_gib"] * 2**30 == 3.0 * p
    else:
        lines = [line.split(None, 1) for line in r.stdout.splitlines()]
        assert ["engine_installed", "no"] in lines and ["engine_missing", install] in lines


def test_training_a_deepspeed_strategy_without_deepspeed_is_one_line(monkeypatch):
    from mlflow_llmeff.train.config import TrainConfig, validate

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    cfg = TrainConfig(parallelism="deepspeed_zero2", num_processes=2)
    with pytest.raises(ValueError, match=r"^parallelism='deepspeed_zero2' needs the deepspeed package: install it "
                                         r"after torch \(pip install 'mlflow-llmeff\[deepspeed\]'\)$"):
        validate(cfg, cuda_available=False, bf16_supported=True)
    validate(cfg, cuda_available=False, bf16_supported=True, engine=False)  # the plan's check passes


def test_a_plan_over_two_machines_is_predicted_from_runs_over_two_machines(tracking_uri):
    # a trial's 2-machine plan read 'median of 1 runs of llama-tiny's shape with ddp on 2 devices': a run of
    # 2 processes on one host, whose collectives never crossed a network
    import mlflow

    from mlflow_llmeff import names
    from mlflow_llmeff.planning.plan import make_plan
    from mlflow_llmeff.planning.predict import add_predictions
    from mlflow_llmeff.train.config import TrainConfig

    client = mlflow.MlflowClient()
    under = ("; all with precision bf16, optimizer adamw, fp32 weights, every weight trained, sdpa attention, not "
             "compiled, no activation checkpointing; threads intra-op 2, inter-op 2")
    for tflops, nodes in ((400.0, None), (100.0, "2")):  # one host (no nodes tag: an older run), two machines
        tags = {names.ACCEL_SHORT: "H100-SXM", names.MODEL_NAME: "llama-7b", names.PAR_STRATEGY: "ddp",
                names.ACCEL_COUNT: "2", **({names.NODES: nodes} if nodes else {}), **DEFAULTS,
                names.PRECISION: "bf16"}
        rid = client.create_run("0", tags=tags).info.run_id
        client.log_metric(rid, names.SUM_DEVICE_TFLOPS, tflops)
        client.set_terminated(rid, "FINISHED")
    for machines, processes, want, basis in (
            (2, 1, 100.0, "median of 1 runs of llama-7b's shape with ddp on 2 devices over 2 machines (other "
                          "sequence lengths or micro batches)" + under),
            (1, 2, 400.0, "median of 1 runs of llama-7b's shape with ddp on 2 devices (other sequence lengths or "
                          "micro batches)" + under)):
        cfg = TrainConfig(model="llama-7b", num_processes=processes, num_machines=machines, main_process_ip="10.0.0.1")
        plan = add_predictions(make_plan(cfg, accelerator_short="H100-SXM", precision="bf16", strategy="ddp"), cfg,
                               client=client, accelerator_short="H100-SXM", strategy="ddp")
        assert (plan["machines"], plan["devices"], plan["prediction_basis"]) == (machines, 2, basis)
        assert plan["predicted_tokens_per_sec"] == pytest.approx(want * 1e12 * 2 / plan["flops_per_token_megatron"])
