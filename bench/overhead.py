"""Overhead of mlflow_llmeff's per-step instrumentation, measured side by side in one process.

Prints the ratio of tokens/s of a training loop instrumented the way ``llmeff train`` does it
(on-device token counting every micro-batch; at every logged step: window edge, rates, MFU inputs,
asynchronous batched MLflow logging to a real sqlite store) to the same loop bare, on the same
tiny model. Contenders run interleaved in rounds and the median of the per-round ratios is
reported, because this machine is shared and noisy. Target: ratio >= 0.99 (overhead <= 1%).

Two more contenders measure the user-facing paths on an identical second copy of the model:
``monitor`` (an explicit ``EfficiencyMonitor.step(batch=..., loss=...)`` per step) and ``autolog``
(``mlflow_llmeff.autolog()``: forward hook + optimizer step hook, nothing in the loop). Autolog's
global optimizer hook also sees the other contenders' optimizer steps and ignores them (one Python
call each, which slightly favours the autolog ratio's denominator staying honest: bare pays it too).

    python bench/overhead.py [--steps 30] [--rounds 7] [--log-every 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per contender per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()

    import mlflow
    import torch

    from mlflow_llmeff import names
    from mlflow_llmeff.counting import BatchCounter
    from mlflow_llmeff.flops import flops_per_token
    from mlflow_llmeff.throughput import ThroughputMeter
    from mlflow_llmeff.tracking.logger import RunLogger
    from mlflow_llmeff.train.models import build_model, load_config

    torch.manual_seed(0)
    cfg = load_config("llama-tiny")
    model = build_model("llama-tiny", cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def train_step():
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    tmp = tempfile.mkdtemp()
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/bench.db")
    client = mlflow.MlflowClient()
    run_id = client.create_run("0").info.run_id
    logger = RunLogger(run_id, client)
    logged_step = [0]

    # ---- user-facing paths: EfficiencyMonitor on the same model, autolog on an identical copy ------------
    import mlflow_llmeff
    from mlflow_llmeff.monitor import EfficiencyMonitor

    mon_run = client.create_run("0").info.run_id

    def monitor(n):
        mon = EfficiencyMonitor(model=model, optimizer=opt, log_every_n_steps=args.log_every, warmup_steps=0,
                                measure_energy="none", run_id=mon_run)  # set-up (tags) outside the timing
        t0 = time.perf_counter()
        for _ in range(n):
            mon.step(batch=batch, loss=train_step())
        tput = n * args.batch * args.seq_len / (time.perf_counter() - t0)
        mon.finish()
        return tput

    mlflow_llmeff.autolog(log_every_n_steps=args.log_every, warmup_steps=0, measure_energy="none", silent=True)
    torch.manual_seed(0)
    model2 = build_model("llama-tiny", cfg)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-4)

    def train_step2():
        out = model2(**batch)
        out.loss.backward()
        opt2.step()
        opt2.zero_grad(set_to_none=True)

    train_step2()  # the first forward hooks model2 and opens the autolog run (outside the timing)

    def autolog(n):
        t0 = time.perf_counter()
        for _ in range(n):
            train_step2()
        return n * args.batch * args.seq_len / (time.perf_counter() - t0)

    def bare(n):
        t0 = time.perf_counter()
        for _ in range(n):
            train_step()
        return n * args.batch * args.seq_len / (time.perf_counter() - t0)

    def instrumented(n):
        counter = BatchCounter()
        meter = ThroughputMeter(num_devices=1, warmup_steps=0)
        loss_sum = torch.zeros(2, dtype=torch.float64)
        t0 = time.perf_counter()
        meter.begin()
        last = 0
        for step in range(1, n + 1):
            loss = train_step()
            counter.add(batch["input_ids"], batch["attention_mask"], batch["labels"])
            loss_sum[0] += loss.detach().double()
            loss_sum[1] += 1
            if step % args.log_every == 0:
                meter.add(counter.take(step - last))
                last = step
                r = meter.interval()
                logged_step[0] += args.log_every
                logger.log_metrics({names.TRAIN_LOSS: float(loss_sum[0] / loss_sum[1]), names.TRAIN_TOKENS: meter.total.tokens,
                                    names.TPUT_TOKENS: r.tokens_per_sec, names.TRAIN_STEP_TIME_S: r.step_time_s,
                                    names.TPUT_DEVICE_TFLOPS: r.device_tflops_per_sec(lambda s: flops_per_token(cfg, s))},
                                   logged_step[0])
                loss_sum.zero_()
        return n * args.batch * args.seq_len / (time.perf_counter() - t0)

    contenders = (bare, instrumented, monitor, autolog)
    for f in contenders:
        f(5)  # warm-up, not counted
    ratios: dict[str, list[float]] = {f.__name__: [] for f in contenders[1:]}
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        res = {f.__name__: f(args.steps) for f in order}
        for name in ratios:
            ratios[name].append(res[name] / res["bare"])
        print(f"round {r + 1}: bare {res['bare']:,.0f} tok/s, "
              + ", ".join(f"{k} {res[k]:,.0f} tok/s (ratio {v[-1]:.4f})" for k, v in ratios.items()), flush=True)
    logger.close()
    mlflow_llmeff.autolog(disable=True)  # finishes the autolog run
    for name, rs in ratios.items():
        med = statistics.median(rs)
        print(f"median ratio {name}/bare = {med:.4f} over {args.rounds} interleaved rounds "
              f"(target >= 0.99: {'met' if med >= 0.99 else 'NOT met'})")
    sys.exit(0)


if __name__ == "__main__":
    main()
