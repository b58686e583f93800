"""The five standard runs of the UI trial, logged straight into a store (seconds, no training):
default (llama-tiny, 1 process), 2-process DDP, grad-accum 4, llama-160m, and evals with targets.

Figures are plausible CPU values with every key a finished run of ``llmeff train`` has (summary with
intervals, stability, contention, conditions, loss history, final evals, time to quality), so the
report and the efficiency page can be laid out and checked against them.
"""

from __future__ import annotations

from mlflow_llmeff import names

COMMON = {names.ACCEL_NAME: "AMD EPYC 7B13", names.ACCEL_SHORT: "cpu", names.ACCEL_GENERATION: "cpu",
          names.NODES: "1", names.PRECISION: "fp32", names.SEQ_LEN: "128", names.MICRO_BATCH_SIZE: "8",
          names.ACT_CKPT: "false", names.COMPILE: "false", names.DATASET: "python-docs",
          names.FLOPS_FORMULA: "megatron", names.PEAK_SOURCE: "unknown: no datasheet peak for a CPU",
          names.WARMUP_STEPS: "3", names.V_LLMEFF: "0.1.0", names.V_TORCH: "2.13.0+cpu",
          names.STABILITY: "stable", names.CONTENTION: "quiet: other processes 1.2% of host CPU, steal 0.0%",
          names.ENERGY_SOURCE: "codecarbon_estimate", "mlflow.user": "trial"}

#: (name, extra tags, tokens/s, goodput, model)
FIVE = (
    ("llama-tiny-cpu-1x-single-fp32-s128-gbt1024", {names.ACCEL_COUNT: "1", names.PAR_STRATEGY: "single",
                                                     names.GRAD_ACCUM: "1", names.GLOBAL_BATCH_TOKENS: "1024",
                                                     names.MODEL_NAME: "llama-tiny"}, 42_816.0, 0.12),
    ("llama-tiny-cpu-2x-ddp-fp32-s128-gbt2048", {names.ACCEL_COUNT: "2", names.PAR_STRATEGY: "ddp",
                                                  names.GRAD_ACCUM: "1", names.GLOBAL_BATCH_TOKENS: "2048",
                                                  names.MODEL_NAME: "llama-tiny"}, 61_000.0, 0.10),
    ("llama-tiny-cpu-1x-single-fp32-s128-gbt4096", {names.ACCEL_COUNT: "1", names.PAR_STRATEGY: "single",
                                                     names.GRAD_ACCUM: "4", names.GLOBAL_BATCH_TOKENS: "4096",
                                                     names.MODEL_NAME: "llama-tiny"}, 47_500.0, 0.30),
    ("llama-160m-cpu-1x-single-fp32-s128-gbt1024", {names.ACCEL_COUNT: "1", names.PAR_STRATEGY: "single",
                                                     names.GRAD_ACCUM: "1", names.GLOBAL_BATCH_TOKENS: "1024",
                                                     names.MODEL_NAME: "llama-160m"}, 1_950.0, 0.45),
    ("llama-tiny-cpu-1x-single-fp32-s128-gbt1024-2", {names.ACCEL_COUNT: "1", names.PAR_STRATEGY: "single",
                                                       names.GRAD_ACCUM: "1", names.GLOBAL_BATCH_TOKENS: "1024",
                                                       names.MODEL_NAME: "llama-tiny", names.EVAL_DOCUMENTS: "100 drawn with seed 0",
                                                       names.EVAL_NUM_FEWSHOT: "0", names.EVAL_BATCH_SIZE: "8",
                                                       names.TTQ_TAG_PREFIX + "val_loss_le_3.0": "reached_at_step_40",
                                                       names.TTQ_TAG_PREFIX + "hellaswag_acc_norm_ge_0.30": "not_reached"},
     41_900.0, 0.08),
)


def log_five_runs(client, experiment_name: str = "five") -> tuple[str, list[str]]:
    """Log the five runs into ``client``'s store; returns ``(experiment id, run ids)``."""
    exp = client.get_experiment_by_name(experiment_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment_name)
    ids = []
    for i, (name, tags, tps, good) in enumerate(FIVE):
        run = client.create_run(exp_id, run_name=name)
        rid = run.info.run_id
        devices = int(tags[names.ACCEL_COUNT])
        half = 0.02 * tps
        m = {names.SUM_TOKENS_PER_SEC: tps, names.SUM_DEVICE_TOKENS_PER_SEC: tps / devices,
             names.SUM_TPS_CI95_LOW: tps - half, names.SUM_TPS_CI95_HIGH: tps + half,
             names.SUM_STEP_TIME_S: 1024 * int(tags[names.GRAD_ACCUM]) / tps, names.SUM_STEP_TIME_P50_S: 0.023,
             names.SUM_STEP_TIME_P90_S: 0.026, names.SUM_STEP_TIME_CV: 0.08, names.SUM_STALL_S: 0.0,
             names.SUM_STALLS: 0.0, names.SUM_HOST_OTHER_CPU: 0.012, names.SUM_HOST_STEAL: 0.0,
             names.SUM_DEVICE_TFLOPS: tps / devices * 2.9e6 / 1e12, names.SUM_MFU_MEASURED_PEAK: 0.05 + 0.01 * i,
             names.SUM_GOODPUT: good, names.SUM_WALL_S: 10.1 + i, names.SUM_TOKENS: 51_200.0 * devices,
             names.SUM_STEPS: 50.0, names.SUM_ESTIMATE_KG_CO2E: 2e-6 * (i + 1),
             names.SUM_ESTIMATE_KG_CO2E_PER_BTOK: 0.04 * (i + 1), names.SUM_MODEL_STATE_BYTES_PER_PARAM: 16.0,
             names.SUM_BADPUT["init"]: 8.7, names.SUM_BADPUT["warmup"]: 0.2, names.SUM_BADPUT["other"]: 0.1,
             names.MEM_MAX_ALLOC: 0.6 + 0.3 * (tags[names.MODEL_NAME] == "llama-160m") + 0.05 * devices}
        if devices == 2:
            m[names.SUM_STRAGGLER_RATIO] = 1.03
        if names.EVAL_DOCUMENTS in tags:
            m.update({names.EVAL_VAL_LOSS: 2.9, names.EVAL_VAL_PPL: 18.2, names.EVAL_HELLASWAG_ACC: 0.27,
                      names.EVAL_HELLASWAG_ACC_NORM: 0.26, names.EVAL_MMLU_ACC: 0.24,
                      "ttq/val_loss_le_3.0_wall_s": 7.5, "ttq/val_loss_le_3.0_tokens": 40_960.0,
                      "ttq/val_loss_le_3.0_kg_co2e": 1e-6})
        from mlflow.entities import Metric, Param, RunTag

        ts = run.info.start_time
        points = [Metric(k, v, ts + 10_000, 50) for k, v in m.items()]
        for step in range(5, 51, 5):  # interval histories: loss falling, throughput per window
            points += [Metric(names.TRAIN_LOSS, 5.6 - 0.05 * step - 0.1 * i, ts + 200 * step, step),
                       Metric(names.TRAIN_TOKENS, 1024.0 * devices * step, ts + 200 * step, step),
                       Metric(names.TPUT_TOKENS, tps * (1.0 + 0.03 * ((step // 5) % 3 - 1)), ts + 200 * step, step)]
        degrees = {names.PAR_DP: str(devices), names.PAR_DP_SHARD: "1", names.PAR_DP_REPLICATE: str(devices),
                   names.PAR_TP: "1", names.PAR_PP: "1", names.PAR_CP: "1",
                   names.MEMORY_SOURCE: "cpu: peak process RSS (getrusage ru_maxrss) for both allocated and reserved"}
        client.log_batch(rid, metrics=points, tags=[RunTag(k, v) for k, v in {**COMMON, **degrees, **tags}.items()],
                         params=[Param("model", tags[names.MODEL_NAME])])
        client.set_terminated(rid, "FINISHED", end_time=ts + 12_000)
        ids.append(rid)
    return exp_id, ids
