"""The manual's worked examples (docs/adding-an-optimizer.md, docs/adding-a-setup.md) run as written."""

import re
import textwrap

import torch

from conftest import REPO
from dpbench.privacy.clipping import Clipping
from dpbench.mechanisms.noise import GaussianNoise
from dpbench.optimizers.base import Context


def test_adding_an_optimizer_example_works():
    page = (REPO / "docs" / "adding-an-optimizer.md").read_text()
    block = re.search(r"```python\n(# src/dpbench/optimizers/dpmomentum.py\n.*?)```", page, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "docs/adding-an-optimizer.md:dpmomentum", "exec"), namespace)
    # the page's declaration, as the registry holds it; its import string resolved to the module
    # above (the page's module is not installed)
    from dpbench.optimizers.spec import OptimizerSpec

    declared = re.search(r"```python\n(    OptimizerSpec\(\n.*?)```", page, re.S).group(1)
    assert 'Imported("dpbench.optimizers.dpmomentum:dpmomentum")' in declared
    spec = eval(textwrap.dedent(declared).strip().rstrip(","),
                {"OptimizerSpec": OptimizerSpec, "Imported": lambda path: namespace[path.split(":")[1]]})
    assert spec.hyperparameters({"mu": 0.5}) == {"mu": 0.5}
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ctx = Context(model=model, loss_fn=lambda m, x, y: (m(x).pow(2).sum(1), None), lr=0.1,
                  expected_batch_size=4, noise_multiplier=0.0, clipping=Clipping(1.0), noise=GaussianNoise(0),
                  steps=2, hyperparameters=spec.hyperparameters(None))
    step = spec.build(ctx)
    w0 = model.weight.detach().clone()
    x = torch.randn(4, 3)
    step(x, None)
    d1 = model.weight.detach() - w0
    step(x, None)
    d2 = model.weight.detach() - w0 - d1
    # heavy ball: the second update carries mu = 0.9 times the first one's velocity
    assert d1.abs().sum() > 0 and not torch.allclose(d1, d2)
    assert "dpmomentum" not in __import__("dpbench.optimizers", fromlist=["OPTIMIZERS"]).OPTIMIZERS


def test_adding_a_setup_example_is_a_valid_config(tmp_path):
    from dpbench.pipeline.grid import expand, load_config

    page = (REPO / "docs" / "adding-a-setup.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    path = tmp_path / "mysetup.yaml"
    path.write_text(block)
    cells = expand(load_config(path))
    # P2 x 2 batch sizes x 2 epsilons x 3 seeds x (3 dpsgd + 2 x 2 dpadamw + 3 dpmatrix-me)
    assert len(cells) == 2 * 2 * 3 * (3 + 4 + 3)
    assert {c.optimizer for c in cells} == {"dpsgd", "dpadamw", "dpmatrix-me"}
    assert {dict(c.hyperparameters).get("weight_decay") for c in cells if c.optimizer == "dpadamw"} == {0, 1.0e-4}
