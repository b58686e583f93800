"""The bench scripts can fail: the GPU check exits 1 naming the steps that failed, and every name the
bench scripts import from the package exists (a module moved in the house move and left behind in a
shell heredoc is a check that can never run)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pathlib
import re
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
_FROM = re.compile(r"^\s*from (mlflow_llmeff[\w.]*) import ([\w, ]+)", re.M)


def _imports() -> list[tuple[str, str, str]]:
    """``(file, module, name)`` for each ``from mlflow_llmeff... import name`` in bench/ (python and shell)."""
    out = []
    for path in sorted(BENCH.iterdir()):
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlflow_llmeff"):
                    out += [(path.name, node.module, a.name) for a in node.names]
        elif path.suffix == ".sh":
            for mod, names in _FROM.findall(path.read_text()):
                out += [(path.name, mod, n.strip()) for n in names.split(",") if n.strip()]
    return out


def _missing(found) -> list[str]:
    from mlflow_llmeff import MOVED

    missing = []
    for file, mod, name in found:
        old = f"{mod}.{name}"[len("mlflow_llmeff."):]
        if old in MOVED or mod[len("mlflow_llmeff."):] in MOVED:  # served by the old-path shim only
            missing.append(f"{file}: from {mod} import {name} (moved to mlflow_llmeff.{MOVED.get(old, old)})")
            continue
        try:
            m = importlib.import_module(mod)
        except ImportError:
            missing.append(f"{file}: from {mod} import {name} (no module {mod})")
            continue
        if not hasattr(m, name):
            try:
                importlib.import_module(f"{mod}.{name}")
            except ImportError:
                missing.append(f"{file}: from {mod} import {name}")
    return missing


def test_every_name_a_bench_script_imports_from_the_package_exists_at_its_path():
    found = _imports()
    assert ("gpu_check.sh", "mlflow_llmeff.meters", "commprobe") in found  # the heredoc is read
    assert len(found) >= 10
    assert _missing(found) == []


def test_the_scan_names_a_moved_path_and_a_name_that_is_gone():
    # the old heredoc line (commprobe moved to meters/ in the house move) and a name that never was
    found = [("gpu_check.sh", m, n) for m, n in _FROM.findall(
        "    from mlflow_llmeff import commprobe\nfrom mlflow_llmeff.calc import nosuchthing\n")]
    assert _missing(found) == [
        "gpu_check.sh: from mlflow_llmeff import commprobe (moved to mlflow_llmeff.meters.commprobe)",
        "gpu_check.sh: from mlflow_llmeff.calc import nosuchthing"]


def _stubs(tmp_path: pathlib.Path, failing: str) -> dict:
    """A PATH whose ``python3`` prints 0 (no GPU) and exits 1 when its arguments contain ``failing``
    ("" fails every call), 0 otherwise, and whose ``nvidia-smi`` exits 0; ``OUT`` in ``tmp_path``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fail = f'case "$*" in *"{failing}"*) exit 1;; esac\n' if failing else "exit 1\n"
    for name, body in (("python3", "echo 0\n" + fail + "exit 0\n"), ("nvidia-smi", "exit 0\n")):
        p = bin_ / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_}:/usr/bin:/bin", "OUT": str(tmp_path / "out")}


def _gpu_check(env: dict) -> tuple[int, str]:
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout.strip().splitlines()[-1]


def test_the_gpu_check_exits_1_naming_each_failed_step(tmp_path):
    rc, last = _gpu_check(_stubs(tmp_path, ""))
    assert (rc, last) == (1, "NOT MET: gpu tests (exit 1);peak (exit 1);reference (exit 1);fsdp train (exit 1);"
                             "link (exit 1);summary (exit 1)")
    assert (tmp_path / "out" / "verdict.txt").read_text().strip() == last


def test_an_early_failed_step_fails_the_gpu_check(tmp_path):
    # only the gpu tests fail (python3 -m pytest): the steps after them pass, and the script still exits 1
    # (before, the exit status was the last step's: 0)
    assert _gpu_check(_stubs(tmp_path, "-m pytest")) == (1, "NOT MET: gpu tests (exit 1)")


def test_the_gpu_check_exits_0_when_every_step_ran(tmp_path):
    assert _gpu_check(_stubs(tmp_path, "nosuchargument")) == (0, "met: every step ran")


def _evals_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_evals", BENCH / "evals.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # its module level imports nothing heavy (lm-eval is imported in main)
    return mod


def test_the_evals_bench_names_each_missed_speed_up_target():
    ev = _evals_bench()
    rows = [("hellaswag", 259, 0, 1.79), ("hellaswag", 32000, 0, 2.58), ("mmlu", 259, 5, 2.9),
            ("mmlu", 259, 0, 1.2),  # 0-shot MMLU has no target (docs/evals.md)
            ("mmlu_anatomy", 32000, 5, 10.4)]
    assert ev.missed_targets(rows) == ["hellaswag vocab 259: 1.79x < 1.8x", "mmlu vocab 259: 2.90x < 3x"]
    assert ev.missed_targets([("hellaswag", 259, 0, 1.83), ("hellaswag", 32000, 0, 2.5)]) == []
    assert ev.missed_targets([("hellaswag", None, 0, 0.5)]) == []  # a model of one's own: no target
    assert ev.missed_targets([("mmlu", 259, 0, 1.2)], override=100) == ["mmlu vocab 259: 1.20x < 100x"]



def test_the_evals_bench_prints_no_position_count_it_did_not_see():
    ev = _evals_bench()
    assert ev._per_doc(780_000, 1000) == "780"
    assert ev._per_doc(0, 1000) == "-"  # ours scored in worker processes: the hook here saw none

@pytest.mark.slow
def test_the_evals_bench_exits_1_on_an_impossible_target(tmp_path, shared_data):
    import sys

    from conftest import require

    require("lm_eval", "pip install -e '.[dev]'")
    r = subprocess.run([sys.executable, str(BENCH / "evals.py"), "--tasks", "hellaswag", "--limit", "4",
                        "--rounds", "1", "--vocabs", "259", "--hidden", "64", "--layers", "1", "--target", "100",
                        "--data-dir", str(shared_data)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "target NOT met: hellaswag vocab 259: " in r.stderr and "x < 100x" in r.stderr
    assert "   target: 100x" in r.stdout


def _reference_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_reference", BENCH / "gpu_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # its module level imports nothing of torch or mlflow
    return mod


def test_the_gpu_reference_writes_the_flops_formula_out_by_hand_and_agrees_with_the_package():
    from mlflow_llmeff.calc.flops import flops_per_token
    from mlflow_llmeff.models.presets import load_config

    ref = _reference_bench()
    # Llama-1B (TinyLlama shape): L22 h2048 n32 g4 f5632 V32000, s = 2048, by hand:
    # 22 * 2048^2 * (12 + 12*4/32 + 18*5632/2048 + 6*2048/2048) + 6*2048*32000
    # = 92,274,688 * (12 + 1.5 + 49.5 + 6) + 393,216,000 = 6,366,953,472 + 393,216,000
    assert ref.flops_per_token(22, 2048, 32, 4, 5632, 32000, 2048) == 6_760_169_472
    assert flops_per_token(load_config("llama-1b"), 2048) == 6_760_169_472  # the bench's hand formula is the package's


def test_the_gpu_reference_names_each_missed_target():
    ref = _reference_bench()
    fpt = 6_760_169_472
    # llmeff 60,000 tok/s between bare loops of 62,000 and 61,000: ratio 60,000 / 61,500 = 0.9756;
    # MFU by hand 60,000 x 6.760169472e9 / 989.4e12 = 0.40996
    lines, missed = ref.verdict(llmeff_tps=60_000, bare_tps=[62_000, 61_000], mfu=0.40996, peak_tag="989.4", fpt=fpt,
                                peak_tflops=989.4, ratio_target=0.95, mfu_rel=0.01)
    assert missed == []
    assert "ratio 0.9756 (target >= 0.95: met)" in lines[0]
    assert "by hand 0.4100" in lines[1]
    lines, missed = ref.verdict(llmeff_tps=50_000, bare_tps=[62_000, 61_000], mfu=0.45, peak_tag="312", fpt=fpt,
                                peak_tflops=989.4, ratio_target=0.95, mfu_rel=0.01)
    # 50,000 / 61,500 = 0.8130; by hand 50,000 x 6.760169472e9 / 989.4e12 = 0.34163, and 0.45 is 31.7% above it
    assert missed == ["tokens/s ratio 0.8130 < 0.95", "summary/mfu 0.4500 vs 0.3416 by hand",
                      "llmeff.peak.tflops 312 != 989.4"]
    assert ref.verdict(llmeff_tps=60_000, bare_tps=[60_000], mfu=None, peak_tag=None, fpt=fpt, peak_tflops=989.4,
                       ratio_target=0.95, mfu_rel=0.01)[1] == ["summary/mfu absent"]


def _data_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_data", BENCH / "data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # its module level imports the standard library only
    return mod


# two training runs that meet their targets: trainer RSS 1.2 GB, set-up 40 s then 2 s (0.05), the cache read
FIRST = {"peak_trainer_rss_gb": 1.2, "setup_s": 40.0, "hit": False}
SECOND = {"peak_trainer_rss_gb": 1.1, "setup_s": 2.0, "hit": True}


def test_the_data_bench_counts_a_skipped_throughput_target_as_not_measured_never_as_met():
    data = _data_bench()
    met = {"bare_s": 10.0, "ours_s": 12.5}  # 0.80x >= 0.70x
    assert data.verdict(FIRST, SECOND, met, None) == ([], [])
    # --skip-throughput: the 0.70x target has no figure. It read as met before, and the script exited 0
    assert data.verdict(FIRST, SECOND, None, None) == (
        [], ["throughput ours / bare >= 0.70x (--skip-throughput)"])
    assert data.verdict(FIRST, SECOND, None, None, bpe_asked=True)[1] == [
        "throughput ours / bare >= 0.70x (--skip-throughput)",
        "BPE: throughput ours / bare >= 0.70x (--skip-throughput with --bpe)"]
    # measured and missed: 10 / 20 = 0.50x, and the 2nd set-up 5 s of 40 (0.125)
    assert data.verdict(FIRST, {**SECOND, "setup_s": 5.0}, {"bare_s": 10.0, "ours_s": 20.0}, None) == (
        ["2nd / 1st data set-up < 0.10", "throughput ours / bare >= 0.70x"], [])


def test_the_data_bench_exits_1_saying_not_measured_when_its_throughput_step_is_skipped(monkeypatch, capsys):
    data = _data_bench()
    runs = iter([dict(FIRST, tokens=1000, blocks=8, peak_rss_gb=1.5, peak_anon_gb=1.0, wall_s=50.0),
                 dict(SECOND, tokens=1000, blocks=8, peak_rss_gb=1.4, peak_anon_gb=0.9, wall_s=10.0)])
    monkeypatch.setattr(data, "train_once", lambda *a, **k: next(runs))  # no training: the verdict's exit only
    monkeypatch.setattr(data, "generate", lambda path, size_mb, seed=0: open(path, "w").write("{}\n") and 1)
    monkeypatch.setattr("sys.argv", ["data.py", "--size-mb", "0.001", "--skip-throughput"])
    with pytest.raises(SystemExit) as done:
        data.main()
    assert done.value.code == 1
    assert capsys.readouterr().err.strip() == "target NOT MEASURED: throughput ours / bare >= 0.70x (--skip-throughput)"


# ------------------------------------------------------------------------------ bench/peers.py
def _peers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_peers", BENCH / "peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _round(bare, llmeff, other=0.02, steal=0.0, **more):
    return {"tps": {"bare": bare, **more, "llmeff": llmeff}, "other": other, "steal": steal, "load": 0.5}


def test_peers_reads_the_target_from_the_median_of_the_quiet_rounds_only():
    peers = _peers()
    rounds = [_round(1000, 1010, accelerate=990), _round(1000, 700, other=0.6, accelerate=600),  # contended
              _round(1000, 1030, accelerate=1000)]
    lines, status = peers.verdict(rounds, target=1.0, quiet_other=0.10, quiet_steal=0.02)
    assert status == 0
    assert lines[1].startswith("round 2 (CONTENDED: 60% others, 0% steal, load 0.50)")
    assert "ratio llmeff/bare: median 1.010x over 3 rounds, 1.020x over 2 quiet" in lines
    assert "ratio accelerate/bare: median 0.990x over 3 rounds, 0.995x over 2 quiet" in lines
    assert lines[-1] == "target llmeff/bare >= 1 in the median of 2 quiet rounds: 1.020x met"


def test_peers_exits_1_below_the_target_and_2_without_a_quiet_round():
    peers = _peers()
    slow = [_round(1000, 980), _round(1000, 990), _round(1000, 1200, steal=0.05)]  # the fast one was stolen from
    lines, status = peers.verdict(slow, target=1.0, quiet_other=0.10, quiet_steal=0.02)
    assert status == 1 and lines[-1] == "target llmeff/bare >= 1 in the median of 2 quiet rounds: 0.985x NOT met"
    busy = [_round(1000, 1100, other=0.5), _round(1000, 1100, other=None)]  # an unread share is not quiet
    lines, status = peers.verdict(busy, target=1.0, quiet_other=0.10, quiet_steal=0.02)
    assert status == 2 and "not resolvable (no quiet round" in lines[-1]
    assert "ratio llmeff/bare: median 1.100x over 2 rounds, no quiet round" in lines


def test_peers_interleaves_the_contenders_and_prints_the_ratios(monkeypatch, capsys):
    peers = _peers()
    from mlflow_llmeff.meters import contention as ct

    runs, tps = [], {"bare": 1000.0, "accelerate": 990.0, "trainer": 960.0, "llmeff": 1010.0}
    monkeypatch.setattr(peers, "_contender", lambda args, name: runs.append(name) or {"tokens_per_sec": tps[name]})
    ticks = iter([ct.HostCpu(total=0, busy=0, steal=0), ct.HostCpu(total=1000, busy=50, steal=0)] * 3)
    monkeypatch.setattr(ct, "read_host_cpu", lambda *a: next(ticks))
    monkeypatch.setattr(peers, "_cpu_s", lambda: 0.0)
    with pytest.raises(SystemExit) as done:
        peers.main(["--rounds", "3", "--steps", "4", "--warmup", "1"])
    assert done.value.code == 0
    assert runs == [*peers.CONTENDERS, *peers.CONTENDERS[::-1], *peers.CONTENDERS]  # reversed every other round
    out = capsys.readouterr().out
    assert "ratio accelerate/bare: median 0.990x over 3 rounds, 0.990x over 3 quiet" in out
    assert "ratio trainer/bare: median 0.960x over 3 rounds" in out
    assert "target llmeff/bare >= 1 in the median of 3 quiet rounds: 1.010x met" in out


def test_peers_gives_each_contenders_cpu_a_step_and_names_unlike_threads():
    peers = _peers()
    rounds = [{**_round(1000, 1010), "cpu": {"bare": 20.0, "llmeff": 19.0}, "threads": {"bare": "intra 1, inter 2",
                                                                                       "llmeff": "intra 1, inter 2"}},
              {**_round(1000, 990), "cpu": {"bare": 22.0, "llmeff": 20.0}, "threads": {"bare": "intra 1, inter 2",
                                                                                      "llmeff": "intra 2, inter 2"}}]
    lines, status = peers.verdict(rounds, target=1.0, quiet_other=0.10, quiet_steal=0.02)
    assert status == 0  # the target is read from the tokens/s: median of 1.010 and 0.990
    assert "cpu per steady step bare: median 21.00 ms over 2 rounds" in lines
    # bare/llmeff per round: 20/19 = 1.0526, 22/20 = 1.1; their median 1.0763
    assert ("cpu per steady step llmeff: median 19.50 ms over 2 rounds (bare/llmeff 1.076x: above 1, llmeff spends "
            "less CPU a step)") in lines
    assert ("threads differ (round 2: bare intra 1, inter 2, llmeff intra 2, inter 2): the ratios compare unlike "
            "settings") in lines


def test_peers_bare_contender_trains_its_steady_steps(capsys):
    peers = _peers()
    peers.main(["--run", "bare", "--seq-len", "16", "--micro-batch-size", "2", "--steps", "3", "--warmup", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"tokens_per_sec", "cpu_ms_per_step", "threads"} and out["tokens_per_sec"] > 0
    assert out["cpu_ms_per_step"] > 0 and out["threads"].startswith("intra ")
