"""A Hugging Face ``Trainer`` script with ``mlflow_llmeff.autolog()``: the one added line is marked.

A tiny Llama built from its config (nothing downloaded) learns eight hand-made sentences, bytes as
token ids, two per batch, padded by the collator. ``max_steps=8`` covers the sentences exactly
twice (in shuffled order), so the run's ``train/tokens`` must be 2 x 197 = 394 non-padding tokens.
With ``--report-to mlflow`` the Trainer's own MLflow callback logs into the same, single run. Either
way the run is named from its configuration, ``llama-fp32-cpu`` (``-2``, ``-3``, ... for
the repeats in one experiment; the padded length varies, 23 to 32, so ``llmeff.seq_len`` is
``dynamic`` and the name has no batch or length part), unless ``TrainingArguments(run_name=...)`` names it.

    MLFLOW_TRACKING_URI=sqlite:///mlflow.db python examples/hf_trainer.py --report-to mlflow
"""

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import mlflow_llmeff

mlflow_llmeff.autolog(log_every_n_steps=2, warmup_steps=1)  # <- the only line autolog needs

SENTENCES = [
    "The cat sat on the mat.", "Tokens per second matter.", "MLflow tracks runs.",
    "Small models train fast on CPUs.", "Padding is not a token.", "Warm-up steps are excluded.",
    "One line enables autolog.", "Every rank counts once.",
]  # 197 bytes in all
PAD = 256


class Sentences(torch.utils.data.Dataset):
    def __len__(self):
        return len(SENTENCES)

    def __getitem__(self, i):
        return {"input_ids": list(SENTENCES[i].encode())}


def collate(rows):
    """Pad to the longest row: input_ids, attention_mask and labels (-100 on padding), (B, T) each."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), PAD)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[j, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report-to", default="none", help="'mlflow' to add the Trainer's own MLflow callback")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=8, learning_rate=3e-3,
            logging_steps=2, save_strategy="no", report_to=args.report_to, use_cpu=True,
            dataloader_num_workers=0, disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=training_args, train_dataset=Sentences(), data_collator=collate)
        trainer.train()


if __name__ == "__main__":
    main()
