"""GPU measurements: step throughput per problem against Opacus, many training processes per
GPU, the cost of deterministic kernels, and the measured cost model of dpbench.pipeline.cluster.

Every subcommand writes JSON (and a Markdown table naming the device) and runs on a CPU too
(``--device cpu --quick``: a smoke test of the same code with tiny sizes).

``throughput``  ms per step, steps/s and examples/s on P1, P2, P3 at the thesis batch sizes
    (P1/P2: L in 256..2048, P2 also 32 and 64 for Setup 2, P3: 1024, 2048) of the non-private
    step, dpsgd, dpadambc, dpdice, dpdisk and a matrix mechanism (dpmatrix-se fed by an
    in-memory pool of noise rows that travel to the device every step exactly like rows of a
    noise file), dpsgd with a candidate per-sample convolution gradient (``dpsgd-unfold``,
    see ``unfold_materialised``), then Opacus 1.6 in its three modes: hooks, ghost clipping
    (``grad_sample_mode="ghost"``) and functorch. All methods get the same Poisson batches (the
    same seeded sampler over the same in-memory tensors, drawn every step as in training), the
    same model initialisation, sigma = 1, C = 1, plain SGD. Timing: warm-up steps, the timed
    batches once untimed (every batch size seen: shape-specific kernel plans are cached, as in a
    long run), then three blocks of them with device synchronisation at their ends; the median
    block is reported (min and max too). Data are synthetic images of each problem's shape (the
    cost of a step does not depend on pixel values). Also the forward-only evaluation cost per
    test example.
    With ``--cuda-graphs`` also ``sgd+graphs``, ``dpsgd+graphs`` and ``dpmatrix-se+graphs``: the
    same steps captured as CUDA graphs on Poisson batches padded to bucket sizes
    (``dpbench.training.capture``; its record, with how many steps replayed a graph, is kept in
    the row); on a CPU the padded step runs without graphs.
``concurrency`` K processes (K in 1, 2, 4, 8, 16) each training the same cell on one GPU:
    aggregate steps/s over a common time window, and the SHA-256 of the parameters after the
    first M steps of each process, which must be the same for every process and every K
    (concurrency must not change results).
``determinism`` steps/s of dpsgd with the harness's GPU numerics (deterministic kernels, no
    TF32) against non-deterministic kernels and against TF32, interleaved.
``costs``       merges the JSON of the above (and a measured start-up time) into the cost
    model file read by ``dpbench.pipeline.cluster`` (src/dpbench/gpu_costs.json once committed); the
    gain of K processes there is their aggregate steps/s over one process's steady-state
    steps/s from the throughput run (see ``cmd_costs``).

Usage:  python benchmarks/bench_gpu.py throughput --out DIR [--device cuda] [--budget-s 200] [--quick] [--cuda-graphs]
        python benchmarks/bench_gpu.py concurrency --out DIR [--ks 1,2,4,8,16] [--window-s 5]
        python benchmarks/bench_gpu.py determinism --out DIR
        python benchmarks/bench_gpu.py costs --out DIR [--startup-s S]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dpbench.training import capture, cuda
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.mechanisms.noise import CorrelatedNoise
from dpbench.mechanisms.noise import GaussianNoise
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context
from dpbench.privacy.per_sample_conv import Conv2dGrads
from dpbench.privacy.per_sample_layers import FactorGrads
from dpbench.problems import get_problem
from dpbench.mechanisms.sampling import PoissonSampler

REPO = Path(__file__).resolve().parents[1]

N_TRAIN = {"P1": 50_000, "P2": 60_000, "P3": 60_000, "P4": 12_979}
SHAPES = {"P1": (3, 32, 32), "P2": (1, 28, 28), "P3": (1, 28, 28)}
BATCH_SIZES = {"P1": [256, 512, 1024, 2048], "P2": [32, 64, 256, 512, 1024, 2048], "P3": [1024, 2048],
               "P4": [64, 256, 1024]}
OURS = ["sgd", "dpsgd", "dpadambc", "dpdice", "dpdisk", "dpmatrix-se", "dpsgd-unfold"]
OPACUS = ["opacus-hooks", "opacus-ghost", "opacus-functorch"]
SETUP2_METHODS = {"sgd", "dpsgd", "dpmatrix-se"}  # what Setup 2 runs at L = 32, 64
GRAPHED = ["sgd+graphs", "dpsgd+graphs", "dpmatrix-se+graphs"]  # --cuda-graphs: captured steps
SIGMA, LR = 1.0, 0.01
LR_OF = {"dpadambc": 1e-5}  # Adam's steps are lr-sized whatever the gradient: keep the model finite


# -- environment ------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def environment(device: torch.device) -> dict:
    env = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
           "cuda_settings": cuda.settings()}
    try:
        import opacus
        env["opacus"] = opacus.__version__
    except ImportError:
        env["opacus"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(cuda_runtime=torch.version.cuda, multiprocessors=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return env


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


# -- data and steps ---------------------------------------------------------------------------

def synthetic_data(problem_id: str, n: int, device, seed: int = 0):
    """n images of the problem's shape (uint8 -> the problem's preprocessing) and labels; for
    P4, ``lm_records``."""
    problem = get_problem(problem_id)
    if problem_id == "P4":
        return lm_records(n, device, seed)
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, *SHAPES[problem_id]), dtype=np.uint8)
    x = problem.preprocess(images).to(device)
    y = torch.from_numpy(rng.integers(0, 10, n)).to(device)
    return x, y


LM_DATA: dict[str, str] = {}  # P4: where its records came from (the throughput output says)


def lm_records(n: int, device, seed: int = 0):
    """P4's training records as token rows (n, 129), labels unused zeros: the real fortunes
    records where the corpus is installed, else generated records of 1 to 127 random letters
    encoded as P4 encodes its records (``tokenizer.encode_records``), which time the same shapes."""
    from dpbench.data.dataset import DataError
    from dpbench.problems import language, tokenizer

    problem = get_problem("P4")
    try:
        x = problem.preprocess(problem.load(None).x_train)
        LM_DATA["P4"] = f"the fortunes training records ({x.shape[0]})"
    except DataError:
        rng = np.random.default_rng(seed)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
        texts = ["".join(rng.choice(letters, k)) for k in rng.integers(1, language.CONTEXT, n)]
        x = problem.preprocess(tokenizer.encode_records(texts, language.CONTEXT))
        LM_DATA["P4"] = f"generated records ({n}; the fortunes corpus is not installed here)"
    x = x[:n] if x.shape[0] >= n else x.repeat((n + x.shape[0] - 1) // x.shape[0], 1)[:n]
    return x.to(device), torch.zeros(n, dtype=torch.int64, device=device)


class RowPool:
    """Stands in for a NoiseFile: a few rows of N(0, 1) in memory, read cyclically into the
    row buffer (a page-cache read of a real noise file is the same copy)."""

    def __init__(self, dim: int, rows: int = 4, seed: int = 0):
        self.dim, self.steps = dim, rows
        self.data = np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)

    def row(self, t: int, out: np.ndarray) -> np.ndarray:
        out[:] = self.data[t % self.steps]
        return out


class PooledNoise(CorrelatedNoise):
    """The matrix mechanisms' noise source with an in-memory row pool instead of a file."""

    def __init__(self, dim: int, device):
        super().__init__(resolve=lambda d: None, device=device)
        self.file = RowPool(dim)
        self._row = torch.empty(dim, dtype=torch.float32)


@contextlib.contextmanager
def unfold_materialised():
    """A candidate for the per-sample weight gradients of convolutions (measured as the method
    ``dpsgd-unfold``): one batched matrix product of the unfolded factors, G_i^T A_i, as for
    Linear layers, instead of dpbench's grouped convolution (groups = B) per layer."""
    original = Conv2dGrads.__dict__["_materialise"]
    Conv2dGrads._materialise = FactorGrads._materialise  # ConvTranspose2dGrads inherits it
    try:
        yield
    finally:
        Conv2dGrads._materialise = original


def build_model(problem_id: str, device, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_problem(problem_id).build()
    return model.to(device).train()


def our_step(problem_id: str, name: str, L: int, device, steps: int, n: int | None = None):
    """(step(x, y), model) of one of our optimizers, built as the harness builds it
    (``NAME-unfold``: with ``unfold_materialised``; ``NAME+graphs``: captured as CUDA graphs on
    Poisson batches of q = L / n padded to ``capture.capacities``, a ``capture.CapturedStep``)."""
    if name.endswith("+graphs"):
        inner, model = our_step(problem_id, name.removesuffix("+graphs"), L, device, steps, n)
        n = n or N_TRAIN[problem_id]
        caps = capture.capacities(PoissonSampler(n, L / n, seed=0))
        problem, gen = get_problem(problem_id), torch.Generator(device=device).manual_seed(1)
        return capture.CapturedStep(inner.__self__, caps, graphs=torch.device(device).type == "cuda",
                                    loss_fn=lambda m, x, y: problem.task.fixed_shape_loss(m, x, y, gen)), model
    if name.endswith("-unfold"):
        inner, model = our_step(problem_id, name.removesuffix("-unfold"), L, device, steps)

        def step(x, y):
            with unfold_materialised():
                return inner(x, y)

        return step, model
    problem, spec = get_problem(problem_id), get_optimizer(name)
    model = build_model(problem_id, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    d = sum(p.numel() for p in model.parameters())
    noise = PooledNoise(d, device) if name.startswith("dpmatrix") else GaussianNoise(2, device)
    ctx = Context(model=model, loss_fn=lambda m, x, y: problem.per_sample_loss(m, x, y, gen), lr=LR_OF.get(name, LR),
                  expected_batch_size=L, noise_multiplier=SIGMA if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(), noise=noise, steps=steps,
                  hyperparameters=spec.hyperparameters(None))
    step = spec.build(ctx)
    return step.__call__, model


def contiguous_embedding_ids(model: torch.nn.Module) -> None:
    """Hands every nn.Embedding of ``model`` contiguous ids (a copy where they are a view), which
    Opacus 1.6's ghost-clipping norm sampler needs: it calls ``.view(-1, 1)`` on them
    (opacus/grad_sample/embedding_norm_sample.py:123; benchmarks/opacus_ghost_embedding_bug.py).
    P4's ids are views (tokens ``x[:, :-1]``, positions ``arange(T).expand(B, T)``). The layer's
    output is unchanged; the copy is part of the timed step (one (B, T) int64 copy per embedding)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.register_forward_pre_hook(lambda _, args: tuple(a.contiguous() for a in args))


def opacus_step(problem_id: str, mode: str, L: int, n: int, device):
    """(step(x, y), model) of Opacus 1.6's make_private in ``mode`` (hooks, ghost, functorch),
    fed batches directly (no DataLoader: the loader only tells Opacus the expected batch size).
    The per-sample losses are the problem's (P4: ``language.per_sample_loss`` on Opacus's
    wrapped module, the same per-record loss and per-batch trimming as dpbench's step)."""
    from opacus import PrivacyEngine
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
    from torch.utils.data import DataLoader, TensorDataset

    problem = get_problem(problem_id)
    model = build_model(problem_id, device)
    if mode == "ghost":
        contiguous_embedding_ids(model)
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=L)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode=mode)
    module, optimizer = made[0], made[1]
    latent = model.mu.out_features if problem.task.name == "vae" else None
    warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus's hooks on a model without input grads

    def losses_of(x, y):
        if problem.task.name == "language-model":  # P4: per-record mean token CE, batch cut to its longest record
            return problem.per_sample_loss(module, x, y, gen)[0]
        if latent is None:
            return torch.nn.functional.cross_entropy(module(x), y, reduction="none")
        z = torch.randn(x.shape[0], latent, generator=gen, device=x.device)
        recon, mu, logvar = module(x, z)
        rec = torch.nn.functional.binary_cross_entropy(recon, x, reduction="none").flatten(1).sum(1)
        return rec - 0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        losses = losses_of(x, y)
        if mode == "ghost":  # what Opacus's criterion wrapper does with per-sample losses
            DPTensorFastGradientClipping(module, optimizer, losses, "mean").backward()
        else:
            losses.mean().backward()
        optimizer.step()

    return step, model


def make_step(problem_id: str, method: str, L: int, n: int, device, steps: int):
    if method.startswith("opacus-"):
        return opacus_step(problem_id, method.removeprefix("opacus-"), L, n, device)
    return our_step(problem_id, method, L, device, steps, n)


def time_method(step, x, y, L: int, device, target_s: float, warmup: int = 3, repeats: int = 3,
                max_block: int = 200) -> dict:
    """Seconds per step in steady state: a few warm-up steps size the blocks; the Poisson
    batches of ``repeats`` blocks (one seeded sampler: the same batches for every method) are
    run once untimed, so that every batch size has been seen (kernel plans and oneDNN
    primitives are made per shape and cached, as they are over a long run), then again in
    blocks, each ended by a device synchronisation; the median block is reported."""
    n = x.shape[0]
    sampler = PoissonSampler(n, L / n, seed=7, device=device)
    t = time.perf_counter()
    for _ in range(warmup):
        idx = sampler.sample()
        step(x[idx], y[idx])
    synchronize(device)
    per_step = (time.perf_counter() - t) / warmup
    block = int(min(max_block, max(3, target_s / repeats / max(per_step, 1e-6))))
    batches = [sampler.sample() for _ in range(block * repeats)]
    for idx in batches:  # every batch size once
        step(x[idx], y[idx])
    synchronize(device)
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        for idx in batches[r * block:(r + 1) * block]:
            step(x[idx], y[idx])
        synchronize(device)
        times.append((time.perf_counter() - t) / block)
    s = statistics.median(times)
    return {"s_per_step": s, "s_min": min(times), "s_max": max(times), "steps_per_s": 1 / s,
            "examples_per_s": L / s, "timed_steps": block * repeats}


def eval_seconds_per_example(problem_id: str, x, y, device, batch: int = 1000) -> float:
    """Forward-only evaluation (the harness's ``evaluate``) over up to 10,000 examples."""
    from dpbench.training.train import evaluate

    model = build_model(problem_id, device)
    m = min(10_000, x.shape[0])
    evaluate(get_problem(problem_id), model, x[:batch], y[:batch], batch, 0)  # warm-up
    synchronize(device)
    t = time.perf_counter()
    evaluate(get_problem(problem_id), model, x[:m], y[:m], batch, 0)
    synchronize(device)
    return (time.perf_counter() - t) / m


# -- throughput -------------------------------------------------------------------------------

def throughput_plan(problems, quick: bool, with_opacus: bool, graphs: bool = False) -> list[tuple[str, int, str]]:
    """(problem, L, method) in order of importance: ours everywhere first (the cost model; with
    ``graphs`` their captured forms next to them), then Opacus, so that a run cut short by its
    time budget still has the cost model."""
    methods = OURS + (GRAPHED if graphs else [])
    ours = [(p, L, m) for p in problems for L in ([64] if quick else BATCH_SIZES[p]) for m in methods
            if quick or L >= 256 or m.removesuffix("+graphs") in SETUP2_METHODS]
    opacus = [(p, L, m) for p in problems for L in ([64] if quick else BATCH_SIZES[p]) for m in OPACUS
              if quick or L >= 256] if with_opacus else []
    return ours + sorted(opacus, key=lambda c: c[1])  # Opacus's largest batches (its slowest steps) last


def throughput_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"### Step throughput on {env['device']}", "",
             f"torch {env['torch']}, Opacus {env['opacus']}, TF32 off, deterministic kernels "
             f"(dpbench.training.cuda); sigma = 1, C = 1, SGD; synthetic images"
             + (f", P4: {env['lm_data']}" if env.get("lm_data") else "") + "; median of 3 timed blocks.", "",
             "| problem | L | method | ms / step | steps / s | examples / s | x non-private | x dpsgd |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    rows = result["rows"]
    ref = {(r["problem"], r["L"], r["method"]): r for r in rows if "s_per_step" in r}
    for r in rows:
        key = (r["problem"], r["L"])
        if "s_per_step" not in r:
            lines.append(f"| {r['problem']} | {r['L']} | {r['method']} | {r.get('error', 'not run')} | | | | |")
            continue
        ratios = [f"{r['s_per_step'] / ref[(*key, m)]['s_per_step']:.2f}" if (*key, m) in ref else ""
                  for m in ("sgd", "dpsgd")]
        lines.append(f"| {r['problem']} | {r['L']} | {r['method']} | {1e3 * r['s_per_step']:.2f} | "
                     f"{r['steps_per_s']:.1f} | {r['examples_per_s']:,.0f} | {ratios[0]} | {ratios[1]} |")
    if result.get("eval_s_per_example"):
        lines += ["", "Evaluation (forward only, batches of 1000): " + ", ".join(
            f"{p} {1e6 * s:.2f} µs/example" for p, s in result["eval_s_per_example"].items())]
    return "\n".join(lines) + "\n"


def cmd_throughput(args) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        cuda.configure()
    torch.manual_seed(0)
    out = Path(args.out)
    problems = args.problems.split(",")
    plan = throughput_plan(problems, args.quick, not args.no_opacus, args.cuda_graphs)
    if args.methods:
        plan = [c for c in plan if c[2] in args.methods.split(",")]
    if args.batch_sizes:
        plan = [c for c in plan if c[1] in {int(L) for L in args.batch_sizes.split(",")}]
    result = {"environment": environment(device), "rows": [], "eval_s_per_example": {}}
    data = {}
    t_start = time.perf_counter()
    for p in problems:
        n = 512 if args.quick else N_TRAIN[p]
        data[p] = synthetic_data(p, n, device)
        result["eval_s_per_example"][p] = eval_seconds_per_example(p, *data[p], device)
        if p in LM_DATA:
            result["environment"]["lm_data"] = LM_DATA[p]
    for p, L, method in plan:
        row = {"problem": p, "L": L, "method": method}
        if time.perf_counter() - t_start > args.budget_s:
            row["error"] = "not run (time budget)"
        else:
            x, y = data[p]
            try:
                step, _ = make_step(p, method, L, x.shape[0], device, steps=1000)
                row.update(time_method(step, x, y, L, device, target_s=args.target_s, warmup=2 if args.quick else 3,
                                       repeats=2 if args.quick else 3, max_block=3 if args.quick else 200))
                if isinstance(step, capture.CapturedStep):  # how its steps ran: graphs, padded, eager
                    row["capture"] = step.record()
            except torch.OutOfMemoryError:
                row["error"] = "out of GPU memory"
            except Exception as e:  # one failing method must not lose the others' numbers
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                step = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        result["rows"].append(row)
        msg = f"{1e3 * row['s_per_step']:.2f} ms/step" if "s_per_step" in row else row["error"]
        print(f"[throughput] {p} L={L} {method}: {msg}", file=sys.stderr, flush=True)
        write_json(out / "throughput.json", result)
        (out / "throughput.md").write_text(throughput_markdown(result))
    result["elapsed_s"] = time.perf_counter() - t_start
    write_json(out / "throughput.json", result)
    (out / "throughput.md").write_text(throughput_markdown(result))
    print(throughput_markdown(result))


# -- concurrency ------------------------------------------------------------------------------

def param_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def worker(args) -> None:
    """One training process: JSON commands on stdin, JSON replies on stdout.

    ``{"op": "prepare", problem, L, optimizer, n}``: build data, model and step, warm up;
    reply ready. ``{"op": "go", "start": t, "window": s, "hash_after": M}``: at time t
    (time.time), rebuild the step from the same initialisation and run the same batch
    sequence; after M steps hash the parameters; stop at t + window; reply steps and hash."""
    device = torch.device(args.device)
    torch.set_num_threads(1)
    if device.type == "cuda":
        cuda.configure()
    state = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "prepare":
            p, L = cmd["problem"], cmd["L"]
            if state.get("data_key") != (p, cmd["n"]):
                state["data"] = synthetic_data(p, cmd["n"], device)
                state["data_key"] = (p, cmd["n"])
            state["cmd"] = cmd
            x, y = state["data"]
            step, _ = our_step(p, cmd["optimizer"], L, device, steps=10**6, n=x.shape[0])
            sampler = PoissonSampler(x.shape[0], L / x.shape[0], seed=3, device=device)
            for _ in range(3):
                idx = sampler.sample()
                step(x[idx], y[idx])
            synchronize(device)
            reply = {"ready": True}
        else:  # go
            c = state["cmd"]
            x, y = state["data"]
            step, model = our_step(c["problem"], c["optimizer"], c["L"], device, steps=10**6, n=x.shape[0])
            sampler = PoissonSampler(x.shape[0], c["L"] / x.shape[0], seed=3, device=device)
            time.sleep(max(0.0, cmd["start"] - time.time()))
            t0, steps, digest = time.perf_counter(), 0, None
            while True:
                idx = sampler.sample()
                step(x[idx], y[idx])
                steps += 1
                if steps == cmd["hash_after"]:
                    digest = param_hash(model)
                if steps >= cmd["hash_after"] and time.perf_counter() - t0 >= cmd["window"]:
                    break
            synchronize(device)
            reply = {"steps": steps, "elapsed_s": time.perf_counter() - t0, "hash": digest}
        print(json.dumps(reply), flush=True)


class Pool:
    def __init__(self, size: int, device: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
        self.procs = [subprocess.Popen([sys.executable, __file__, "worker", "--device", device],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for _ in range(size)]

    def ask(self, procs, cmd) -> list[dict]:
        for p in procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        replies = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {p.pid} exited with {p.wait()}")
            replies.append(json.loads(line))
        return replies

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write('{"op": "quit"}\n')
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def concurrency_markdown(result: dict) -> str:
    lines = [f"### Many training processes on one GPU: {result['environment']['device']}", "",
             f"K processes train the same cell (dpbench's step, synthetic data) over a common window of "
             f"{result['window_s']:g} s; aggregate = the sum of each process's steps per second. Same parameters after "
             f"{result['hash_after']} steps in every process and for every K: "
             f"{'yes' if result.get('identical') else 'NO'}.", "",
             "| problem | L | optimizer | K | aggregate steps / s | per process | gain over K = 1 | examples / s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        if "aggregate_steps_per_s" not in r:
            lines.append(f"| {r['problem']} | {r['L']} | {r['optimizer']} | {r['K']} | {r.get('error')} | | | |")
            continue
        lines.append(f"| {r['problem']} | {r['L']} | {r['optimizer']} | {r['K']} | {r['aggregate_steps_per_s']:.1f} | "
                     f"{r['aggregate_steps_per_s'] / r['K']:.1f} | {r['gain']:.2f} | "
                     f"{r['aggregate_steps_per_s'] * r['L']:,.0f} |")
    return "\n".join(lines) + "\n"


def cmd_concurrency(args) -> None:
    device = torch.device(args.device)
    out = Path(args.out)
    ks = [int(k) for k in args.ks.split(",")]
    cells = [c.split(":") for c in args.cells.split(",")]  # problem:L:optimizer
    result = {"environment": environment(device), "window_s": args.window_s, "hash_after": args.hash_after,
              "rows": []}
    t_start = time.perf_counter()
    pool = Pool(max(ks), args.device)
    hashes = set()
    try:
        for problem, L, optimizer in cells:
            L = int(L)
            n = 2000 if args.quick else N_TRAIN[problem]
            base = None
            for K in ks:
                row = {"problem": problem, "L": L, "optimizer": optimizer, "K": K}
                if time.perf_counter() - t_start > args.budget_s:
                    row["error"] = "not run (time budget)"
                else:
                    procs = pool.procs[:K]
                    pool.ask(procs, {"op": "prepare", "problem": problem, "L": L, "optimizer": optimizer, "n": n})
                    replies = pool.ask(procs, {"op": "go", "start": time.time() + 0.5, "window": args.window_s,
                                               "hash_after": args.hash_after})
                    # the common window: every process ran at least window_s; count steps per second each
                    rate = sum(r["steps"] / r["elapsed_s"] for r in replies)
                    base = base or rate
                    row.update(aggregate_steps_per_s=rate, gain=rate / base,
                               per_process_steps=[r["steps"] for r in replies],
                               hashes=sorted({r["hash"] for r in replies}))
                    hashes.add((problem, L, optimizer, tuple(row["hashes"])))
                result["rows"].append(row)
                print(f"[concurrency] {problem} L={L} {optimizer} K={K}: "
                      f"{row.get('aggregate_steps_per_s', row.get('error'))}", file=sys.stderr, flush=True)
                write_json(out / "concurrency.json", result)
                (out / "concurrency.md").write_text(concurrency_markdown(result))
    finally:
        pool.close()
    per_cell: dict = {}
    for problem, L, optimizer, hs in hashes:
        per_cell.setdefault((problem, L, optimizer), set()).update(hs)
    result["identical"] = all(len(hs) == 1 for hs in per_cell.values())
    result["elapsed_s"] = time.perf_counter() - t_start
    write_json(out / "concurrency.json", result)
    (out / "concurrency.md").write_text(concurrency_markdown(result))
    print(concurrency_markdown(result))


# -- determinism ------------------------------------------------------------------------------

def cmd_determinism(args) -> None:
    """dpsgd steps/s under three numerics, interleaved A B C A B C ... to share any drift."""
    device = torch.device(args.device)
    out = Path(args.out)
    variants = {"deterministic, no TF32 (default)": dict(deterministic=True, tf32=False),
                "non-deterministic, no TF32": dict(deterministic=False, tf32=False),
                "deterministic, TF32": dict(deterministic=True, tf32=True)}
    result = {"environment": environment(device), "rows": []}
    for cell in args.cells.split(","):
        problem, L, optimizer = cell.split(":")
        L = int(L)
        x, y = synthetic_data(problem, 2000 if args.quick else N_TRAIN[problem], device)
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, kw in variants.items():
                if device.type == "cuda":
                    cuda.configure(**kw)
                step, _ = our_step(problem, optimizer, L, device, steps=10**6, n=x.shape[0])
                times[name].append(time_method(step, x, y, L, device, target_s=args.target_s)["s_per_step"])
        if device.type == "cuda":
            cuda.configure()
        for name in variants:
            s = statistics.median(times[name])
            result["rows"].append({"problem": problem, "L": L, "optimizer": optimizer, "numerics": name,
                                   "s_per_step": s, "all_s": times[name]})
        write_json(out / "determinism.json", result)
    lines = [f"### Cost of the GPU numerics on {result['environment']['device']}", "",
             "| problem | L | optimizer | numerics | ms / step | x default |", "| --- | ---: | --- | --- | ---: | ---: |"]
    default = {(r["problem"], r["L"]): r["s_per_step"] for r in result["rows"] if "default" in r["numerics"]}
    for r in result["rows"]:
        lines.append(f"| {r['problem']} | {r['L']} | {r['optimizer']} | {r['numerics']} | {1e3 * r['s_per_step']:.2f} | "
                     f"{r['s_per_step'] / default[(r['problem'], r['L'])]:.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "determinism.md").write_text(text)
    print(text)


# -- the cost model ---------------------------------------------------------------------------

# which measured method stands for each optimizer's step cost
COST_CLASS = {"sgd": "sgd", "adam": "sgd", "dpsgd": "dpsgd", "d2psgd": "dpsgd", "dpadam": "dpadambc",
              "dpadambc": "dpadambc", "dpadamw": "dpadambc", "dpadamw-bc": "dpadambc", "dpdice": "dpdice",
              "dpdisk": "dpdisk", "dpmatrix": "dpmatrix-se"}


def cmd_costs(args) -> None:
    """gpu_costs.json for dpbench.pipeline.cluster from throughput.json, concurrency JSON files and the
    start-up seconds of scripts/gpu/identical_runs.py (or --startup-s)."""
    out = Path(args.out)
    tp = json.loads(Path(args.throughput or out / "throughput.json").read_text())
    startup = args.startup_s
    if args.identical and Path(args.identical).exists():
        startup = json.loads(Path(args.identical).read_text())["startup_s"]
    costs = {"device": tp["environment"]["device"], "torch": tp["environment"]["torch"],
             "measured_by": "benchmarks/bench_gpu.py throughput / concurrency, scripts/gpu/identical_runs.py "
                            "(scripts/gpu/run.sh part1, part2)",
             "step_seconds": {}, "eval_seconds_per_example": tp["eval_s_per_example"],
             "startup_seconds": startup, "concurrency_gain": {}}
    for r in tp["rows"]:
        if "s_per_step" in r and not r["method"].startswith("opacus"):
            costs["step_seconds"].setdefault(r["problem"], {}).setdefault(r["method"], {})[str(r["L"])] = r["s_per_step"]
    # The gain of K processes is their measured aggregate steps/s over ONE process's steady-state
    # steps/s, the throughput run's (the rate step_seconds holds), not over the concurrency
    # run's own K = 1: that one times a short window right after 3 warm-up steps (Poisson batch
    # sizes not seen before keep arriving; the throughput run first runs every timed batch once)
    # and ran at 36-78 % of the throughput run's rate on an H100 (docs/gpu.md), so its gain,
    # applied to the steady step time, would credit K processes with that difference too.
    # K = 1 is 1 by definition; a cell the throughput run lacks keeps the window's own gain.
    steady = {(r["problem"], r["L"], r["method"]): r["steps_per_s"] for r in tp["rows"] if "steps_per_s" in r}
    for path in args.concurrency or [out / "concurrency.json"]:
        if Path(path).exists():
            for r in json.loads(Path(path).read_text())["rows"]:
                if "gain" in r:
                    one = steady.get((r["problem"], r["L"], r["optimizer"]))
                    gain = 1.0 if r["K"] == 1 else r["aggregate_steps_per_s"] / one if one else r["gain"]
                    by_l = costs["concurrency_gain"].setdefault(r["problem"], {})
                    by_l.setdefault(str(r["L"]), {})[str(r["K"])] = gain
    costs["concurrency_gain_over"] = "one process's steady-state steps/s (throughput run)"
    write_json(Path(args.costs_file or out / "gpu_costs.json"), costs)
    print(json.dumps(costs, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("throughput", "concurrency", "determinism", "costs", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        s.add_argument("--out", default="bench-gpu")
        s.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of the code (CPU)")
        s.add_argument("--budget-s", type=float, default=200.0, help="start nothing new after this many seconds")
        s.add_argument("--target-s", type=float, default=1.0, help="timed seconds per configuration")
        if name == "throughput":
            s.add_argument("--problems", default="P1,P2,P3")
            s.add_argument("--no-opacus", action="store_true")
            s.add_argument("--cuda-graphs", action="store_true",
                           help="also time sgd, dpsgd, dpmatrix-se captured as CUDA graphs (training.capture)")
            s.add_argument("--methods", help="only these methods, e.g. dpsgd,dpsgd+graphs")
            s.add_argument("--batch-sizes", help="only these L, e.g. 64,256")
        if name == "concurrency":
            s.add_argument("--ks", default="1,2,4,8,16")
            s.add_argument("--cells", default="P2:256:dpsgd,P1:256:dpsgd", help="problem:L:optimizer,...")
            s.add_argument("--window-s", type=float, default=5.0)
            s.add_argument("--hash-after", type=int, default=20)
        if name == "determinism":
            s.add_argument("--cells", default="P2:256:dpsgd,P1:1024:dpsgd")
            s.add_argument("--rounds", type=int, default=3)
        if name == "costs":
            s.add_argument("--throughput", help="throughput.json (default: OUT/throughput.json)")
            s.add_argument("--concurrency", nargs="*", help="concurrency JSON files (default: OUT/concurrency.json)")
            s.add_argument("--identical", help="identical.json of scripts/gpu/identical_runs.py (start-up seconds)")
            s.add_argument("--startup-s", type=float, help="start-up seconds of one training job, if not --identical")
            s.add_argument("--costs-file", help="where to write (default: OUT/gpu_costs.json)")
    args = parser.parse_args()
    {"throughput": cmd_throughput, "concurrency": cmd_concurrency, "determinism": cmd_determinism,
     "costs": cmd_costs, "worker": worker}[args.command](args)


if __name__ == "__main__":
    main()
