"""meters/memory.py and the monitor's memory component: bytes as stored, checked by hand on tiny models.

The low-bit optimizers' figures are exact sums over the states' shapes (codes, scales, tables, steps),
derived in each test; the CUDA-only parts run over fakes (a ``torch.cuda`` stand-in, the fake NVML).
"""

from __future__ import annotations

import os
import pathlib
import types

import mlflow
import pytest
import torch

from mlflow_llmeff import names
from mlflow_llmeff.meters import memory as mem
from mlflow_llmeff.meters.probes import model_state_bytes
from mlflow_llmeff.monitor.memwatch import SNAPSHOT_ARTIFACT, MemoryWatch
from mlflow_llmeff.testing import FakeClock, FakeGpu, FakeProcess, fake_nvml

from conftest import require, use_store

GIB = 2 ** 30
#: the "hidden 512" model of the low-bit tests: a 32000 x 512 embedding and two 512 x 512 layers
N_BIG = 32000 * 512 + 2 * 512 * 512  # 16,908,288 parameters in 3 tensors


@pytest.fixture
def tracking_uri(module_store, monkeypatch):
    yield from use_store(module_store, monkeypatch)


def _tiny():
    # 8x4 weight (32), 4x2 weight (8) + bias (2): 42 parameters in 3 tensors
    return torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 2))


def _step(model, opt, x):
    model(x).float().sum().backward()
    opt.step()


def _big(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32000, 512), torch.nn.Linear(512, 512, bias=False),
                               torch.nn.Linear(512, 512, bias=False)).to(dtype)


def _ids():
    return torch.randint(0, 32000, (2, 8))


# ---------------------------------------------------------------------------------------------- stored bytes
def test_torch_adamw_holds_8_bytes_a_parameter_plus_a_4_byte_step_per_tensor_and_16_of_model_state():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt, torch.ones(3, 8))
    s = mem.state_split(model, opt)
    assert (s.params, s.weights, s.gradients) == (42, 4 * 42, 4 * 42)
    assert s.optimizer_state == 8 * 42 + 3 * 4  # exp_avg, exp_avg_sq in fp32; a 0-d fp32 step per tensor
    assert s.counters == 12
    assert s.per_param_total / s.params == 16.0
    assert model_state_bytes(model, opt) == (16 * 42, 42)  # the probe keeps its figure


def test_gradients_not_yet_allocated_count_at_their_parameters_size_and_frozen_ones_not_at_all():
    model = _tiny()
    model[0].weight.requires_grad_(False)
    s = mem.state_split(model, None)
    assert (s.weights, s.gradients, s.optimizer_state) == (4 * 42, 4 * 10, 0)


def test_tied_weights_count_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 4)
            self.head = torch.nn.Linear(4, 16, bias=False)
            self.head.weight = self.emb.weight

    s = mem.state_split(Tied(), None)
    assert (s.params, s.weights, s.gradients) == (64, 256, 256)


def test_a_view_counts_its_storage_once():
    t = torch.zeros(4, 8)
    seen: set[int] = set()
    assert mem.stored_bytes([t, t[1:3], t.view(-1), {"again": t.t()}], seen) == 128
    assert mem.stored_bytes(t[0], seen) == 0  # the same seen set: already counted


def test_a_0d_tensor_counts_its_bytes_and_a_meta_tensor_none():
    assert mem.stored_bytes(torch.tensor(1.0), set()) == 4
    assert mem.stored_bytes(torch.empty(1000, device="meta"), set()) == 0


class Packed(torch.Tensor):
    """A wrapper subclass whose values are ``codes`` (uint8) and a ``scale`` per 256 (torch's traceable
    subclass protocol, as torch/testing/_internal/two_tensor.py writes one), shown as float32."""

    @staticmethod
    def __new__(cls, codes, scale):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes, scale):
        self.codes, self.scale = codes, scale

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Packed(inner["codes"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_a_tensor_subclass_counts_its_inner_tensors_not_the_dtype_it_shows():
    p = Packed(torch.zeros(1024, dtype=torch.uint8), torch.zeros(4))
    assert p.numel() * p.element_size() == 4096  # what counting the shown float32 said
    assert mem.stored_bytes(p, set()) == 1024 + 16


def test_state_dtypes_reads_codes_scales_and_tables_off_a_subclass():
    opt = types.SimpleNamespace(state={torch.zeros(1024): {"step": torch.tensor(1.0), "m": Packed(
        torch.zeros(1024, dtype=torch.uint8), torch.zeros(4))}}, param_groups=[])
    assert mem.state_dtypes(opt) == "uint8 codes + fp32 scales"


# ---------------------------------------------------------------------------------------------- bitsandbytes
@pytest.fixture(scope="module")
def bnb_fp32():
    bnb = require("bitsandbytes", "pip install bitsandbytes")
    model = _big()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    _step(model, opt, _ids())
    return model, opt


#: bitsandbytes 8-bit AdamW (blockwise, 256 a block) on the hidden-512 model: two uint8 states of every
#: element, an fp32 absmax per 256 of each (64,000 + 1,024 + 1,024 blocks), and the two 256-entry fp32
#: quantization maps every parameter's state shares (qmap1, qmap2: bitsandbytes' name2qmap), once
BNB_STATE = 2 * N_BIG + 2 * 4 * (64000 + 1024 + 1024) + 2 * 256 * 4  # 34,347,008 bytes


def test_bitsandbytes_adamw8bit_holds_2_03_bytes_a_parameter_with_its_tables_once(bnb_fp32):
    model, opt = bnb_fp32
    s = mem.state_split(model, opt)
    assert s.optimizer_state == BNB_STATE
    assert s.optimizer_state / s.params == pytest.approx(2.03, rel=0.02)  # 2.0314
    tables = {st[k].untyped_storage().data_ptr() for st in opt.state.values() for k in ("qmap1", "qmap2")}
    assert len(tables) == 2 and len(opt.state) == 3  # 6 references, 2 tables
    assert s.per_param_total == 8 * N_BIG + BNB_STATE


def test_the_bitsandbytes_tag_names_its_codes_scales_and_tables(bnb_fp32):
    _, opt = bnb_fp32
    assert mem.optimizer_tag(opt, "llmeff train --optimizer bnb-adamw8bit") == (
        "AdamW8bit (bitsandbytes.optim); states uint8 codes + fp32 scales + fp32 tables; "
        "from llmeff train --optimizer bnb-adamw8bit")


def test_bf16_weights_and_8bit_states_hold_6_03_bytes_a_parameter():
    bnb = require("bitsandbytes", "pip install bitsandbytes")
    model = _big(torch.bfloat16)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    _step(model, opt, _ids())
    s = mem.state_split(model, opt)
    assert (s.weights, s.gradients, s.optimizer_state) == (2 * N_BIG, 2 * N_BIG, BNB_STATE)
    assert s.per_param_total / s.params == (4 * N_BIG + BNB_STATE) / N_BIG  # 2 + 2 + 2.0314 = 6.0314
    assert mem.weights_tag(model) == "bf16"


# ---------------------------------------------------------------------------------------------- torchao
def _torchao_optim():
    folder = os.environ.get("LLMEFF_TORCHAO_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".venv" / "torchao"))
    if os.path.isdir(folder) and folder not in __import__("sys").path:
        __import__("sys").path.insert(0, folder)
    return require("torchao.optim", "pip install --no-deps --target .venv/torchao torchao")


@pytest.fixture(scope="module")
def ao8():
    model = _big()
    opt = _torchao_optim().AdamW8bit(model.parameters(), lr=1e-3)
    _step(model, opt, _ids())  # the first step compiles (15-90 s)
    return model, opt


@pytest.fixture(scope="module")
def ao4():
    model = _big()
    opt = _torchao_optim().AdamW4bit(model.parameters(), lr=1e-3)
    _step(model, opt, _ids())
    return model, opt


def test_torchao_adamw8bit_counts_its_codes_scales_and_tables_at_2_03_bytes_a_parameter(ao8):
    model, opt = ao8
    s = mem.state_split(model, opt)
    # per state: uint8 codes, an fp32 scale per 256, its own 256-entry fp32 qmap; a 0-d fp32 step per tensor
    assert s.optimizer_state == 2 * N_BIG + 2 * 4 * (N_BIG // 256) + 3 * 2 * 1024 + 3 * 4
    assert s.optimizer_state / s.params == pytest.approx(2.03, rel=0.02)  # 2.0316, not the shown float32's 8
    assert s.per_param_total / s.params == pytest.approx(10.03, rel=0.001)
    assert mem.optimizer_tag(opt, None) == ("AdamW8bit (torchao.optim); states uint8 codes + fp32 scales + fp32 "
                                            "tables; from the user's loop")


def test_torchao_adamw4bit_counts_two_codes_a_byte_at_1_06_bytes_a_parameter(ao4):
    model, opt = ao4
    s = mem.state_split(model, opt)
    # per state: 4-bit codes two a byte, an fp32 scale per 128, a 16-entry fp32 qmap; a step per tensor
    assert s.optimizer_state == 2 * N_BIG // 2 + 2 * 4 * (N_BIG // 128) + 3 * 2 * 64 + 3 * 4
    assert s.optimizer_state / s.params == pytest.approx(1.06, rel=0.02)  # 1.0625
    assert mem.state_dtypes(opt) == "4-bit codes (uint8) + fp32 scales + fp32 tables"


def test_bf16_weights_and_4bit_states_hold_5_06_bytes_a_parameter_within_the_4_to_6_the_levers_promise():
    # the seed's 16-32 B/param brought to 4-6: pure bf16 weights and gradients (2 + 2) and torchao's 4-bit moments
    # (1.06: two codes a byte and an fp32 scale per 128); with 8-bit moments it is 6.03, the block scales' 0.03
    model = _big(torch.bfloat16)
    opt = _torchao_optim().AdamW4bit(model.parameters(), lr=1e-3)
    _step(model, opt, _ids())
    s = mem.state_split(model, opt)
    state = 2 * N_BIG // 2 + 2 * 4 * (N_BIG // 128) + 3 * 2 * 64 + 3 * 4
    assert (s.weights, s.gradients, s.optimizer_state) == (2 * N_BIG, 2 * N_BIG, state)
    assert s.per_param_total / s.params == pytest.approx(5.0625, abs=1e-4) and s.per_param_total / s.params <= 6
    assert mem.weights_tag(model) == "bf16"


# ---------------------------------------------------------------------------------------------- tags
def test_optimizer_tag_before_the_first_step_says_the_states_are_not_allocated():
    opt = torch.optim.AdamW(_tiny().parameters())
    assert mem.optimizer_tag(opt, None) == "AdamW (torch.optim); states not yet allocated; from the user's loop"


def test_a_wrapped_optimizer_is_named_by_the_one_it_wraps():
    model = _tiny()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, inner, torch.ones(1, 8))
    wrapper = types.SimpleNamespace(optimizer=inner)  # Accelerate's AcceleratedOptimizer keeps it here
    assert mem.optimizer_tag(wrapper, "x") == "SGD (torch.optim); states fp32; from x"
    assert mem.state_split(model, wrapper).optimizer_state == 4 * 42  # one momentum buffer, no step tensor


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_tag_reads_the_models_config(impl):
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(_attn_implementation=impl)
    assert mem.attention_tag(model) == impl
    assert mem.attention_tag(torch.nn.Linear(2, 2)) == "unknown: the model has no config._attn_implementation"


def test_weights_tag_is_the_trainable_parameters_dtype():
    model = _tiny()
    assert mem.weights_tag(model) == "fp32"
    model[0].to(torch.bfloat16)  # 32 of 42 trainable elements
    assert mem.weights_tag(model) == "bf16 (of the trainable weights also fp32 24%)"
    model[1].requires_grad_(False)
    assert mem.weights_tag(model) == "bf16"


# ---------------------------------------------------------------------------------------------- the CPU
def _status(path, rss_kib, hwm_kib):
    path.write_text(f"Name:\tpython\nVmHWM:\t{hwm_kib} kB\nVmRSS:\t{rss_kib} kB\n")


def test_cpu_peak_is_the_rss_above_the_start_plus_the_state_held_then(tmp_path):
    status, clear = tmp_path / "status", tmp_path / "clear_refs"
    _status(status, 100_000, 250_000)
    peak = mem.CpuPeak(str(status), str(clear))
    peak.start(state_bytes=5_000)
    assert clear.read_text() == "5"  # proc(5): resets VmHWM to VmRSS
    _status(status, 120_000, 300_000)
    assert peak.peak() == ((300_000 - 100_000) * 1024 + 5_000, 300_000 * 1024)
    assert peak.source.startswith("cpu: peak RSS (VmHWM, reset by clear_refs")


def test_cpu_peak_without_a_reset_is_the_whole_process_and_says_so(tmp_path):
    status = tmp_path / "status"
    _status(status, 100_000, 250_000)
    peak = mem.CpuPeak(str(status), str(tmp_path / "no" / "clear_refs"))
    peak.start(state_bytes=5_000)
    assert peak.peak() == (250_000 * 1024, 250_000 * 1024)
    assert "the reset failed" in peak.source


def test_the_real_proc_files_read_and_reset():
    got = mem.rss_bytes()
    assert got is not None and 0 < got[0] <= got[1]


def _tree(root, files: dict[str, str]):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


MEMINFO = {"proc/meminfo": "MemTotal:       33554432 kB\nMemFree: 1 kB\n"}  # 32 GiB


@pytest.mark.parametrize("files, capacity, where", [
    ({"proc/self/cgroup": "0::/job/step\n", "sys/fs/cgroup/job/memory.max": "8589934592\n",
      "sys/fs/cgroup/job/step/memory.max": "max\n"}, 8 * GIB, "cgroup v2 memory.max (/sys/fs/cgroup/job/memory.max)"),
    ({"proc/self/cgroup": "4:memory:/a\n0::/\n", "sys/fs/cgroup/memory/a/memory.limit_in_bytes": "4294967296\n",
      "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}, 4 * GIB,
     "cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory/a/memory.limit_in_bytes)"),
    ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": "max\n"}, 32 * GIB, "host memory"),
    ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": str(64 * GIB)}, 32 * GIB, "host memory"),
])
def test_capacity_is_the_smallest_cgroup_limit_up_the_hierarchy_else_the_host(tmp_path, files, capacity, where):
    got, text = mem.memory_capacity(_tree(tmp_path, {**MEMINFO, **files}))
    assert got == capacity
    assert text.startswith(where), text


# ---------------------------------------------------------------------------------------------- CUDA, faked
class FakeCuda:
    """``torch.cuda`` as MemoryWatch reads it: allocator peaks, the device's memory, statistics, history."""

    def __init__(self, peak, reserved, total, retries=0, ooms=0):
        self.peak, self.reserved, self.total, self.stats = peak, reserved, total, {
            "num_alloc_retries": retries, "num_ooms": ooms}
        self.recorded: list[dict] = []
        self.memory = types.SimpleNamespace(_record_memory_history=lambda **kw: self.recorded.append(kw),
                                            _dump_snapshot=lambda path: pathlib.Path(path).write_bytes(b"snap"))

    def max_memory_allocated(self, device=None):
        return self.peak

    def max_memory_reserved(self, device=None):
        return self.reserved

    def memory_stats(self, device=None):
        return self.stats

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(total_memory=self.total, uuid="GPU-0")

    def current_device(self):
        return 0


def _cuda_watch(cuda, used=5 * GIB, env=None):
    gpu = FakeGpu(uuid="GPU-0", pci="0", watts=100.0, clock=lambda: 0.0,
                  processes=[FakeProcess(pid=os.getpid(), usedGpuMemory=used), FakeProcess(pid=1, usedGpuMemory=GIB)])
    return MemoryWatch(torch.device("cuda", 0), cuda=cuda, nvml=fake_nvml([gpu]), nvml_handle=gpu, env=env or {})


def test_cuda_figures_come_from_the_allocator_and_nvml():
    cuda = FakeCuda(peak=6 * GIB, reserved=8 * GIB, total=80 * GIB, retries=3, ooms=1)
    watch = _cuda_watch(cuda)
    model = _tiny()
    watch.start(model, None)
    assert cuda.recorded == [{"enabled": "all", "context": None, "stacks": "all", "max_entries": 100_000}]
    out, tags = watch.figures(model, None)
    assert out[names.SUM_MEM_ALLOC_RETRIES] == 3.0 and out[names.SUM_MEM_OOMS] == 1.0
    assert out[names.SUM_MEM_PEAK_GIB] == 6.0 and out[names.SUM_MEM_PEAK_FRACTION] == 0.1
    assert out[names.SUM_MEM_NVML_PROCESS_GIB] == 5.0  # this process's entry, not pid 1's
    assert out[names.SUM_MEM_OTHER_GIB] == 6.0 - 2 * 4 * 42 / GIB
    assert tags[names.MEMORY_CAPACITY].startswith("CUDA total memory")


def test_nvml_finds_this_processs_device_by_its_uuid_when_no_handle_is_given():
    other = FakeGpu(uuid="GPU-9", pci="9", watts=1.0, clock=lambda: 0.0, processes=[FakeProcess(os.getpid(), GIB)])
    mine = FakeGpu(uuid="GPU-0", pci="0", watts=1.0, clock=lambda: 0.0, processes=[FakeProcess(os.getpid(), 2 * GIB)])
    watch = MemoryWatch(torch.device("cuda", 1), cuda=FakeCuda(0, 0, 1), nvml=fake_nvml([other, mine]), env={})
    out, _ = watch.figures(_tiny(), None)
    assert out[names.SUM_MEM_NVML_PROCESS_GIB] == 2.0  # FakeCuda's device has UUID GPU-0


@pytest.mark.parametrize("env, recorded", [({"LLMEFF_MEMORY_HISTORY": "0"}, []), (
    {"LLMEFF_MEMORY_HISTORY": "stacks"}, [{"enabled": "all", "context": "all", "stacks": "python",
                                          "max_entries": 100_000}])])
def test_the_allocator_history_is_off_or_with_stacks_as_the_environment_says(env, recorded):
    cuda = FakeCuda(0, 0, 1)
    _cuda_watch(cuda, env=env).start(None, None)
    assert cuda.recorded == recorded


def test_an_out_of_memory_failure_dumps_the_snapshot_and_names_the_largest_term(tmp_path):
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt, torch.ones(1, 8))
    watch = _cuda_watch(FakeCuda(peak=3 * GIB, reserved=4 * GIB, total=80 * GIB))
    watch.start(model, opt)
    watch.figures(model, opt)
    logged = []
    logger = types.SimpleNamespace(log_file=lambda path, folder: logged.append((path, folder)))
    watch.given[names.ERROR] = "out of memory at step 7 (CUDA out of memory); try less"
    tags = watch.on_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), logger,
                            str(tmp_path))
    assert logged == [(str(tmp_path / "oom_snapshot.pickle"), "memory")]
    assert (tmp_path / "oom_snapshot.pickle").read_bytes() == b"snap"
    assert tags[names.MEMORY_SNAPSHOT].startswith(f"{SNAPSHOT_ARTIFACT} (open at pytorch.org/memory_viz); largest "
                                                  "term: other (activations, workspace, temporaries) 3.00 GiB")
    assert tags[names.ERROR].startswith("out of memory at step 7 (CUDA out of memory); try less; largest term: other")


def test_the_snapshot_stays_local_where_the_logger_cannot_log_files(tmp_path):
    watch = _cuda_watch(FakeCuda(peak=0, reserved=0, total=1))
    watch.start(None, None)
    watch.figures(_tiny(), None)
    tags = watch.on_failure(torch.OutOfMemoryError("CUDA out of memory."), object(), str(tmp_path))
    assert tags[names.MEMORY_SNAPSHOT].startswith(f"{tmp_path / 'oom_snapshot.pickle'} on ")
    assert tags[names.ERROR].startswith("CUDA out of memory (CUDA out of memory.); largest term: weights")


def test_another_failure_or_a_cpu_run_writes_no_snapshot(tmp_path):
    assert _cuda_watch(FakeCuda(0, 0, 1)).on_failure(ValueError("x"), None, str(tmp_path)) == {}
    assert MemoryWatch(torch.device("cpu")).on_failure(torch.OutOfMemoryError("x"), None, str(tmp_path)) == {}


# ---------------------------------------------------------------------------------------------- a monitor run
def test_a_monitored_run_logs_where_its_bytes_go_and_the_levers_tags(tracking_uri):
    from mlflow_llmeff.monitor.meter import EfficiencyMonitor
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    opt = torch.optim.AdamW(model.parameters())
    mon = EfficiencyMonitor(model=model, optimizer=opt, log_every_n_steps=1, warmup_steps=0, clock=FakeClock(),
                            measure_energy="none", optimizer_origin="llmeff train --optimizer adamw")
    ids = torch.randint(0, 256, (2, 8))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        mon.step(tokens=16, samples=2)
    out = mon.finish()
    run = mlflow.MlflowClient().get_run(mon.run_id)
    tags = run.data.tags
    assert tags[names.OPTIMIZER] == "AdamW (torch.optim); states fp32; from llmeff train --optimizer adamw"
    assert (tags[names.ATTENTION], tags[names.WEIGHTS]) == ("eager", "fp32")
    P = sum(p.numel() for p in model.parameters())  # embedding and head untied
    tensors = len(list(model.parameters()))
    assert out[names.SUM_MODEL_STATE_BYTES_PER_PARAM] == 16.0
    assert out[names.SUM_OPT_STATE_BYTES_PER_PARAM] == (8 * P + 4 * tensors) / P
    assert out[names.SUM_MEM_WEIGHTS_GIB] == out[names.SUM_MEM_GRADIENTS_GIB] == 4 * P / GIB
    assert out[names.SUM_MEM_OPT_STATE_GIB] == (8 * P + 4 * tensors) / GIB
    assert 0 < out[names.SUM_MEM_PEAK_FRACTION] <= 1 and names.SUM_MEM_PEAK_GIB in out
    assert names.SUM_MEM_ALLOC_RETRIES not in out  # CUDA only
    assert tags[names.MEMORY_CAPACITY].endswith("the fraction is the process's peak RSS (VmHWM) / it")
    assert "summary/memory/peak_gib: cpu: peak RSS (VmHWM, reset by clear_refs" in tags[names.MEMORY_SOURCE]
