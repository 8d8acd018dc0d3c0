"""Problems P1-P3: architectures, parameter counts, preprocessing and losses."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpbench.problems import CHANNEL_STATS, PROBLEMS, get_problem


@pytest.mark.parametrize("pid,params,shape", [("P1", 258_762, (3, 32, 32)), ("P2", 225_034, (1, 28, 28)),
                                              ("P3", 1_875_265, (1, 28, 28))])
def test_parameter_counts_and_shapes(pid, params, shape):
    problem = PROBLEMS[pid]
    model = problem.build()
    assert sum(p.numel() for p in model.parameters()) == params
    x = torch.rand(5, *shape)
    if problem.task == "classification":
        assert model(x).shape == (5, 10)
    else:
        recon, mu, logvar = model(x, torch.zeros(5, 32))
        assert recon.shape == x.shape and mu.shape == logvar.shape == (5, 32)
        assert recon.min() >= 0 and recon.max() <= 1  # Sigmoid output


def test_preprocessing():
    images = np.array([[[[0, 255]]], [[[128, 64]]]], dtype=np.uint8)  # (2, 1, 1, 2)
    x = get_problem("P2").preprocess(images)
    mean, std = CHANNEL_STATS["fashion-mnist"]
    torch.testing.assert_close(x[0, 0, 0], (torch.tensor([0.0, 1.0]) - mean[0]) / std[0])
    # the VAE sees pixels in [0, 1], not normalised values (thesis code defect 6)
    v = get_problem("P3").preprocess(images)
    torch.testing.assert_close(v[0, 0, 0], torch.tensor([0.0, 1.0]))
    rgb = get_problem("P1").preprocess(np.full((1, 3, 2, 2), 255, np.uint8))
    m, s = CHANNEL_STATS["cifar10"]
    torch.testing.assert_close(rgb[0, :, 0, 0], (1 - torch.tensor(m)) / torch.tensor(s))


def test_published_normalisation_constants_match_real_data(fmnist_dir):
    from dpbench.data import image_datasets

    ds = image_datasets.load("fashion-mnist", fmnist_dir)
    x = ds.train_images.astype(np.float64) / 255
    mean, std = CHANNEL_STATS["fashion-mnist"]
    assert x.mean() == pytest.approx(mean[0], abs=1e-3)
    assert x.std() == pytest.approx(std[0], abs=1e-3)


def test_classification_loss_is_per_sample_cross_entropy():
    problem = get_problem("P2")
    model = problem.build()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 3, 9, 1])
    losses, correct = problem.per_sample_loss(model, x, y)
    logits = model(x)
    torch.testing.assert_close(losses, F.cross_entropy(logits, y, reduction="none"))
    assert torch.equal(correct, logits.argmax(1) == y)


def test_vae_loss_is_summed_per_sample():
    """Per-sample loss = BCE summed over the 784 pixels + KL summed over the 32 latent dims;
    one sample's loss does not depend on the others (no batch-mean reduction)."""
    problem = get_problem("P3")
    model = problem.build()
    x = torch.rand(3, 1, 28, 28)
    g = torch.Generator().manual_seed(0)
    losses, correct = problem.per_sample_loss(model, x, None, g)
    assert correct is None and losses.shape == (3,)
    noise = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    recon, mu, logvar = model(x, noise)
    rec = -(x * torch.log(recon) + (1 - x) * torch.log(1 - recon)).sum((1, 2, 3))
    kl = 0.5 * (mu ** 2 + logvar.exp() - 1 - logvar).sum(1)
    torch.testing.assert_close(losses, rec + kl, rtol=1e-4, atol=1e-3)
    # the reconstruction term alone is of the order of 784 * log 2 for an untrained decoder
    assert rec.mean().item() > 300
