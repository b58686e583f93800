"""The memory levers of ``llmeff train``: --optimizer, --weights, --attn-implementation (issue 50)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import types

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.calc.optimizers import OPTIMIZER_NAMES, OPTIMIZERS
from mlflow_llmeff.planning.spec import Machine, resolve
from mlflow_llmeff.train import config, optimizers as opts
from mlflow_llmeff.train.config import TrainConfig, validate
from mlflow_llmeff.train.optimizers import AdamWBf16, build_optimizer, missing

from conftest import require

#: torchao lives outside the venv (.ci/run: .venv/torchao, exported as LLMEFF_TORCHAO_DIR): installed in
#: the venv, transformers would import it at every model build.
TORCHAO_DIR = os.environ.get("LLMEFF_TORCHAO_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".venv" / "torchao"))
TORCHAO_HOW = "pip install --no-deps --target .venv/torchao torchao"
_real_find_spec = importlib.util.find_spec


def check(_cuda: bool = False, _bf16: bool = True, **kw):
    return validate(TrainConfig(**kw), cuda_available=_cuda, bf16_supported=_bf16)


def _fake_find_spec(monkeypatch, answer) -> None:
    """Replace the ``find_spec`` the checks call (train/config.py, train/optimizers.py), never the global
    one: transformers caches what it finds installed, and would then try to import a faked package."""
    def fake(name, *a):
        found = answer(name)
        return _real_find_spec(name, *a) if found is ... else found

    monkeypatch.setattr(config, "find_spec", fake)
    monkeypatch.setattr(opts, "find_spec", fake)


def without(monkeypatch, *modules: str, installed: tuple[str, ...] = ()) -> None:
    """Make ``find_spec`` say ``modules`` are not installed and ``installed`` are (a spec object; nothing is
    imported by the look-up)."""
    _fake_find_spec(monkeypatch, lambda name: None if name in modules else types.SimpleNamespace(name=name)
                    if name in installed else ...)


def with_fake(monkeypatch, *modules: str) -> None:
    """Make ``find_spec`` say ``modules`` are installed."""
    without(monkeypatch, installed=modules)


# ------------------------------------------------------------------------------------ refusals (a)
@pytest.mark.parametrize("kw, match", [
    (dict(optimizer="adam"), r"^optimizer='adam' is not accepted; use one of: adamw, adamw-bf16, adamw8bit, "
                             r"adamw4bit, bnb-adamw8bit, bnb-paged-adamw8bit, adafactor, sgd$"),
    (dict(weights="fp16"), r"^weights='fp16' is not accepted; use one of: fp32, bf16$"),
    (dict(weights="bf16", precision="fp32"), r"^weights=bf16 needs precision bf16 or auto \(precision='fp32'\); "
                                             r"accepted with precision='fp32': weights=fp32$"),
    (dict(weights="bf16", precision="fp16", _cuda=True), r"^weights=bf16 needs precision bf16 or auto"),
    (dict(weights="bf16", _cuda=True, _bf16=False), r"^weights=bf16 is not supported by this device .*weights=fp32$"),
    (dict(weights="bf16", parallelism="deepspeed_zero2", num_processes=2),
     r"^weights=bf16 with parallelism='deepspeed_zero2': DeepSpeed keeps its own fp32 master weights; "
     r"accepted with weights=bf16: single, ddp, fsdp, hsdp, tp, fsdp_tp, cp$"),
    (dict(attn_implementation="flash"), r"^attn_implementation='flash' is not accepted; use one of: sdpa, eager, "
                                        r"flash_attention_2, flash_attention_3, flex_attention$"),
    (dict(attn_implementation="flash_attention_2"),
     r"^attn_implementation='flash_attention_2' needs a CUDA device; accepted here: sdpa, eager$"),
    (dict(attn_implementation="flash_attention_3"),
     r"^attn_implementation='flash_attention_3' needs a CUDA device; accepted here: sdpa, eager$"),
    (dict(attn_implementation="flex_attention"),
     r"^attn_implementation='flex_attention' needs a CUDA device; accepted here: sdpa, eager$"),
])
def test_a_bad_lever_is_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        check(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("impl, module", [("flash_attention_2", "flash_attn"),
                                          ("flash_attention_3", "flash_attn_interface"),
                                          ("flex_attention", "torch.nn.attention.flex_attention")])
def test_an_attention_kernel_whose_package_is_missing_is_refused_on_cuda(monkeypatch, impl, module):
    without(monkeypatch, "flash_attn", "flash_attn_interface", "torch.nn.attention.flex_attention")
    with pytest.raises(ValueError, match=rf"^attn_implementation='{impl}' needs {module}, which is not installed "
                                         r"here \(.*\); accepted here: sdpa, eager$"):
        check(attn_implementation=impl, _cuda=True)


def test_an_installed_attention_kernel_on_cuda_validates(monkeypatch):
    with_fake(monkeypatch, "flash_attn")
    assert check(attn_implementation="flash_attention_2", _cuda=True).options.attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("name, package, extra", [
    ("adamw8bit", "torchao", "torchao"), ("adamw4bit", "torchao", "torchao"),
    ("bnb-adamw8bit", "bitsandbytes", "bnb"), ("bnb-paged-adamw8bit", "bitsandbytes", "bnb"),
])
def test_an_optimizer_whose_package_is_missing_is_refused_naming_the_extra(monkeypatch, name, package, extra):
    without(monkeypatch, "torchao", "bitsandbytes")
    with pytest.raises(ValueError, match=rf"^optimizer='{name}' needs {package}, which is not installed here; "
                                         rf"pip install 'mlflow-llmeff\[{extra}\]'$"):
        check(optimizer=name, _cuda=name == "bnb-paged-adamw8bit")  # paged states need CUDA first


def test_paged_8bit_states_are_refused_without_cuda_in_one_line():
    # a trial: accepted on CPU, where bitsandbytes falls back to unpaged states, and named 'bnbpaged8bit'
    with pytest.raises(ValueError, match=r"^optimizer='bnb-paged-adamw8bit' pages its states through CUDA unified "
                                         r"memory and needs a CUDA device .*; accepted here: bnb-adamw8bit$"):
        check(optimizer="bnb-paged-adamw8bit")


def test_a_plan_checks_the_levers_device_but_not_this_machines_packages(monkeypatch):
    # llmeff plan --accelerator H100-SXM on a laptop: arithmetic, as for the strategy's engine
    without(monkeypatch, "flash_attn", "torchao")
    spec = validate(TrainConfig(attn_implementation="flash_attention_2", optimizer="adamw8bit"),
                    Machine(cuda=True, bf16=True, accelerator="H100-SXM"), engine=False)
    assert (spec.options.attn_implementation, spec.options.optimizer) == ("flash_attention_2", "adamw8bit")
    with pytest.raises(ValueError, match=r"^attn_implementation='flash_attention_2' needs a CUDA device; "):
        validate(TrainConfig(attn_implementation="flash_attention_2"), Machine(cuda=False, bf16=True), engine=False)


def test_torchaos_compiled_step_needs_a_cpp_compiler_on_cpu_and_triton_on_cuda(monkeypatch):
    with_fake(monkeypatch, "torchao")
    monkeypatch.setattr(opts, "_cpp_compiler", lambda: None)
    assert "needs a C++ compiler" in missing("adamw8bit", cuda=False)
    without(monkeypatch, "triton", installed=("torchao",))
    assert missing("adamw4bit", cuda=True).startswith("optimizer='adamw4bit' compiles its step with torch.compile, "
                                                      "which on CUDA needs triton")


def test_a_compiling_optimizer_without_warmup_steps_is_refused(monkeypatch):
    # its first step holds the compilation: with no warm-up step it would count as a steady step
    with_fake(monkeypatch, "torchao")
    with pytest.raises(ValueError, match=r"^optimizer='adamw8bit' compiles its step on the first optimizer step; "
                                         r"warmup_steps=0 would count .*; use warmup_steps >= 1$"):
        check(optimizer="adamw8bit", warmup_steps=0)


@pytest.mark.parametrize("name", ["adamw", "adamw-bf16", "adafactor", "sgd"])
def test_torchs_optimizers_are_never_missing(name):
    assert missing(name, cuda=False) is None and missing(name, cuda=True) is None


def test_bf16_weights_resolve_precision_auto_to_bf16_without_autocast():
    cpu = Machine(cuda=False, bf16=True)
    spec = resolve(TrainConfig(weights="bf16"), cpu)
    assert (spec.precision, spec.weights, spec.mixed_precision) == ("bf16", "bf16", "no")
    assert resolve(TrainConfig(), cpu).precision == "fp32"  # fp32 weights: auto stays fp32 on CPU
    mixed = resolve(TrainConfig(precision="bf16"), cpu)
    assert (mixed.precision, mixed.weights, mixed.mixed_precision) == ("bf16", "fp32", "bf16")


# ------------------------------------------------------------------------------------ classes (b)
def _params():
    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256)  # 65,536 weights: large enough for every library's quantized states
    return m, [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]


def _expected_class(name: str):
    if name == "adamw-bf16":  # calc/optimizers.py names torch's AdamW, whose algorithm this is (train/optimizers.py)
        return AdamWBf16
    module, cls = OPTIMIZERS[name].cls.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)


def test_adamw_steps_with_torchs_fused_kernel_on_plain_cpu_parameters_and_matches_the_loop():
    import torch

    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    ref = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    fused = build_optimizer("adamw", (w for w in ws), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    loop = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True and len(fused.param_groups[0]["params"]) == 2  # a generator, read once
    for _ in range(3):
        for a, b in zip(ws, ref):
            a.grad = torch.full_like(a, 0.5)
            b.grad = torch.full_like(b, 0.5)
        fused.step()
        loop.step()
    for a, b in zip(ws, ref):  # the same AdamW update, one kernel per tensor
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_build_optimizer_returns_each_choices_class(monkeypatch, name):
    package = OPTIMIZERS[name].package
    if package == "torchao":
        if os.path.isdir(TORCHAO_DIR):
            monkeypatch.syspath_prepend(TORCHAO_DIR)
        require("torchao.optim", TORCHAO_HOW)
    elif package == "bitsandbytes":
        require("bitsandbytes")
    _, groups = _params()
    o = build_optimizer(name, groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert type(o) is _expected_class(name)
    assert [g["weight_decay"] for g in o.param_groups] == [0.1, 0.0]  # the groups' own decay is kept
    assert o.param_groups[0]["lr"] == 1e-3
    if name == "sgd":
        assert o.param_groups[0]["momentum"] == opts.SGD_MOMENTUM == 0.9
    if name.startswith(("adamw", "bnb")):
        assert tuple(o.param_groups[0]["betas"]) == (0.9, 0.95) and o.param_groups[0]["eps"] == 1e-8


def test_an_unknown_name_is_refused_by_build_optimizer():
    with pytest.raises(ValueError, match=r"^optimizer='lion' is not accepted; use one of: adamw, "):
        build_optimizer("lion", _params()[1], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def test_the_compile_note_is_printed_on_rank_0_for_torchao_only(capsys):
    from mlflow_llmeff.train.loop import _announce_compiled_step

    rank0 = types.SimpleNamespace(accelerator=types.SimpleNamespace(is_main_process=True))
    _announce_compiled_step(TrainConfig(optimizer="adamw8bit"), rank0)
    _announce_compiled_step(TrainConfig(optimizer="bnb-adamw8bit"), rank0)
    _announce_compiled_step(TrainConfig(optimizer="adamw4bit"),
                            types.SimpleNamespace(accelerator=types.SimpleNamespace(is_main_process=False)))
    assert capsys.readouterr().out.splitlines() == [
        "llmeff: torchao AdamW8bit compiles its step on the first optimizer step (torch.compile; counted as "
        "compile badput, not steady)"]


# ------------------------------------------------------------------------------------ AdamWBf16 (c)
#: bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of itself (the unit
#: roundoff). An early Adam update is at most about lr per element (|m_hat / sqrt(v_hat)| <= ~1); the rounding
#: of m (2^-8) and of v (2^-8, halved by the square root) moves it by under 1.5 x 2^-8 of itself. Per step:
#: lr x 2^-7, doubled for margin.
BF16_STEP_TOL = 2 ** -6


def _pair(dtype=torch.float32):
    torch.manual_seed(0)
    w = torch.randn(64, 48)
    # the reference starts from the same values (bf16 weights: the rounded ones, held in fp32)
    ours, ref = torch.nn.Parameter(w.clone().to(dtype)), torch.nn.Parameter(w.clone().to(dtype).float())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return ours, ref, AdamWBf16([ours], **kw), torch.optim.AdamW([ref], **kw)


def _step(params_and_opts, grad):
    for p, o in params_and_opts:
        p.grad = grad.to(p.dtype)
        o.step()


def test_adamw_bf16_stores_both_moments_in_bf16():
    ours, _, o, _ = _pair()
    _step([(ours, o)], torch.randn(64, 48))
    st = o.state[ours]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    assert st["exp_avg"].shape == st["exp_avg_sq"].shape == (64, 48) and float(st["step"]) == 1.0
    assert ours.dtype == torch.float32  # the weights keep their dtype


def test_one_adamw_bf16_step_matches_torch_adamw_on_fp32_moments():
    ours, ref, o, r = _pair()
    g = torch.randn(64, 48)
    _step([(ours, o), (ref, r)], g)
    # the first update is taken from the fp32 moments before they are rounded: equal up to fp32 arithmetic
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    # the stored moments are torch's, rounded to bf16 (at most 2^-8 of themselves)
    for k in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(o.state[ours][k].float(), r.state[ref][k], rtol=2 ** -8, atol=0)


def test_adamw_bf16_stays_within_bf16_rounding_of_torch_adamw_over_steps():
    ours, ref, o, r = _pair()
    torch.manual_seed(1)
    steps = 5
    for _ in range(steps):
        _step([(ours, o), (ref, r)], torch.randn(64, 48))
    drift = (ours - ref).abs().max().item()
    assert drift <= steps * 1e-2 * BF16_STEP_TOL, drift


def test_adamw_bf16_trains_bf16_weights_with_an_fp32_update():
    ours, ref, o, r = _pair(torch.bfloat16)
    g = torch.randn(64, 48)
    _step([(ours, o), (ref, r)], g)
    assert ours.dtype == torch.bfloat16
    # the fp32 result rounded once to the weights' bf16: within bf16's unit roundoff (2^-8 relative) of torch's
    torch.testing.assert_close(ours.float(), ref.detach(), rtol=2 ** -8, atol=1e-6)


def test_adamw_bf16_moments_stay_bf16_through_a_checkpoint():
    # torch's load_state_dict casts state tensors to the parameter's dtype (fp32 here)
    ours, _, o, _ = _pair()
    _step([(ours, o)], torch.randn(64, 48))
    again = AdamWBf16([ours], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    again.load_state_dict(o.state_dict())
    assert again.state[ours]["exp_avg"].dtype == again.state[ours]["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(again.state[ours]["exp_avg"], o.state[ours]["exp_avg"])


def test_adamw_bf16_refuses_a_bad_hyperparameter():
    with pytest.raises(ValueError, match=r"^betas=\(0.9, 1.0\) must be two values in \[0, 1\)$"):
        AdamWBf16([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))


# ------------------------------------------------------------------------------------ end to end (d)
@pytest.fixture(scope="module")
def bnb_bf16_run(module_store):
    """One real ``llmeff train`` run (in-process, tiny preset): bitsandbytes' 8-bit AdamW on pure bf16 weights."""
    require("bitsandbytes")
    from mlflow_llmeff.train.loop import run_training

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", module_store)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        mlflow.set_tracking_uri(module_store)
        try:
            out = run_training(TrainConfig(optimizer="bnb-adamw8bit", weights="bf16", max_steps=6, log_every_n_steps=3,
                                           seq_len=32, micro_batch_size=2, measure_energy="none"))
            run = mlflow.MlflowClient().get_run(out["run_id"])
        finally:
            mlflow.set_tracking_uri(None)
    return out, run


def test_a_bnb_8bit_run_on_bf16_weights_finishes_and_logs_its_levers(bnb_bf16_run):
    out, run = bnb_bf16_run
    assert run.info.status == "FINISHED"
    assert (run.data.params["optimizer"], run.data.params["weights"], run.data.params["precision"]) == (
        "bnb-adamw8bit", "bf16", "auto")
    assert run.data.tags[names.PRECISION] == "bf16"  # auto resolved to bf16 by weights=bf16, on CPU too
    # read back from the trained model and optimizer by the meter, the origin as train/loop.py gives it
    assert run.data.tags[names.WEIGHTS] == "bf16" and run.data.tags[names.ATTENTION] == "sdpa"
    assert run.data.tags[names.OPTIMIZER].startswith("AdamW8bit (bitsandbytes.optim)")
    assert run.data.tags[names.OPTIMIZER].endswith("from llmeff train --optimizer bnb-adamw8bit")
    assert run.data.tags[names.COMPILE] == "false"  # bitsandbytes compiles nothing
    assert out["summary"][names.SUM_STEPS] == 6


def test_a_bnb_8bit_run_on_bf16_weights_holds_far_less_than_16_bytes_a_parameter(bnb_bf16_run):
    # fp32 AdamW holds 4 + 4 + 8 = 16 B/param; bf16 weights and gradients 2 + 2, bitsandbytes' states
    # about 2.03 B on the large tensors and fp32 (8 B) on those under 4,096 elements
    bpp = bnb_bf16_run[0]["summary"][names.SUM_MODEL_STATE_BYTES_PER_PARAM]
    assert 4.0 < bpp < 8.0, bpp
