"""The plugin API (``dpbench.plugin``): one import holding every name a plugin needs, each with a
docstring stating its contract, listed in docs/plugins.md; and the contracts that used to be
silent traps: the update rule's gradients are views into a buffer the next step overwrites, and
what ``update`` returns is summed over the run's steps."""

import re
import subprocess
import sys

import pytest
import torch

import dpbench.plugin as api
from conftest import REPO

EXPORTS = [
    "OptimizerSpec", "Context", "DPStep", "NonPrivateStep", "SGD", "StepOutput", "UpdateRule",
    "PerSampleGradients", "GroupedGradients", "LayerGrads", "register_per_sample", "UnsupportedLayerError", "Clipping",
    "Mechanism", "Target", "PrivacyClaim", "Spent", "get_accountant",
    "Plan", "PlanRequest", "Sampler", "NoiseSource", "AuditSpec", "PoissonSubsampledGaussian",
    "GaussianNoise", "Problem", "ProblemFacts", "Classification", "TabularClassification", "VAE", "Dataset", "DataError", "check_problem",
    "FigureSpec", "check_figure", "select_runs", "ordered", "assemble", "get_optimizer", "get_problem",
]


def test_all_is_held_and_every_name_is_dpbenchs_own_object_with_a_docstring():
    assert api.__all__ == EXPORTS
    for name in EXPORTS:
        obj = getattr(api, name)
        module, attribute = api._SOURCES[name]
        assert obj is getattr(__import__(module, fromlist=[attribute]), attribute), name
        doc = (obj.__doc__ or "").strip()
        # a dataclass without one gets its signature as __doc__: that is no contract
        assert len(doc) > 30 and not doc.startswith(f"{getattr(obj, '__name__', name)}("), name
    with pytest.raises(AttributeError, match="has no attribute 'Nope'.*it exports: OptimizerSpec"):
        api.Nope  # noqa: B018


def test_the_docs_list_every_exported_name():
    text = (REPO / "docs" / "plugins.md").read_text()
    section = text.split("## The plugin API: `dpbench.plugin`", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\* `(\w+)`(?:, `(\w+)`)?", section, re.M)
    names = [n for pair in listed for n in pair if n]
    assert sorted(names) == sorted(EXPORTS)


def test_a_figure_plugins_import_needs_no_torch():
    code = ("import sys; from dpbench.plugin import FigureSpec, check_figure, select_runs, ordered; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO / "src")})
    assert out.stdout.strip() == "False", out.stderr


def test_the_example_plugin_imports_only_dpbench_plugin():
    found = {}
    for path in (REPO / "examples" / "plugin").rglob("*.py"):
        modules = re.findall(r"^\s*(?:from|import) (dpbench(?:\.[\w.]+)?)\s", path.read_text(), re.M)
        found[path.name] = set(modules)
    assert found["momentum.py"] == found["digits.py"] == found["test_momentum.py"] == {"dpbench.plugin"}
    assert set().union(*found.values()) == {"dpbench.plugin"}


# -- the update rule's contract -----------------------------------------------------------------

N, L = 32, 8


def _step(rule, sigma=0.5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    spec = api.get_optimizer("dpsgd")
    plan = spec.mechanism.plan(api.PlanRequest(N, L, 1))
    parts = api.assemble(spec, plan, model, lambda m, x, y: (m(x).square().sum(1), None), lr=0.1,
                         noise_multiplier=sigma, clip_norm=1.0, normalize_clipping=True, hyperparameters=None,
                         noise_seed=1, sampler_seed=2, n_train=N, device="cpu")
    parts.step.rule = rule
    return parts.step


class Keeps:
    """Keeps the grads it is handed as they are (the trap), and a copy of them (the fix)."""

    def __init__(self):
        self.kept, self.copies = [], []

    def update(self, params, grads):
        self.kept.append(grads)
        self.copies.append([g.clone() for g in grads])
        return {"steps": 1.0, "first": float(len(self.copies) == 1), "grad_sq": sum(float(g.square().sum())
                                                                                      for g in grads)}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_rule_that_keeps_the_grads_sees_them_overwritten_by_the_next_step():
    """The grads of step 1, kept without a copy, hold step 2's gradient after step 2: they are
    views into the step's reused buffer (UpdateRule's contract). Copies keep step 1's."""
    rule = Keeps()
    step = _step(rule)
    x = torch.randn(3, L, 4, generator=torch.Generator().manual_seed(5))
    step(x[0], None)
    step(x[1], None)
    first, second = rule.kept
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, second))  # the same memory
    assert all(torch.equal(a, c) for a, c in zip(first, rule.copies[1]))  # step 1's now reads step 2's
    assert not all(torch.equal(c1, c2) for c1, c2 in zip(rule.copies[0], rule.copies[1]))


def test_what_update_returns_is_summed_over_the_steps_of_a_run():
    """``StepOutput.stats`` from the rule, summed by the training loop's trace (the run records
    ``optimizer.stats``): a per-step count becomes the number of steps, a 0/1 flag the number
    of steps it was 1, a per-step value the total."""
    from dpbench.training.checkpoint import Trace

    rule = Keeps()
    step = _step(rule)
    trace = Trace.empty(4, "cpu")
    x = torch.randn(4, L, 4, generator=torch.Generator().manual_seed(6))
    for t in range(4):
        out = step(x[t], None)
        assert out.stats["steps"] == 1.0
        trace.record(L, out)
    assert trace.stats["steps"] == 4.0 and trace.stats["first"] == 1.0
    assert trace.stats["grad_sq"] == pytest.approx(sum(sum(float(g.square().sum()) for g in c) for c in rule.copies))


# -- which stages are the optimizer's own (dpbench.optimizers.stages) ----------------------------

def test_own_stages_are_read_from_the_step_class_without_building_it():
    """The class ``build`` makes is found before its ``__init__`` runs (no model taped, no noise
    file, no Opacus imported); its stages are compared with DPStep's methods, by the module of
    the class that defines each."""
    import dataclasses

    from dpbench.optimizers import OPTIMIZERS
    from dpbench.optimizers.stages import describe, own_stages, spec_stages, step_class

    class Refuses(api.DPStep):  # a plugin's class: defined here, not in dpbench
        def __init__(self, ctx, rule):
            raise AssertionError("never initialised by the probe")

        def clip_and_sum(self, psg):
            return super().clip_and_sum(psg)

    class Later(Refuses):  # inherits the plugin's stage, adds its own noise scale
        @property
        def noise_std(self):
            return 2 * super().noise_std

    dpsgd = OPTIMIZERS["dpsgd"]
    assert step_class(dpsgd) is api.DPStep and spec_stages(dpsgd) == {} and spec_stages(OPTIMIZERS["sgd"]) is None
    assert spec_stages(OPTIMIZERS["dpdisk"]) == {"per_sample_gradients": "built-in"}
    assert spec_stages(OPTIMIZERS["opacus-dpsgd"]) == {"__call__": "built-in", "per_sample_gradients": "built-in",
                                                       "clip_and_sum": "built-in"}
    plugin = dataclasses.replace(dpsgd, name="mine", build=lambda ctx: Later(ctx, api.SGD(ctx.lr)))
    assert step_class(plugin) is Later
    assert describe(own_stages(Later)) == "clip_and_sum (plugin), noise_std (plugin)"
    assert describe({}) == "none"
    broken = dataclasses.replace(dpsgd, name="broken", build=lambda ctx: ctx.nope)
    with pytest.raises(ValueError, match=r"optimizer 'broken': its build failed before it made its step "
                                         r"\(AttributeError"):
        step_class(broken)
    not_a_step = dataclasses.replace(dpsgd, name="odd", build=lambda ctx: Keeps())
    assert own_stages(step_class(not_a_step)) == {"__call__": "plugin"}
    assert step_class(dpsgd) is api.DPStep  # the probe is off again: steps are built as ever
    assert type(dpsgd.build(_step(Keeps()).ctx)) is api.DPStep
