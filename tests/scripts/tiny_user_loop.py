"""The same training as ``llmeff train --max-steps 6 --seq-len 32 --micro-batch-size 4
--log-every-n-steps 3 --warmup-steps 1 --eval-every 3``, written as a user's own loop.

``--mode autolog``: one ``mlflow_llmeff.autolog()`` line, nothing else; the eval runs under
``torch.no_grad()`` as users write it. ``--mode monitor``: an explicit EfficiencyMonitor that declares
the eval and reports its result. tests/test_three_ways.py compares the keys of the three runs.
"""

import argparse

import torch

import mlflow_llmeff
from mlflow_llmeff.train.data import prepare_data
from mlflow_llmeff.models.build import build_model, load_config, load_tokenizer

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["autolog", "monitor"], required=True)
args = p.parse_args()
settings = dict(log_every_n_steps=3, warmup_steps=1)
if args.mode == "autolog":
    mlflow_llmeff.autolog(**settings)

torch.manual_seed(0)
tokenizer = load_tokenizer("llama-tiny")
data = prepare_data("python-docs", tokenizer, 32, val_fraction=0.05, seed=0)
model = build_model("llama-tiny", load_config("llama-tiny"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = mlflow_llmeff.EfficiencyMonitor(model=model, optimizer=opt, **settings) if args.mode == "monitor" else None


def val_loss() -> float:
    model.eval()
    with torch.no_grad():
        out = model(**data.val[:16])
    model.train()
    return float(out.loss)


model.train()
for step in range(1, 7):
    batch = data.train[(step - 1) * 4: step * 4]
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if mon is not None:
        mon.step(batch=batch, loss=loss)
    if step % 3 == 0:
        if mon is not None:
            with mon.pause("eval"):
                v = val_loss()
            mon.log_eval({"val_loss": v, "val_perplexity": float(torch.tensor(v).exp())})
        else:
            val_loss()
if mon is not None:
    mon.finish()
