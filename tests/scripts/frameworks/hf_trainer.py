"""Train a tiny GPT-2 language model with the Hugging Face ``Trainer``.

The model is built from a config (random weights, nothing downloaded) and trained on
synthetic token sequences, as one tries a Trainer setup before pointing it at real
data. A callback prints each step's wall time and loss:
``step N: loss X, time Y ms``.

    python hf_trainer.py --steps 200
"""

import argparse
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class RandomTokens(Dataset):
    def __init__(self, size, seq_len, vocab_size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (size, seq_len), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        ids = self.tokens[index]
        return {"input_ids": ids, "labels": ids}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.started = None
        self.elapsed = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.elapsed = time.perf_counter() - self.started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and self.elapsed is not None:
            print(f"step {state.global_step}: loss {float(logs['loss']):.4f}, time {self.elapsed * 1e3:.2f} ms",
                  flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = GPT2Config(vocab_size=512, n_positions=args.seq_len, n_embd=128, n_layer=2, n_head=4,
                        bos_token_id=511, eos_token_id=511)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    data = RandomTokens(4096, args.seq_len, config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=3e-4,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            seed=args.seed,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[StepTimer()])
        trainer.train()


if __name__ == "__main__":
    main()
