"""Train a small Transformer classifier with the Lightning ``Trainer`` (automatic
optimisation) on synthetic sequences.

A callback prints each batch's wall time and loss: ``step N: loss X, time Y ms``.

    python lightning_trainer.py --steps 200
"""

import argparse
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, vocab_size=512, width=128, classes=8, lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class StepTimer(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        elapsed = time.perf_counter() - self.started
        print(f"step {trainer.global_step}: loss {outputs['loss'].item():.4f}, time {elapsed * 1e3:.2f} ms",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    tokens = torch.randint(0, 512, (2048, args.seq_len))
    labels = tokens[:, 0] % 8
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=args.batch_size, shuffle=True)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StepTimer()])
    trainer.fit(Classifier(), loader)


if __name__ == "__main__":
    main()
