"""Streamed correlated noise (dpbench.mechanisms: noise, cyclic_poisson, streamed, amplified_banded): the
streamed noise against numpy.linalg.solve(C, Z) row by row, exact resume, the state's size; the
cyclic Poisson sampler's statistics; the amplified accounting against an independent PLD and
pinned dp_accounting numbers; the three mechanisms' calibration and reports; b = 1 amplified
BandMF equal to DP-SGD step for step."""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cell
from dpbench.privacy import accounting, pld
from dpbench.matrix import banded, blt
from dpbench.matrix import sensitivity as dense_sensitivity
from dpbench.mechanisms import cyclic_poisson, streamed
from dpbench.mechanisms.base import PlanRequest, PrivacyClaim, Target
from dpbench.mechanisms.noise import BandedNoise, BLTNoise, GaussianNoise
from dpbench.mechanisms.sampling import CyclicPoissonSampler, PoissonSampler
from dpbench.optimizers import get_optimizer


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """Plans without a cache directory compute their factorizations into this test's own."""
    monkeypatch.setenv("DPBENCH_CACHE_DIR", str(tmp_path / "cache"))


# parameters of a model stacking two replicas along the first axis, plus a bias
SHAPES = [(2, 3), (4,)]
DIM = 10


def stream(source, steps, dtype=torch.float64):
    like = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    return np.array([torch.cat([w.reshape(-1) for w in source.sample(like)]).double().numpy() for _ in range(steps)])


def gaussian_rows(seed, steps):
    """Z exactly as the sources draw it (i.i.d. noise of noise.GaussianNoise, same seed)."""
    return stream(GaussianNoise(seed), steps)


# -- streamed noise = solve(C, Z) ------------------------------------------------------------

@pytest.mark.parametrize("n,bands,column_normalize", [(2000, 16, True), (2000, 16, False), (300, 300, True),
                                                      (50, 1, True)])
def test_banded_noise_equals_solve_row_by_row(n, bands, column_normalize):
    fact = banded.optimize(n, bands, column_normalize=column_normalize)
    got = stream(BandedNoise(fact.coef, fact.scale(), seed=7), n)
    want = np.linalg.solve(fact.matrix(), gaussian_rows(7, n))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    # each coordinate is its own stream C_used^-1 z[:, coordinate], so the two replicas stacked
    # in the (2, 3) parameter get the transforms of independent columns of Z
    assert not np.allclose(got[:, 0:3], got[:, 3:6])


def test_band_one_is_iid_gaussian_noise_bit_for_bit():
    source = BandedNoise([1.0], np.ones(20), seed=3)
    np.testing.assert_array_equal(stream(source, 20), gaussian_rows(3, 20))
    assert source.state_floats == 0


def test_blt_noise_equals_solve_row_by_row():
    n = 2000
    f = blt.BLT.from_pair([0.999, 0.95, 0.6], [0.99, 0.8, 0.2], n)
    assert f.in_class()
    got = stream(BLTNoise(f.theta, f.omega, n, seed=11), n)
    np.testing.assert_allclose(got, np.linalg.solve(f.matrix(), gaussian_rows(11, n)), rtol=1e-9, atol=1e-9)


def test_float32_streams_stay_close_to_float64():
    n = 2000
    fact = banded.optimize(n, 64)
    hi = stream(BandedNoise(fact.coef, fact.scale(), seed=1), n)
    lo = stream(BandedNoise(fact.coef, fact.scale(), seed=1), n, dtype=torch.float32)
    assert np.abs(lo - hi).max() < 1e-4 * np.abs(hi).max()


@pytest.mark.parametrize("kind", ["band", "blt"])
def test_resume_from_state_dict_gives_identical_rows_and_state_is_small(kind):
    n = 40
    if kind == "band":
        fact = banded.optimize(n, 6)

        def make():
            return BandedNoise(fact.coef, fact.scale(), seed=5)
        floats = 5 * DIM  # (b - 1) d
    else:
        f = blt.BLT.from_pair([0.9, 0.5], [0.7, 0.1], n)

        def make():  # reversed views (negative strides) are accepted
            return BLTNoise(f.theta[::-1][::-1], np.ascontiguousarray(f.omega[::-1])[::-1], n, seed=5)
        floats = 2 * DIM  # m d
    a = make()
    stream(a, 13)
    saved = copy.deepcopy(a.state_dict())
    assert a.state_floats == floats and saved["state"].numel() == floats
    rest = stream(a, n - 13)
    b = make()
    b.load_state_dict(saved)
    np.testing.assert_array_equal(stream(b, n - 13), rest)
    with pytest.raises(RuntimeError, match=f"for {n} steps"):
        stream(b, 1)


# -- cyclic Poisson sampling -------------------------------------------------------------------

def test_cyclic_poisson_groups_rate_and_batch_sizes():
    n_examples, bands, L = 24_000, 6, 200
    p = cyclic_poisson.sample_rate(bands, L, n_examples)
    assert p == pytest.approx(bands * L / n_examples)
    s = CyclicPoissonSampler(n_examples, bands, p, seed=1)
    groups = s.groups.numpy()
    counts = np.bincount(groups, minlength=bands)
    sd = math.sqrt(n_examples * (1 / bands) * (1 - 1 / bands))
    assert np.abs(counts - n_examples / bands).max() < 5 * sd
    # groups do not depend on the index (the first and second halves look alike)
    half = np.bincount(groups[: n_examples // 2], minlength=bands)
    assert np.abs(2 * half - counts).max() < 5 * sd
    steps = 600
    sizes, hits = [], np.zeros(n_examples)
    for t in range(steps):
        idx = s.sample().numpy()
        assert (groups[idx] == t % bands).all()  # only group t mod b
        assert len(np.unique(idx)) == len(idx)
        sizes.append(len(idx))
        hits[idx] += 1
    sizes = np.array(sizes)
    assert abs(sizes.mean() - L) < 5 * math.sqrt(L / steps)  # expected batch size L
    # per group: Binomial(|group|, p) sizes
    for g in range(bands):
        sz = sizes[g::bands]
        assert abs(sz.mean() - counts[g] * p) < 5 * math.sqrt(counts[g] * p * (1 - p) / sz.size)
        assert sz.var() == pytest.approx(counts[g] * p * (1 - p), rel=0.5)
    # each example is sampled at rate p when its group's turn comes
    visits = steps // bands
    assert hits.mean() / visits == pytest.approx(p, rel=0.02)


def test_cyclic_poisson_refuses_rate_above_one():
    with pytest.raises(ValueError, match="b <= N / L"):
        cyclic_poisson.sample_rate(11, 100, 1000)
    assert cyclic_poisson.sample_rate(10, 100, 1000) == 1.0


def test_one_band_is_poisson_sampling_with_the_same_batches():
    a = CyclicPoissonSampler(500, 1, 0.05, seed=9)
    b = PoissonSampler(500, 0.05, seed=9)
    for _ in range(30):
        assert torch.equal(a.sample(), b.sample())


def test_cyclic_poisson_resume_and_lanes():
    s = CyclicPoissonSampler(1000, 4, 0.2, seed=2)
    for _ in range(5):
        s.sample()
    saved = copy.deepcopy(s.state_dict())
    rest = [s.sample() for _ in range(7)]
    t = CyclicPoissonSampler(1000, 4, 0.2, seed=99)  # other seed: state decides
    t.load_state_dict(saved)
    assert all(torch.equal(x, y) for x, y in zip(rest, [t.sample() for _ in range(7)]))
    # lanes: one sampler over lanes * N examples, lane-major; each lane gets its own groups and batch ~ L
    mech = get_optimizer("dpmatrix-band-amp").mechanism
    n_train, L, lanes = 2000, 50, 3
    plan = mech.plan(PlanRequest(n_train, L, 2, hyperparameters={"bands": 4}))
    sampler = mech.sampler(plan, n_train, seed=4, device="cpu", lanes=lanes)
    per_lane = np.zeros(lanes)
    for _ in range(200):
        idx = sampler.sample().numpy()
        per_lane += np.bincount(idx // n_train, minlength=lanes)
    np.testing.assert_allclose(per_lane / 200, L, rtol=0.1)
    g = sampler.groups.numpy().reshape(lanes, n_train)
    assert not (g[0] == g[1]).all()


# -- amplified accounting ----------------------------------------------------------------------

# dp_accounting 0.6.0 in a throwaway venv (never a dependency):
#   acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
#   acc.compose(SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), k)); acc.get_epsilon(1e-5)
DP_ACCOUNTING = {(0.04, 1.0, 25): 1.748620423472895, (0.2, 2.0, 50): 3.4880217803278035,
                 (0.05, 0.8, 100): 5.7412434240677035,
                 (0.0512, 4.785, 586): 0.9897444752575181}  # Setup 3, P3, L = 1024, b = 3, eps = 1


@pytest.mark.parametrize("q,sigma,rounds", sorted(DP_ACCOUNTING))
def test_amplified_event_prv_against_an_independent_pld(q, sigma, rounds):
    """The harness's PRV epsilon of the amplified event lies between our optimistic and
    pessimistic PLD bounds (up to PRV's own eps_error), and so does dp_accounting's."""
    upper = pld.epsilon(1e-5, q, sigma, rounds)
    lower = pld.epsilon(1e-5, q, sigma, rounds, pessimistic=False)
    prv = accounting.epsilon([(sigma, q, rounds)], 1e-5, "prv")
    assert lower <= DP_ACCOUNTING[(q, sigma, rounds)] <= upper
    assert upper - lower < 0.012
    assert lower - 0.01 <= prv <= upper + 0.02
    assert pld.delta([upper], q, sigma, rounds)[0] <= 1e-5


def test_pld_of_one_full_batch_release_is_the_gaussian_mechanism():
    assert pld.epsilon(1e-5, 1.0, 5.0, 1) == pytest.approx(accounting.gaussian_epsilon(1 / 5.0), abs=2e-4)


def amp_plan(n_train, L, epochs, bands, epsilon=None):
    mech = get_optimizer("dpmatrix-band-amp").mechanism
    return mech, mech.plan(PlanRequest(n_train, L, epochs, hyperparameters={"bands": bands}, target_epsilon=epsilon,
                                       delta=1e-5))


def test_amplified_calibration_uses_rounds_and_rate_b_times_L_over_N(monkeypatch):
    mech, plan = amp_plan(1000, 10, 1, 4)
    assert plan.steps == 100 and plan.rounds == 25 and plan.sample_rate == pytest.approx(0.04)
    assert plan.max_column_norm == pytest.approx(1.0)
    # the accounted event: ceil(T / b) = 25 steps at p = b L / N = 0.04 (not 100 steps, not L / N = 0.01)
    assert mech.history(plan, 1.3, 100) == [(1.3, 0.04, 25)]
    assert mech.history(plan, 1.3, 37) == [(1.3, 0.04, 10)]  # stopped early: ceil(37 / 4) rounds
    calls = []
    monkeypatch.setattr(accounting, "noise_multiplier_for", lambda *a: calls.append(a) or 1.25)
    assert mech.calibrate(plan, Target(2.0, 1e-5, "prv")) == 1.25
    assert calls == [(2.0, 0.04, 25, 1e-5, accounting.PRV)]
    monkeypatch.undo()
    sigma = 1.0
    claim = PrivacyClaim(mech, plan, sigma, 1e-5, "prv")
    rep = claim.spent(100)
    assert rep.epsilon_spent == accounting.epsilon([(sigma, 0.04, 25)], 1e-5, "prv")
    facts, record = rep.facts, claim.record(100)
    # the accounted noise multiplier is typed (not a fact over the record's key); q and T are the claim's
    assert (rep.noise_multiplier, record.noise_multiplier, record.sample_rate, record.planned_steps,
            facts["bands"], facts["rounds"]) == (sigma, sigma, 0.04, 100, 4, 25)
    assert not {"noise_multiplier", "sample_rate", "planned_steps"} & set(facts)
    assert rep.epsilon_rdp >= rep.epsilon_spent
    profile = claim.profile()([rep.epsilon_spent])
    assert profile[0] == pytest.approx(1e-5, rel=1e-6)  # the claim at the recorded epsilon is delta


def test_amplified_band_one_is_accounted_as_dpsgd():
    mech, plan = amp_plan(600, 60, 2, 1)
    dpsgd = get_optimizer("dpsgd").mechanism
    dplan = dpsgd.plan(PlanRequest(600, 60, 2))
    assert (plan.steps, plan.sample_rate) == (dplan.steps, dplan.sample_rate)
    for steps in (20, 7):  # the same accountant input, so the same sigma and epsilon
        assert mech.history(plan, 1.7, steps) == dpsgd.history(dplan, 1.7, steps)


def test_auto_bands_need_a_target_epsilon_and_search_includes_one():
    with pytest.raises(ValueError, match="bands = 'auto' .* --epsilon"):
        amp_plan(600, 60, 1, "auto")
    # a synthetic proxy with its minimum at b = 1, and one at an interior point
    b, evaluated = cyclic_poisson.choose_bands(60_000, 32, 1875, 1.0, 1e-5, evaluate=lambda b: b)
    assert b == 1 and evaluated[0]["bands"] == 1
    b, evaluated = cyclic_poisson.choose_bands(60_000, 32, 1875, 1.0, 1e-5, evaluate=lambda b: (b - 77) ** 2 + 1)
    assert b == 77 and len(evaluated) < 40
    assert max(e["bands"] for e in evaluated) == 1875  # floor(N / L) is a candidate


@pytest.mark.slow
def test_auto_bands_on_a_small_problem_beat_or_tie_dpsgd():
    mech, plan = amp_plan(1000, 20, 1, "auto", epsilon=1.0)
    search = plan.band_search
    proxies = {e["bands"]: e["proxy"] for e in search}
    assert plan.bands == min(proxies, key=proxies.get) and proxies[plan.bands] <= proxies[1]
    assert proxies[1] == pytest.approx(search[0]["sigma_rdp"] * math.sqrt((50 + 1) / 2))  # DP-SGD's err_mean


# -- the unamplified mechanisms ----------------------------------------------------------------

def request(**hyper):
    return PlanRequest(600, 60, 3, hyperparameters=hyper)


def test_band_mechanism_plan_calibration_and_report():
    mech = get_optimizer("dpmatrix-band").mechanism
    plan = mech.plan(request())
    fact = plan.factorization
    assert plan.steps == 30 and plan.sample_rate is None and fact.bands == 10  # auto: min(64, b' = 10, T)
    assert plan.sensitivity == pytest.approx(math.sqrt(3))  # column-normalised: sqrt(k)
    assert plan.sensitivity == pytest.approx(
        dense_sensitivity.sensitivity(fact.matrix(), 3, 10))
    sigma = mech.calibrate(plan, Target(1.0, 1e-5))
    assert sigma == accounting.gaussian_noise_multiplier(1.0, 1e-5, sensitivity=math.sqrt(3))
    claim = PrivacyClaim(mech, plan, sigma, 1e-5)
    rep = claim.spent(30)
    assert rep.epsilon_spent == pytest.approx(1.0, rel=1e-6) and rep.epsilon_rdp >= rep.epsilon_spent
    matrix = rep.facts["matrix"]
    assert matrix["bands"] == 10 and len(matrix["coefficients"]) == 10
    assert matrix["key"] == "band-n30-b10" and matrix["factorization_file"].endswith("band-n30-b10.json")
    early = claim.spent(12)  # stopped after 12 steps: C_used[:12, :12]
    assert early.facts["strategy_sensitivity_steps_taken"] == pytest.approx(
        dense_sensitivity.prefix_sensitivity(fact.matrix(), 3, 10, 12))
    assert 1 < early.facts["strategy_sensitivity_steps_taken"] < math.sqrt(2)
    assert early.epsilon_spent < rep.epsilon_spent
    assert claim.profile()([1.0])[0] == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(ValueError, match="bands = 11 exceeds the steps per epoch b' = N // L = 10"):
        mech.plan(request(bands=11))
    assert mech.plan(request(bands=3)).factorization.bands == 3
    with pytest.raises(ValueError, match="'bands' must be a positive integer or 'auto'"):
        mech.plan(request(bands=0))


def test_blt_mechanism_plan_calibration_and_report():
    mech = get_optimizer("dpmatrix-blt").mechanism
    plan = mech.plan(PlanRequest(600, 60, 2, hyperparameters={"buffers": 2}))
    fact = plan.factorization
    assert plan.steps == 20 and fact.buffers == 2 and fact.in_class()
    assert plan.sensitivity == pytest.approx(dense_sensitivity.sensitivity(fact.matrix(), 2, 10), rel=1e-12)
    sigma = mech.calibrate(plan, Target(2.0, 1e-5))
    rep = PrivacyClaim(mech, plan, sigma, 1e-5).spent(20)
    assert rep.epsilon_spent == pytest.approx(2.0, rel=1e-6) and rep.facts["matrix"]["buffers"] == 2
    assert rep.facts["strategy_sensitivity"] == plan.sensitivity
    noise = mech.noise(plan, 3, "cpu")
    got = stream(noise, 20)
    np.testing.assert_allclose(got, np.linalg.solve(fact.matrix(), gaussian_rows(3, 20)), atol=1e-10)


def test_factorize_is_a_pure_function_of_its_arguments():
    a = streamed.factorize("band", 200, 50, 4, 16)
    b = streamed.factorize("band", 200, 50, 4, 16)
    np.testing.assert_array_equal(a.coef, b.coef)
    with pytest.raises(ValueError, match="unknown streamed factorization kind"):
        streamed.factorize("dense", 10, 10, 1, 1)
    with pytest.raises(ValueError, match="1 <= b <= min"):
        streamed.factorize("band", 200, 10, 4, 16)


# -- whole runs --------------------------------------------------------------------------------

@pytest.mark.slow
def test_band_one_amplified_run_equals_dpsgd_step_for_step(tiny_fmnist, tmp_path):
    from dpbench.training.train import RunConfig

    # sigma given: the calibration's equality is test_amplified_band_one_is_accounted_as_dpsgd's
    cfg = dict(problem="P2", lr=0.2, batch_size=60, epochs=2, seed=3, noise_multiplier=1.3, progress_every_s=1e9,
               cache_dir=str(tmp_path))
    a = run_cell(RunConfig(optimizer="dpsgd", **cfg))
    b = run_cell(RunConfig(optimizer="dpmatrix-band-amp", hyperparameters={"bands": 1}, **cfg))
    ma, mb = a.metrics, b.metrics
    np.testing.assert_array_equal(ma.loss.to_numpy(), mb.loss.to_numpy())
    np.testing.assert_array_equal(ma.batch_size.to_numpy(), mb.batch_size.to_numpy())
    pa, pb = a.meta["privacy"], b.meta["privacy"]
    for key in ("noise_multiplier", "sample_rate", "epsilon", "epsilon_rdp", "planned_steps"):
        assert pa[key] == pb[key], key
    # a streamed run writes no noise file: its cache holds the factorization (and its lock) only
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["band-n20-b1.json", "band-n20-b1.json.lock"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,hp", [("dpmatrix-band", "bands=3"), ("dpmatrix-band-amp", "bands=2"),
                                          ("dpmatrix-blt", "buffers=1")])
def test_streamed_run_writes_no_file_larger_than_its_factorization(tiny_fmnist, tmp_path, monkeypatch, optimizer, hp):
    """``dpbench train`` of a streamed mechanism, two epochs with a checkpoint at the first epoch
    end: the bytes the process writes are its factorization, its checkpoint (mode 0600: it holds
    the noise state) and its run file, nothing else; afterwards only the run file and the
    factorization remain, and the run file is smaller than the noise state it must not hold."""
    from dpbench.cli import main
    from dpbench.training.checkpoint import Checkpoint

    io = Path("/proc/self/io")
    if not io.exists():
        pytest.skip("needs /proc/self/io (Linux)")

    def written():
        return int(next(x for x in io.read_text().splitlines() if x.startswith("wchar:")).split()[1])

    checkpoints = []
    original = Checkpoint.save

    def save(self, state):
        original(self, state)
        checkpoints.append((self.path.stat().st_size, self.path.stat().st_mode & 0o777,
                            state["step_fn"]["noise"]["state"].numel() * 4))
    monkeypatch.setattr(Checkpoint, "save", save)
    out, cache_dir = tmp_path / "runs" / "run.parquet", tmp_path / "cache"
    before = written()
    assert main(["train", "--problem", "P2", "--optimizer", optimizer, "--hp", hp, "--lr", "0.1", "--batch-size", "60",
                 "--epochs", "2", "--seed", "1", "--noise-multiplier", "1.0", "--out", str(out),
                 "--cache-dir", str(cache_dir), "--progress-every", "1e9"]) == 0
    total = written() - before
    files = {p.relative_to(tmp_path).as_posix(): p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    (fact,) = [p for p in files if p.startswith("cache/streaming/") and p.endswith(".json")]
    assert set(files) == {"runs/run.parquet", fact, fact + ".lock"}  # the checkpoint is gone
    assert len(checkpoints) == 1 and checkpoints[0][1] == 0o600
    ckpt_bytes, _, state_bytes = checkpoints[0]
    assert state_bytes > 0 and files["runs/run.parquet"] < state_bytes
    # everything written: factorization + checkpoint + run file (+ a few kB of messages): no noise file
    assert total <= files[fact] + ckpt_bytes + files["runs/run.parquet"] + 16_384, total


class _Interrupt(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["dpmatrix-band-amp", "dpmatrix-blt"])
def test_streamed_run_resumes_to_identical_metrics(tiny_fmnist, tmp_path, monkeypatch, optimizer):
    """Killed mid-epoch after a checkpoint, the run resumes with the noise state, sampler and
    model of the checkpoint and ends with the metrics of an uninterrupted run."""
    from dpbench.training.checkpoint import Checkpoint
    from dpbench.training.config import RunConfig

    cfg = RunConfig(problem="P2", optimizer=optimizer, lr=0.1, batch_size=60, epochs=2, seed=4, noise_multiplier=1.1,
                    hyperparameters={"bands": 3} if "band" in optimizer else {"buffers": 1}, progress_every_s=1e9)
    reference = run_cell(cfg)
    mech = get_optimizer(optimizer).mechanism
    original = type(mech).sampler
    calls = {"n": 0}

    class Flaky:
        def __init__(self, inner):
            self.inner = inner

        def sample(self):
            calls["n"] += 1
            if calls["n"] == 13:
                raise _Interrupt
            return self.inner.sample()

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state):
            self.inner.load_state_dict(state)

    monkeypatch.setattr(type(mech), "sampler", lambda self, *a, **k: Flaky(original(self, *a, **k)))
    ckpt = tmp_path / "run.ckpt"
    with pytest.raises(_Interrupt):
        run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)
    state = Checkpoint(ckpt, cfg).load()  # verified (its SHA-256), read to the CPU
    assert state["step_fn"]["noise"]["state"] is not None  # the noise state travels in the checkpoint
    assert ckpt.stat().st_mode & 0o777 == 0o600  # ... which makes it a private file
    resumed = run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)
    import pandas as pd

    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)
