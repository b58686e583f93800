"""What a DeepSpeed ZeRO engine holds (CPU, gloo; docs/parallelism.md "Where DeepSpeed holds more").

Every tensor storage reachable from Python just before the torch optimizer steps and between steps,
in bytes per parameter of a 2-layer Llama (hidden 256), against ``meters/probes.py`` and
``planning/plan.py`` ``model_state_bytes``. ``python bench/zero_held.py`` runs stages 1-3 x fp32,
bf16 x 1, 2 ranks (about 3 minutes on 2 cores; DeepSpeed installed; ``DS_ACCELERATOR=cpu``).
One case: ``python bench/zero_held.py STAGE PRECISION RANKS PORT OUT.json``.

Target: the probe equals the plan within :data:`PROBE_PLAN_TOLERANCE` B/param in all 12 cases; exits 1
and says ``NOT MET`` naming the cases otherwise (the snapshots are printed for reading, not targets).
"""
import gc, os, sys, json
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, torch.distributed as dist

def storages():
    seen = {}
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and o.device.type == "cpu":
                for t in (o, getattr(o, "grad", None)):
                    if t is None or not torch.is_tensor(t): continue
                    s = t.untyped_storage()
                    seen[s.data_ptr()] = (s.nbytes(), str(t.dtype))
        except Exception:
            pass
    return seen

def main(rank, world, stage, prec, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=704, vocab_size=259, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg)
    P = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    conf = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000 if stage < 3 else 5e8},
            "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    if prec == "bf16": conf["bf16"] = {"enabled": True}
    engine, zopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    rec = {}
    def pre(o, *a, **k):
        gc.collect()
        rec["step"] = storages()
    opt.register_step_pre_hook(pre)
    x = torch.randint(0, 259, (1, 16))
    for _ in range(2):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    gc.collect()
    rec["after"] = storages()
    res = {k: {"total": sum(b for b, _ in v.values()), "by_dtype": {d: sum(b for b, dd in v.values() if dd == d) for d in {dd for _, dd in v.values()}}} for k, v in rec.items()}
    res["P"] = P
    res["persist"] = sum(p.ds_numel for p in engine.module.parameters() if getattr(p, "ds_persist", False))
    from mlflow_llmeff.meters.probes import model_state_bytes
    class W: pass
    w = W(); w.optimizer = zopt
    res["probe"] = model_state_bytes(engine.module, w)
    if rank == 0:
        json.dump(res, open(out, "w"))
    dist.barrier()

#: target: the probe (meters/probes.py) equals the plan within this many bytes per parameter in every case
PROBE_PLAN_TOLERANCE = 1e-3


def table() -> list[str]:
    """Run the 12 cases and print the table; returns the cases where the probe misses the plan."""
    import socket
    import subprocess
    import tempfile

    from mlflow_llmeff.planning.plan import model_state_bytes

    missed = []
    for world in (1, 2):
        for stage in (1, 2, 3):
            for prec in ("fp32", "bf16"):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                out = os.path.join(tempfile.mkdtemp(), "held.json")
                subprocess.run([sys.executable, __file__, str(stage), prec, str(world), str(port), out],
                               check=True, capture_output=True)
                r = json.load(open(out))
                P = r["P"]
                plan = sum(model_state_bytes(P, f"deepspeed_zero{stage}", world, precision=prec,
                                             persistent_params=r["persist"])) / P
                print(f"ZeRO-{stage} {prec} x{world}: before the step {r['step']['total'] / P:.3f}, between steps "
                      f"{r['after']['total'] / P:.3f}, probe {r['probe'][0] / r['probe'][1]:.3f}, plan {plan:.3f} B/param")
                probe = r["probe"][0] / r["probe"][1]
                if abs(probe - plan) > PROBE_PLAN_TOLERANCE:
                    missed.append(f"ZeRO-{stage} {prec} x{world}: probe {probe:.3f} != plan {plan:.3f} B/param")
    return missed


if __name__ == "__main__":
    if len(sys.argv) == 1:
        missed = table()
        if missed:
            print("\nNOT MET: " + "; ".join(missed))
            sys.exit(1)
        print(f"\nmet: the probe equals the plan within {PROBE_PLAN_TOLERANCE:g} B/param in all 12 cases")
        sys.exit(0)
    stage, prec, world, port, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    if world == 1:
        main(0, 1, stage, prec, port, out)
    else:
        torch.multiprocessing.spawn(main, args=(world, stage, prec, port, out), nprocs=world)
