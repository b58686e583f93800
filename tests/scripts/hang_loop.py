"""A plain PyTorch loop under ``mlflow_llmeff.autolog()`` whose tracking server stops answering mid-run.

Used by tests/test_delivery.py: 12 optimizer steps of llama-tiny (8 tokens a step, logged every 2
steps); after step 6 it flushes its points (the server still answers), writes ``$HOLD.reached`` and
waits until the test has made the server stop answering and created ``$HOLD``; then it trains on,
prints ``LAST_STEP_UNIX <time>`` after the last step and ends normally (the run is finished at exit).
"""

import os
import sys
import time

import torch
from transformers import LlamaForCausalLM

import mlflow_llmeff
from mlflow_llmeff.models.build import load_config

hold = sys.argv[1]
mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1, measure_energy="none")
torch.manual_seed(0)
model = LlamaForCausalLM(load_config("llama-tiny"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.arange(8).view(1, 8) + 3
for step in range(1, 13):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 6:
        mlflow_llmeff.active_monitor().flush()
        open(hold + ".reached", "w").close()
        while not os.path.exists(hold):
            time.sleep(0.05)
print("LAST_STEP_UNIX", time.time(), flush=True)
