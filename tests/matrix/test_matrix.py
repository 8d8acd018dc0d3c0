"""Matrix-factorization mechanisms (dpbench.matrix): the factorizations against independent
solvers and the sensitivity oracles, the noise files, the fixed-batch participation, the
exact calibration, the equivalence with DP-SGD for B = A, C = I, and the workflow's caches."""

import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, run_cell, run_cli, snakemake_exe, tree_env
from dpbench.problems import facts as problems_facts
from dpbench.privacy import accounting
from dpbench.matrix import dense_factorization, sensitivity
from dpbench.matrix.store import cache, dense_files, keys, noise_files
from dpbench.matrix.dual import dual_ascent
from dpbench.matrix.fixed_point import fixed_point
from dpbench.mechanisms.sampling import FixedBatchSampler
from dpbench.matrix.workload import gram_inverse, gram_inverse_tridiagonal, objective_workload, prefix_sum, \
    restart_weights

SMALL_KEYS = ["se-k1-b12", "se-lambda-k1-b12-tau12", "se-lambda-k1-b12-tau5", "me-k3-b4", "me-k2-b6",
              "me-lambda-k3-b4-tau12", "me-lambda-k4-b3-tau5"]


# -- an independent solver: Newton's method on X in a direct parameterisation ---------------

def newton_primal(workload, epochs, batches, iters=60):
    """min tr(M X^-1) over X = X0 + sum_a p_a E_a, the affine set {X_st = 0 for s != t of one
    user, sum over a user's steps of X_tt = 1} (all constraints are active at the optimum),
    by damped Newton with exact Hessian. No duality, no fixed point, no scaling step."""
    steps = epochs * batches
    m = workload.T @ workload
    basis = []
    for s, t in itertools.combinations(range(steps), 2):
        if s % batches != t % batches:
            e = np.zeros((steps, steps))
            e[s, t] = e[t, s] = 1.0
            basis.append(e)
    for j in range(batches):
        last = j + (epochs - 1) * batches
        for t in range(j, last, batches):
            e = np.zeros((steps, steps))
            e[t, t], e[last, last] = 1.0, -1.0
            basis.append(e)
    basis = np.array(basis)
    x = np.eye(steps) / epochs

    def value(x):
        try:
            np.linalg.cholesky(x)
        except np.linalg.LinAlgError:
            return np.inf
        return float(np.trace(np.linalg.solve(x, m)))

    f = value(x)
    for _ in range(iters):
        p = np.linalg.inv(x)
        pmp = p @ m @ p
        grad = -np.einsum("ij,aji->a", pmp, basis)
        a_mats = p @ basis @ p  # P E_a P
        c = basis @ p @ m  # E_a P M
        hess = np.einsum("aij,bji->ab", a_mats, c)
        hess = hess + hess.T
        step = -np.linalg.solve(hess, grad)
        t = 1.0
        while True:
            x_new = x + t * np.tensordot(step, basis, 1)
            f_new = value(x_new)
            if f_new <= f + 1e-4 * t * (grad @ step):
                break
            t /= 2
            if t < 1e-12:
                return f
        x, f = x_new, f_new
        if np.abs(grad).max() * np.abs(step).max() < 1e-15 * f:
            break
    return f


@pytest.mark.parametrize("key", SMALL_KEYS)
def test_solvers_reach_the_optimum_of_an_independent_method(key):
    kind, k, b, tau = keys.parse_dense_key(key)
    fact = dense_factorization.factorize(key, tol=1e-8)
    reference = newton_primal(objective_workload(k * b, tau), k, b)
    assert fact.report["objective"] == pytest.approx(reference, rel=1e-4)
    # the duality gap is a certificate: the reference lies between the two bounds
    assert fact.report["dual_value"] <= reference * (1 + 1e-9) <= fact.report["primal_value"] * (1 + 1e-8)


@pytest.mark.parametrize("key", SMALL_KEYS + ["se-k1-b40", "me-k5-b8", "me-lambda-k5-b8-tau40", "identity-k3-b5"])
def test_factorization_invariants(key):
    fact = dense_factorization.factorize(key)
    kind, k, b, tau = keys.parse_dense_key(key)
    a, c = prefix_sum(k * b), fact.strategy
    # B C = A for the TRUE workload (also for the lambda variants), C lower triangular (causal)
    np.testing.assert_allclose(fact.decoder @ c, a, atol=1e-9)
    np.testing.assert_allclose(fact.decoder, a @ fact.noising, atol=1e-12)
    assert np.array_equal(c, np.tril(c)) and np.allclose(c @ fact.noising, np.eye(k * b), atol=1e-9)
    # the sensitivity oracles, computed here from C alone
    if kind != "identity":
        assert np.linalg.norm(c, axis=0).max() <= 1 + 1e-9  # every single participation
        x = c.T @ c
        worst = max(np.abs(x[j::b, j::b]).sum() for j in range(b))  # any signs, any directions
        assert worst <= 1 + 1e-9 and sensitivity.sensitivity(c, k, b) <= 1 + 1e-9
        assert sensitivity.participation_norms(c, k, b).max() == pytest.approx(1.0, abs=1e-9)
        if k > 1:  # orthogonality: a user's steps do not interact, so signs cannot matter
            for j in range(b):
                block = x[j::b, j::b]
                assert np.abs(block - np.diag(np.diag(block))).max() < 1e-12
    else:
        assert fact.sensitivity == pytest.approx(np.sqrt(k))


def test_multi_epoch_sensitivity_bounds_every_sign_pattern():
    """||C u|| over the all-positive patterns misses users that flip signs between epochs;
    the bound of sensitivity.multi_epoch_sensitivity does not."""
    rng = np.random.default_rng(0)
    k, b = 3, 2
    c = np.tril(rng.standard_normal((k * b, k * b)))
    brute = 0.0
    for j in range(b):
        for signs in itertools.product([-1, 1], repeat=k):
            u = np.zeros(k * b)
            u[j::b] = signs
            brute = max(brute, np.linalg.norm(c @ u))
    assert sensitivity.participation_norms(c, k, b).max() < brute
    assert sensitivity.multi_epoch_sensitivity(c, k, b) >= brute - 1e-12
    # scalar gradients of norm <= 1 with arbitrary magnitudes: still bounded
    for _ in range(200):
        j = rng.integers(b)
        g = np.zeros(k * b)
        g[j::b] = rng.uniform(-1, 1, k)
        assert np.linalg.norm(c @ g) <= sensitivity.multi_epoch_sensitivity(c, k, b) + 1e-12


def test_workload_structure_and_fast_path_equals_dense():
    # Lambda_tau A is block diagonal: rows see only their own tau-block of gradients
    w = restart_weights(10, 4) @ prefix_sum(10)
    assert np.allclose(w[4:8, :4], 0) and np.allclose(w[8:, :8], 0)
    assert np.allclose(w[3], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]) and np.allclose(w[5], [0, 0, 0, 0, .5, .5, 0, 0, 0, 0])
    for tau in (None, 1, 3, 7, 20):
        wl = objective_workload(20, tau)
        tri = gram_inverse_tridiagonal(wl)
        assert tri is not None
        full = gram_inverse(wl)
        np.testing.assert_allclose(full, np.diag(tri[0]) + np.diag(tri[1], 1) + np.diag(tri[1], -1), atol=1e-9)
        fast, dense = fixed_point(wl, tol=1e-10), fixed_point(wl, tol=1e-10, force_dense=True)
        np.testing.assert_allclose(fast.gram, dense.gram, atol=1e-7)
    # the fixed point and the dual solver agree where both apply (k = 1)
    wl = objective_workload(16)
    assert dual_ascent(wl, 1, 16, tol=1e-8).primal_value == pytest.approx(fixed_point(wl, tol=1e-9).primal_value,
                                                                          rel=1e-6)


def test_factorization_file_round_trip_and_keys(tmp_path):
    fact = dense_factorization.factorize("me-k2-b3")
    dense_files.save(fact, tmp_path / "f.npz")
    back = dense_files.load(tmp_path / "f.npz")
    assert np.array_equal(back.strategy, fact.strategy) and back.report == fact.report
    assert (tmp_path / "f.json").exists() and not list(tmp_path.glob(".*tmp"))
    assert keys.parse_dense_key("me-lambda-k30-b48-tau1440") == ("me-lambda", 30, 48, 1440)
    assert keys.dense_key("se-lambda", 1, 1875) == "se-lambda-k1-b1875-tau1875"
    for bad in ("se-k2-b5", "me-k3-b4-tau5", "xx-k1-b2", "se-lambda-k1-b4-tau9"):
        with pytest.raises(ValueError):
            keys.parse_dense_key(bad)


# -- noise files ------------------------------------------------------------------------------

def test_noise_file_rows_have_covariance_c_inv_c_inv_t(tmp_path):
    fact = dense_factorization.factorize("me-k2-b3")
    dim, seed = 60_000, 7
    path = tmp_path / "noise.npy"
    noise_files.write_noise(path, fact.noising, dim, seed, chunk_blocks=4)
    rows = np.load(path, mmap_mode="r")
    assert rows.shape == (6, dim) and rows.dtype == np.float32
    # exactly C^-1 Z for the documented Z, independent of the writer's chunking
    z = noise_files.standard_normal(seed, 6, dim)
    np.testing.assert_allclose(rows, fact.noising.astype(np.float32) @ z, atol=1e-5)
    again = tmp_path / "again.npy"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".again.npy.{noise_files._HOST}.{dead.stdout.strip()}.x.tmp"  # a killed writer's
    stale.write_bytes(b"partial")
    noise_files.write_noise(again, fact.noising, dim, seed, chunk_blocks=1)
    assert path.read_bytes() == again.read_bytes() and not stale.exists()
    # statistics over the d columns: rows are N(0, C^-1 C^-T)
    cov = np.asarray(rows, dtype=np.float64) @ np.asarray(rows, dtype=np.float64).T / dim
    target = fact.noising @ fact.noising.T
    scale = np.sqrt(np.outer(np.diag(target), np.diag(target)) + target ** 2)  # std of one product
    assert np.abs(cov - target).max() < (5 * scale / np.sqrt(dim)).max()
    # row t read with one positioned read is row t of the file
    reader = noise_files.NoiseFile(path)
    assert np.array_equal(reader.row(4), rows[4]) and reader.dim == dim
    with pytest.raises(IndexError):
        reader.row(6)


def test_noise_writer_memory_stays_bounded(tmp_path):
    """A 512 MB file written with a peak RSS far below its size (T x d never in memory)."""
    code = (
        "import resource, numpy as np\n"
        "from dpbench.matrix.store import noise_files\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "c = np.tril(np.ones((32, 32))) / 32\n"
        f"noise_files.write_noise({str(tmp_path / 'big.npy')!r}, c, 4_000_000, 1, chunk_blocks=16)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=tree_env(OPENBLAS_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    growth_mb = int(out.stdout.split()[-1]) / 1024
    assert (tmp_path / "big.npy").stat().st_size > 500e6
    assert growth_mb < 100, f"peak RSS grew by {growth_mb:.0f} MB while writing a 512 MB file"


def test_concurrent_readers_never_see_a_partial_noise_file(tmp_path):
    """A writer process and reader threads: whenever the final name exists it is complete."""
    path = tmp_path / "noise.npy"
    steps, dim, seed = 64, 400_000, 3
    code = ("import numpy as np\n"
            "from dpbench.matrix.store import noise_files\n"
            f"noise_files.write_noise({str(path)!r}, np.eye({steps}), {dim}, {seed}, chunk_blocks=1)\n")
    expected_last = noise_files.standard_normal_block(seed, steps, (dim - 1) // noise_files.BLOCK)[
        -1, : dim - ((dim - 1) // noise_files.BLOCK) * noise_files.BLOCK]
    full_size = 128 + steps * dim * 4
    seen, errors, saw_tmp, stop = [], [], [], threading.Event()

    def reader():
        while not stop.is_set():
            if not path.exists() and list(tmp_path.glob(".noise.npy.*.tmp")):
                saw_tmp.append(True)  # the writer is busy, and the final name does not exist yet
            if path.exists():
                try:
                    size = path.stat().st_size
                    row = noise_files.NoiseFile(path).row(steps - 1)
                    seen.append((size, np.array_equal(row[-len(expected_last):], expected_last)))
                except Exception as exc:  # noqa: BLE001 - any failure to read is a partial file
                    errors.append(repr(exc))
            time.sleep(0.002)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=tree_env(OPENBLAS_NUM_THREADS="1"))
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert proc.returncode == 0, proc.stderr
    assert not errors, errors[:3]
    assert saw_tmp and seen and all(size == full_size and ok for size, ok in seen)
    assert not list(tmp_path.glob(".*.tmp"))


def test_cache_computes_each_file_once_even_concurrently(tmp_path, monkeypatch):
    calls = {"factorize": 0, "noise": 0}
    real_factorize, real_write = dense_factorization.factorize, noise_files.write_noise

    def counting_factorize(*a, **kw):
        calls["factorize"] += 1
        time.sleep(0.2)
        return real_factorize(*a, **kw)

    def counting_write(*a, **kw):
        calls["noise"] += 1
        return real_write(*a, **kw)

    monkeypatch.setattr(dense_factorization, "factorize", counting_factorize)
    monkeypatch.setattr(noise_files, "write_noise", counting_write)
    paths = []

    def cell():
        f = cache.ensure_factorization(tmp_path, "se-k1-b8")
        paths.append(cache.ensure_noise(tmp_path, dense_files.load(f), 5000, 11))

    threads = [threading.Thread(target=cell) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cell()  # a later cell
    assert calls == {"factorize": 1, "noise": 1} and len(set(paths)) == 1 and len(paths) == 5


# -- participation and sampling ----------------------------------------------------------------

def test_fixed_batches_are_exact_disjoint_and_repeat_every_epoch():
    n, L = 1003, 50
    sampler = FixedBatchSampler(n, L, seed=5)
    b = n // L
    first = [sampler.sample() for _ in range(b)]
    second = [sampler.sample() for _ in range(b)]
    assert all(x.numel() == L for x in first)
    everything = torch.cat(first)
    assert everything.unique().numel() == b * L and everything.max() < n  # disjoint, b L examples
    assert all(torch.equal(x, y) for x, y in zip(first, second))  # same order every epoch
    assert not torch.equal(everything, torch.arange(b * L))  # shuffled
    other = FixedBatchSampler(n, L, seed=6)
    assert not torch.equal(other.sample(), first[0])
    state = sampler.state_dict()
    nxt = sampler.sample()
    sampler.load_state_dict(state)
    assert torch.equal(sampler.sample(), nxt)


def test_single_epoch_refuses_more_than_one_epoch(tmp_path):
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers import get_optimizer

    for name in ("dpmatrix-se", "dpmatrix-se-lambda"):
        with pytest.raises(ValueError, match="single-epoch .* cannot train for E = 2 epochs"):
            get_optimizer(name).mechanism.plan(PlanRequest(600, 64, 2, cache_dir=tmp_path))
    assert get_optimizer("dpmatrix-me").mechanism.key(PlanRequest(600, 64, 2)) == "me-k2-b9"


def test_sigma_is_the_exact_gaussian_calibration(tmp_path):
    from dpbench.mechanisms.base import PrivacyClaim, Target
    from dpbench.mechanisms.dense_matrix import DenseMatrixPlan
    from dpbench.optimizers import get_optimizer

    mech = get_optimizer("dpmatrix-me").mechanism
    fact = dense_factorization.factorize("me-k3-b4")
    plan = DenseMatrixPlan(batch_size=64, steps=12, sample_rate=None, factorization=fact, factorization_file=Path("f"),
                           key=fact.key, epochs=3, batches=4, unused_examples=0, noise_file=None, cache_dir=tmp_path)
    for eps in (1.0, 10.0):
        sigma = mech.calibrate(plan, Target(eps, 1e-5))
        assert accounting.gaussian_delta(eps, fact.sensitivity / sigma) == pytest.approx(1e-5, rel=1e-6)
        assert accounting.gaussian_delta(eps, fact.sensitivity / (sigma * 0.999)) > 1e-5
        rep = PrivacyClaim(mech, plan, sigma, 1e-5).spent(12)
        assert rep.epsilon_spent == pytest.approx(eps, rel=1e-6) and rep.epsilon_rdp >= rep.epsilon_spent
    assert mech.calibrate(plan, Target(10.0, 1e-5)) == pytest.approx(0.500, abs=5e-4)  # not GDP's 0.788
    early = PrivacyClaim(mech, plan, 0.5, 1e-5).spent(5)  # stopped after 5 of 12 steps
    assert early.facts["strategy_sensitivity_steps_taken"] == pytest.approx(
        sensitivity.prefix_sensitivity(fact.strategy, 3, 4, 5))
    assert early.epsilon_spent < early.epsilon_planned


# -- the training loop -----------------------------------------------------------------------

class RowNoise:
    """I.i.d. noise from given rows (step t gets row t), shaped like the parameters."""

    def __init__(self, rows):
        self.rows, self.t = torch.from_numpy(np.asarray(rows)), 0

    def sample(self, like):
        flat, self.t = self.rows[self.t], self.t + 1
        out, i = [], 0
        for p in like:
            out.append(flat[i:i + p.numel()].view(p.shape).clone())
            i += p.numel()
        return out

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t = state["t"]


@pytest.mark.parametrize("optimizer,epochs", [("dpmatrix-se", 1), ("dpmatrix-me", 2)])
def test_identity_factorization_is_dpsgd_without_amplification(tiny_fmnist, tmp_path, optimizer, epochs):
    """B = A, C = I: the matrix run equals DP-SGD on the same fixed batches with the same
    i.i.d. noise Z, step for step, and sigma is that of one Gaussian release of sensitivity
    sqrt(k) (k participations of norm 1)."""
    from dpbench.data import image_datasets
    from dpbench.privacy.clipping import Clipping
    from dpbench.optimizers.base import SGD, Context, DPStep
    from dpbench.problems import get_problem
    from dpbench.seeds import stream_seeds
    from dpbench.training.train import RunConfig

    seed, L, lr, eps = 3, 64, 0.5, 2.0
    b = 600 // L
    steps = epochs * b
    fact = dense_factorization.from_strategy(f"identity-k{epochs}-b{b}", np.eye(steps))
    dense_files.save(fact, tmp_path / "identity.npz")
    seeds = stream_seeds(seed)
    dim = get_problem("P2").facts.parameters
    noise_files.write_noise(tmp_path / "noise.npy", fact.noising, dim, seeds["noise"],
                           meta={"factorization_digest": fact.digest})
    res = run_cell(RunConfig(problem="P2", optimizer=optimizer, lr=lr, batch_size=L, epochs=epochs, seed=seed,
                        epsilon=eps, factorization=str(tmp_path / "identity.npz"),
                        noise_file=str(tmp_path / "noise.npy"), progress_every_s=1e9))
    sigma = accounting.gaussian_noise_multiplier(eps, 1e-5, sensitivity=np.sqrt(epochs))
    assert res.meta["privacy"]["noise_multiplier"] == pytest.approx(sigma, rel=1e-12)

    # DP-SGD by hand: same model init, same fixed batches, same Z, no amplification
    problem = get_problem("P2")
    ds = image_datasets.load("fashion-mnist")
    x, y = problem.preprocess(ds.x_train), torch.from_numpy(ds.y_train)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeds["init"])
        model = problem.build()
    model.train()
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: problem.per_sample_loss(m, xb, yb), lr=lr,
                  expected_batch_size=L, noise_multiplier=sigma, clipping=Clipping(1.0, True),
                  noise=RowNoise(noise_files.standard_normal(seeds["noise"], steps, dim)), steps=steps)
    step = DPStep(ctx, SGD(lr))
    sampler = FixedBatchSampler(600, L, seeds["sampler"])
    losses = []
    for _ in range(steps):
        idx = sampler.sample()
        losses.append(step(x[idx], y[idx]).losses.double().mean().item())
    train = res.metrics[res.metrics.split == "train"]
    np.testing.assert_allclose(train.loss.to_numpy(), losses, rtol=1e-6)
    assert (train.batch_size == L).all()


def test_matrix_run_records_privacy_and_reuses_its_cache(tiny_fmnist, tmp_path):
    from dpbench.training.train import RunConfig

    cfg = dict(problem="P2", optimizer="dpmatrix-me-lambda", batch_size=100, epochs=2, seed=1,
               cache_dir=str(tmp_path), progress_every_s=1e9)
    a = run_cell(RunConfig(lr=0.1, epsilon=1.0, **cfg))
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    b = run_cell(RunConfig(lr=0.3, epsilon=10.0, max_steps=7, **cfg))
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files  # nothing new
    pa, pb = a.meta["privacy"], b.meta["privacy"]
    assert pa["matrix"]["key"] == "me-lambda-k2-b6-tau12"
    assert pa["noise_file"] == pb["noise_file"] and pa["noise_file"].startswith(str(tmp_path))
    assert pa["epsilon"] == pytest.approx(1.0, rel=1e-6) and pa["sample_rate"] is None
    assert pa["planned_steps"] == 12 and pb["steps"] == 7 and pb["epsilon"] < 10.0
    assert pa["accountant"].startswith("analytic-gaussian")


def test_cache_names_noise_files_by_the_problems_parameter_count():
    """A run's noise file is as wide as its model (the catalog's d, checked against the built
    models in tests/problems/test_problems.py) and named by its noise stream."""
    from dpbench.problems import catalog
    from dpbench.seeds import stream_seeds

    for pid, facts in catalog.FACTS.items():
        factorization, noise = cache.run_files("/c", "se-k1-b4", facts.parameters, 7)
        assert factorization == Path("/c/matrix/se-k1-b4/factorization.npz")
        assert noise == Path(f"/c/matrix/se-k1-b4/noise-d{facts.parameters}-seed{stream_seeds(7)['noise']}.npy")
    assert problems_facts("P2").parameters == 225_034


# -- commands and workflow ----------------------------------------------------------------------

def test_cli_factorize_and_noise(tmp_path):
    run_cli("factorize", "--key", "se-lambda-k1-b8-tau4", "--out", tmp_path / "f.npz")
    fact = dense_files.load(tmp_path / "f.npz")
    assert fact.key == "se-lambda-k1-b8-tau4" and (tmp_path / "f.json").exists()
    run_cli("noise", "--factorization", tmp_path / "f.npz", "--dim", 3000, "--seed", 9, "--out", tmp_path / "n.npy")
    meta = noise_files.read_meta(tmp_path / "n.npy")
    assert meta["factorization_digest"] == fact.digest and meta["seed"] == 9 and meta["steps"] == 8
    bad = run_cli("factorize", "--key", "se-k2-b8", "--out", tmp_path / "x.npz", check=False)
    assert bad.returncode == 2 and "needs k = 1" in bad.stderr


def test_workflow_reuses_factorization_and_noise_for_a_second_cell(tmp_path):
    """After the first cell's factorization and noise exist, a second cell (other learning
    rates and epsilons) schedules training jobs only."""
    def config(lrs, epsilons):
        return {"results_dir": "out", "train": {"train_subset": 256},
                "grid": [{"problems": ["P2"], "batch_sizes": [32], "epochs": [1], "epsilons": epsilons,
                          "optimizers": {"dpmatrix-se": {"lr": lrs}}}]}

    def snakemake(*args):
        return subprocess.run([snakemake_exe(), "--snakefile", REPO / "Snakefile", "--directory", tmp_path,
                               "--cores", "1", *args], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env=tree_env())

    (tmp_path / "one.yaml").write_text(yaml.safe_dump(config([0.1], [1])))
    first = snakemake("--configfile", tmp_path / "one.yaml", "--until", "noise")
    assert first.returncode == 0, first.stderr[-3000:]
    made = sorted(p.name for p in (tmp_path / "out" / "cache" / "matrix" / "se-k1-b8").iterdir())
    assert made[:2] == ["factorization.json", "factorization.npz"] and len(made) == 4
    assert made[2].startswith("noise-d225034-seed") and made[3] == made[2][:-5] + ".npy"
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(config([0.1, 0.5], [1, 10])))
    dry = snakemake("--configfile", tmp_path / "two.yaml", "-n", "--quiet", "rules")
    assert dry.returncode == 0, dry.stderr[-3000:]
    counts = {p[0]: int(p[1]) for p in (line.split() for line in dry.stdout.splitlines())
              if len(p) == 2 and p[1].isdigit()}
    assert counts.get("train") == 4 and "factorize" not in counts and "noise" not in counts


# The full factorize -> noise -> train -> aggregate -> figure path of a single-epoch (P2) and a
# multi-epoch convergence-aware (P3) cell runs in the tiny grid of tests/workflow/test_workflow.py.
