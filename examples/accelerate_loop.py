"""An Accelerate training loop with ``mlflow_llmeff.autolog()``: the one added line is marked.

A tiny Llama built from its config (nothing downloaded) trains on the Python language reference
that ships with CPython (``pydoc_data``), bytes as token ids, cut into full blocks of 32 tokens
(no padding). Each process runs 6 optimizer steps of 2 accumulated micro-batches of 4 blocks, so
the run's ``train/tokens`` must be 6 x 2 x 4 x 32 = 1536 per process: 3072 with two processes.

    MLFLOW_TRACKING_URI=sqlite:///mlflow.db python examples/accelerate_loop.py
    ACCELERATE_USE_CPU=1 MLFLOW_TRACKING_URI=sqlite:///mlflow.db \
        python -m accelerate.commands.launch --multi_gpu --num_processes 2 examples/accelerate_loop.py
"""

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import mlflow_llmeff

mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1)  # <- the only line autolog needs

SEQ, MICRO_BATCH, GRAD_ACCUM, STEPS = 32, 4, 2, 6


def blocks(n: int) -> torch.Tensor:
    """The first ``n`` full blocks of ``SEQ`` bytes of the Python reference, (n, SEQ) int64."""
    from pydoc_data.topics import topics  # the Python language reference, shipped with CPython

    data = "\n".join(topics[k] for k in sorted(topics)).encode()[: n * SEQ]
    return torch.tensor(list(data), dtype=torch.long).view(n, SEQ)


def main() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=GRAD_ACCUM, cpu=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = blocks(STEPS * GRAD_ACCUM * MICRO_BATCH * accelerator.num_processes)
    # Each process takes its own strided share of the blocks.
    mine = data[accelerator.process_index::accelerator.num_processes]
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    for i in range(0, len(mine), MICRO_BATCH):
        ids = mine[i:i + MICRO_BATCH].to(accelerator.device)
        with accelerator.accumulate(model):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.print(f"last loss {out.loss.item():.3f}")
    accelerator.wait_for_everyone()
    # Release the DDP model while its process group is alive: a gloo group whose last reference goes at
    # interpreter exit can deadlock there (its worker thread needs the GIL the exiting thread holds).
    accelerator.free_memory()
    del model, optimizer, out
    accelerator.end_training()


if __name__ == "__main__":
    main()
