"""Minimal reproduction: Opacus ghost clipping fails on nn.Embedding with non-contiguous ids.

Opacus 1.6.0's norm sampler for nn.Embedding (``opacus/grad_sample/embedding_norm_sample.py``,
``compute_embedding_norm_sample``, line 123) calls ``input_ids.view(-1, 1)`` on the layer's
input ids after ``input_ids.reshape(input_ids.shape[0], -1)``. ``reshape`` returns a view where
it can, so ids that are a non-contiguous view stay non-contiguous, and ``view`` then raises
``RuntimeError: view size is not compatible with input tensor's size and stride``. Ordinary
language-model inputs are such views: the tokens ``x[:, :-1]`` of a batch of rows, and position
ids ``arange(T).expand(B, T)``. ``reshape(-1, 1)`` (or ``.contiguous()`` first) would fix it.

Usage:  python benchmarks/opacus_ghost_embedding_bug.py               # fails (exit 1) with Opacus 1.6.0
        python benchmarks/opacus_ghost_embedding_bug.py --contiguous  # the same step, ids made contiguous: runs
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def step(contiguous: bool) -> None:
    import opacus
    from opacus import PrivacyEngine
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(4 * 3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = torch.randint(0, 10, (8, 4))
    loader = DataLoader(TensorDataset(rows), batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine().make_private(  # ghost mode: (module, optimizer, criterion, loader)
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode="ghost")
    module, optimizer = made[0], made[1]
    warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus's hooks on a model without input grads
    ids = rows[:, :-1]  # (8, 3), strides (4, 1): a view, not contiguous
    if contiguous:
        ids = ids.contiguous()
    losses = module(ids).square().sum(1)
    DPTensorFastGradientClipping(module, optimizer, losses, "mean").backward()
    optimizer.step()
    print(f"opacus {opacus.__version__}, torch {torch.__version__}: ghost clipping step ran "
          f"({'contiguous' if contiguous else 'non-contiguous'} ids)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contiguous", action="store_true", help="pass contiguous ids (the workaround)")
    args = parser.parse_args()
    try:
        step(args.contiguous)
    except RuntimeError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"
        sys.exit(f"FAILS in {frame.name} ({where}): {frame.line}\n  {type(e).__name__}: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
