"""A plain PyTorch loop that ends one of several ways right after optimizer step 6.

Used by tests/test_lifecycle.py: ``--meter autolog`` (one ``mlflow_llmeff.autolog()`` line) or
``--meter monitor`` (an explicit EfficiencyMonitor that is never finished by the script), and
``--end`` normal | exit0 | exit1 | raise | sigterm | sigint. 8 tokens a step, logged every 4 steps.
"""

import argparse
import os
import signal
import sys
import time

import torch
from tiny_lm import TinyLM  # this folder's (the script's own folder is first on sys.path)

import mlflow_llmeff

p = argparse.ArgumentParser()
p.add_argument("--meter", choices=["autolog", "monitor"], required=True)
p.add_argument("--end", choices=["normal", "exit0", "exit1", "raise", "sigterm", "sigint"], required=True)
args = p.parse_args()

settings = dict(log_every_n_steps=4, warmup_steps=1, measure_energy="none")
if args.meter == "autolog":
    mlflow_llmeff.autolog(**settings)
torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = mlflow_llmeff.EfficiencyMonitor(model=model, optimizer=opt, **settings) if args.meter == "monitor" else None
ids = torch.arange(8).view(1, 8) + 3
for step in range(1, 11):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if mon is not None:
        mon.step(batch={"input_ids": ids}, loss=loss)
    if step == 6:
        if args.end == "normal":
            break
        if args.end == "exit0":
            sys.exit(0)
        if args.end == "exit1":
            sys.exit(1)
        if args.end == "raise":
            raise RuntimeError("the loop failed")
        os.kill(os.getpid(), signal.SIGTERM if args.end == "sigterm" else signal.SIGINT)
        time.sleep(10)  # the signal arrives first
