"""A Hugging Face ``Trainer`` fed sequences of varying length through a collator
object of the script's own (``data_collator=PadCollator()``); a tiny model, random
weights, synthetic data. Used by tests/test_shapes_run.py."""
import tempfile
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments


class Sequences(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, 50, (int(n),), generator=g) for n in torch.randint(4, 40, (64,), generator=g)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


class PadCollator:
    def __init__(self, pad=0):
        self.pad = pad

    def __call__(self, features):
        ids = pad_sequence([f["input_ids"] for f in features], batch_first=True, padding_value=self.pad)
        return {"input_ids": ids, "labels": ids.clone()}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.out = torch.nn.Linear(8, 50)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=4, save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=100)
    Trainer(model=Tiny(), args=args, train_dataset=Sequences(), data_collator=PadCollator()).train()
