"""Train a tiny BERT masked-language model from the ``transformers`` library in a plain
PyTorch loop.

The model comes from a config (random weights, nothing downloaded); the batches are
synthetic token ids with 15% of them masked. Each step prints
``step N: loss X, time Y ms``.

    python hf_custom_loop.py --steps 200
"""

import argparse
import time

import torch
from transformers import BertConfig, BertForMaskedLM


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=args.seq_len)
    model = BertForMaskedLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    mask_id = config.vocab_size - 1

    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        input_ids = torch.randint(0, config.vocab_size - 1, (args.batch_size, args.seq_len))
        labels = input_ids.clone()
        masked = torch.rand(input_ids.shape) < 0.15
        labels[~masked] = -100
        input_ids[masked] = mask_id
        outputs = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
        outputs.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {outputs.loss.item():.4f}, time {(time.perf_counter() - started) * 1e3:.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
