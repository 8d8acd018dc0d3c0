"""Seconds per step of a public pretraining recipe (``dpbench.training.pretrain``), to size its
steps to a CPU budget: the recipe's model and AdamW on its own batches of the real WordNet
glosses (encoded as P4 encodes records), at the recipe's thread count, the median and range of
wall-clock and CPU (process) seconds per step after a few warm-up steps, and what the recipe's
steps then cost. The private text is not removed here (it changes no step's cost).

Usage:  python benchmarks/bench_pretrain.py [--recipe wordnet-lm] [--steps 30] [--warmup 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dpbench.data import wordnet
from dpbench.problems import tokenizer
from dpbench.problems.transformer import TransformerLM
from dpbench.seeds import stream_seeds
from dpbench.training import pretrain as pt
from dpbench.training.recipes import get_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="wordnet-lm")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    recipe = get_recipe(args.recipe)
    torch.set_num_threads(recipe.threads)
    corpus = wordnet.load(manifest=dict(recipe.corpus_manifest))
    tokens = torch.from_numpy(tokenizer.encode_records(corpus.train[:recipe.records], recipe.context))
    torch.manual_seed(0)
    model = TransformerLM(**recipe.model_dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), foreach=False)
    sampler = stream_seeds(recipe.seed)["sampler"]
    wall, cpu = [], []
    for step in range(args.warmup + args.steps):
        rows = torch.from_numpy(pt.batch_rows(len(tokens), recipe.batch_size, sampler, step))
        t, c = time.perf_counter(), time.process_time()
        loss, count = pt._loss_sum(model, tokens[rows])
        optimizer.zero_grad(set_to_none=True)
        (loss / count).backward()
        optimizer.step()
        if step >= args.warmup:
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    for name, values in (("wall", wall), ("cpu", cpu)):
        median = statistics.median(values)
        print(f"{recipe.name} ({recipe.threads} thread(s), B = {recipe.batch_size}): {name} {median:.3f} s/step "
              f"(range {min(values):.3f}-{max(values):.3f}, {len(values)} steps); {recipe.steps} steps: "
              f"{median * recipe.steps / 60:.1f} {name}-minutes")


if __name__ == "__main__":
    main()
