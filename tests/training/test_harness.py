"""The shared construction of a private step (dpbench.training.harness): calibration and assembly give
what a training cell runs, so that another caller (the empirical audit) runs the same thing."""

import math

import pytest
import torch

from conftest import run_cell
from dpbench.privacy import accounting
from dpbench.training.calibration import calibrate
from dpbench.training.harness import assemble, build_model
from dpbench.mechanisms.base import PlanRequest
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian
from dpbench.optimizers import get_optimizer
from dpbench.problems import get_problem
from dpbench.seeds import stream_seeds
from dpbench.training.config import RunConfig
from dpbench.training.splits import load_splits


def _calibrate(name, plan, **kw):
    claim = calibrate(get_optimizer(name), plan, **{"target_epsilon": 2.0, "noise_multiplier": None, "delta": 1e-5,
                                                    "accountant": "rdp", **kw})
    assert claim.seconds >= 0 and claim.accountant is accounting.RDP and claim.delta == 1e-5
    return claim.noise_multiplier, claim.source


def test_calibrate_noise_names_where_sigma_came_from():
    plan = PoissonSubsampledGaussian().plan(PlanRequest(600, 60, 2))  # q = 0.1, T = 20
    sigma, source = _calibrate("dpsgd", plan)
    assert source == "calibrated"
    # the smallest sigma (to the calibration's 0.1%) meeting epsilon 2 under the accountant asked for
    assert accounting.epsilon([(sigma, 0.1, 20)], 1e-5, "rdp") <= 2.0 < accounting.epsilon([(sigma / 1.002, 0.1, 20)],
                                                                                          1e-5, "rdp")
    assert _calibrate("dpsgd", plan, noise_multiplier=1.3) == (1.3, "given")
    assert _calibrate("sgd", plan, noise_multiplier=1.3) == (0.0, "none (non-private)")
    with pytest.raises(ValueError, match="'dpsgd' is private: give a target epsilon or a noise multiplier"):
        _calibrate("dpsgd", plan, target_epsilon=None)


def test_assemble_builds_the_calibrated_clipped_step_and_its_sampler():
    spec = get_optimizer("dpadam")
    plan = spec.mechanism.plan(PlanRequest(600, 60, 2))
    model = torch.nn.Linear(4, 3)
    parts = assemble(spec, plan, model, lambda m, x, y: (m(x).sum(1), None), lr=0.01, noise_multiplier=0.7,
                     clip_norm=2.0, normalize_clipping=False, hyperparameters={"beta1": 0.8}, noise_seed=5,
                     sampler_seed=6, n_train=600, device="cpu")
    ctx = parts.context
    assert ctx.model is model and ctx.expected_batch_size == 60 and ctx.steps == 20 and ctx.lr == 0.01
    assert ctx.hyperparameters == {**spec.defaults, "beta1": 0.8}
    assert ctx.clipping.sensitivity == 2.0  # flat clipping: sensitivity C
    assert parts.step.noise_std == pytest.approx(0.7 * 2.0)  # on the clipped sum
    # the sampler is the plan's Poisson sampler on the sampler stream: q = 0.1 of 600
    expected = torch.Generator().manual_seed(6)
    assert torch.equal(parts.sampler.sample(), (torch.rand(600, generator=expected) < 0.1).nonzero().squeeze(1))
    reference = get_optimizer("adam")
    parts = assemble(reference, plan, model, lambda m, x, y: (m(x).sum(1), None), lr=0.01, noise_multiplier=0.0,
                     clip_norm=2.0, normalize_clipping=False, hyperparameters=None, noise_seed=5, sampler_seed=6,
                     n_train=600, device="cpu")
    assert parts.context.clipping.sensitivity == math.inf  # the non-private reference does not clip
    with pytest.raises(ValueError, match="no hyperparameter 'kappa'"):
        assemble(spec, plan, model, None, lr=0.01, noise_multiplier=0.7, clip_norm=1.0, normalize_clipping=True,
                 hyperparameters={"kappa": 1}, noise_seed=5, sampler_seed=6, n_train=600, device="cpu")


def test_harness_reproduces_a_training_cell_step_for_step(tiny_fmnist):
    """Built from the harness with the run's seed streams, the step and sampler give exactly
    the training losses and batch sizes that dpbench.training.train.run records."""
    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.5, batch_size=60, epochs=1, seed=3, noise_multiplier=1.1,
                    max_steps=4, test_subset=50, progress_every_s=1e9)
    res = run_cell(cfg)
    spec, problem, seeds = get_optimizer("dpsgd"), get_problem("P2"), stream_seeds(cfg.seed)
    splits = load_splits(cfg, problem, seeds, torch.device("cpu"))
    plan = spec.mechanism.plan(PlanRequest(600, cfg.batch_size, cfg.epochs))
    claim = calibrate(spec, plan, target_epsilon=None, noise_multiplier=1.1, delta=cfg.delta, accountant=cfg.accountant)
    sigma = claim.noise_multiplier
    privacy = res.meta["privacy"]
    assert (sigma, claim.source) == (privacy["noise_multiplier"], privacy["noise_multiplier_source"])
    loss_gen = torch.Generator().manual_seed(seeds["loss"])
    parts = assemble(spec, plan, build_model(problem, seeds["init"], "cpu"),
                     lambda m, x, y: problem.per_sample_loss(m, x, y, loss_gen), lr=cfg.lr, noise_multiplier=sigma,
                     clip_norm=cfg.clip_norm, normalize_clipping=cfg.normalize_clipping, hyperparameters={},
                     noise_seed=seeds["noise"], sampler_seed=seeds["sampler"], n_train=600, device="cpu")
    losses, sizes = [], []
    for _ in range(4):
        idx = parts.sampler.sample()
        losses.append(parts.step(splits.x_train[idx], splits.y_train[idx]).losses.double().mean().item())
        sizes.append(idx.numel())
    train = res.metrics[res.metrics.split == "train"]
    assert train.loss.tolist() == losses and train.batch_size.tolist() == sizes
