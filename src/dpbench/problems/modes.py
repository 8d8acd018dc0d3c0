"""Fine-tuning modes, one registered object per idea, and a run's ``Start``, without torch.

A mode says which parameters of a public start it trains (``trains``: a predicate over the
parameter names of the model's ``Architecture``, ``dpbench.problems.architectures``), what it
adds (LoRA's adapters), how many that is (``trainable_parameters``: d, the width of a matrix
mechanism's noise rows, so the grid sizes noise files by it) and how it is applied to a built
model (``apply``: every parameter it does not train frozen, ``requires_grad`` False, so the
per-sample engine, Opacus and every update rule see only the trained ones). The count and the
surgery read the same predicate over the same table; the tests hold the table to the model.

* ``full``: every parameter (the pretrained ones, word embeddings included, as in the full
  fine-tuning of Li et al. 2022, and the head).
* ``last-block``: the last block, what follows it (a final LayerNorm) and the head (DP-AdamW,
  Chooi et al.: BERT's last block, pooler and head).
* ``lora``: low-rank adapters (Hu et al. 2021; DP-LoRA of Yu et al. 2022) on every block's
  attention projections and both MLP Linear layers: W x + (alpha / r) B A x, A (r x d_in), B
  (d_out x r) zero at the start, the pretrained weights frozen. ``LORA_ALPHA`` = 16, a constant
  in r (Hu et al. set alpha to the first r they tried and do not tune it: with Adam, tuning
  alpha is tuning the learning rate), so alpha / r is 1 at the default rank 16 (DiSK's DP-LoRA
  rank). A new classification head trains whole (nothing pretrained to keep); a language
  model's pretrained head stays frozen, as in LoRA for generation.
* ``bias``: every bias (the Linear layers' and the LayerNorms' beta) and a new head whole
  (BiTFiT, Ben Zaken et al. 2022; DP-BiTFiT, Bu et al. 2022); a language model's head its bias.
* ``head``: the head alone, the rest frozen: on a classifier, a DP linear probe of the frozen
  public features (Tramèr & Boneh 2021).

``MODES`` is the registry (``register_mode`` adds one: a new mode is one class and its tests).
``parse(name, lora_rank=...)`` makes a mode from its settings (the command line's ``--finetune``
and ``--lora-rank``, a config's ``finetune`` and ``lora_ranks``): a mode's own options are
spelled by ``settings`` and read back by ``parse`` only here. ``Start`` is where a run of a
problem with a public start begins: a mode of the public start, or its twin from random
initialisation (``SCRATCH``); its id part, label and record are derived from it, never parsed
back from a string. Refusals are one line naming the setting: an unknown mode, a LoRA rank
below 1 or above the narrowest adapted layer's width (``check``, against the model's table), an
option given to a mode that takes none.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dpbench.problems.architectures import Architecture

if TYPE_CHECKING:
    from torch import nn

LORA_ALPHA = 16  # alpha of the scale alpha / r (module docstring)
DEFAULT_LORA_RANK = 16
SCRATCH = "scratch"  # the start of the twin trained from random initialisation

MODES: dict[str, type["Mode"]] = {}


def register_mode(cls: type["Mode"]) -> type["Mode"]:
    """Adds a mode class to ``MODES`` under its ``name`` (once)."""
    if cls.name in MODES or cls.name == SCRATCH:
        raise ValueError(f"fine-tuning mode {cls.name!r} is already registered")
    MODES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Mode:
    """The base of a fine-tuning mode (module docstring). Subclasses set ``name`` and
    ``trains``; a mode with options declares them as dataclass fields and maps each to its run
    setting in ``options`` ({field: setting name})."""

    name: ClassVar[str]
    title: ClassVar[str]  # its name in figures and tables
    colour: ClassVar[str] = "#999999"  # its bars' colour in figures (the built-in modes: a colour-blind-safe palette)
    options: ClassVar[dict[str, str]] = {}

    def trains(self, arch: Architecture, name: str) -> bool:
        """Whether the pretrained (or new-head) parameter ``name`` of ``arch`` trains."""
        raise NotImplementedError

    def check(self, arch: Architecture) -> None:
        """Refuses (ValueError) a mode that does not fit the model."""

    def added(self, arch: Architecture) -> int:
        """The parameters the mode adds to the model (all trained)."""
        return 0

    def trainable_parameters(self, arch: Architecture) -> int:
        """d under this mode: the selected parameters of ``arch`` and the added ones."""
        self.check(arch)
        return sum(size for name, size in arch.parameters if self.trains(arch, name)) + self.added(arch)

    def apply(self, model: "nn.Module", arch: Architecture) -> "nn.Module":
        """``model`` (whose parameters are ``arch``'s) with this mode's parameters trainable, the
        others frozen (``dpbench.problems.surgery.freeze``)."""
        from dpbench.problems.surgery import freeze

        self.check(arch)
        return freeze(model, arch, lambda name: self.trains(arch, name))

    @property
    def label(self) -> str:
        """The mode as tables and figures show it: ``full``, ``lora-r16``."""
        return self.name

    @property
    def caption(self) -> str:
        """The mode with its options as figures name it: ``LoRA (r = 16)``."""
        return self.title

    @property
    def id_part(self) -> str:
        """Its part of a cell id: ``-ftfull``, ``-ftlora16``."""
        return f"-ft{self.name}"

    def settings(self) -> dict[str, Any]:
        """The run settings that give this mode (``RunConfig``'s ``finetune`` and its options')."""
        return {"finetune": self.name, **{setting: getattr(self, f) for f, setting in self.options.items()}}

    def record(self) -> dict[str, Any]:
        return {"mode": self.name, "lora_rank": None, "lora_alpha": None}


@register_mode
@dataclass(frozen=True)
class Full(Mode):
    name: ClassVar[str] = "full"
    colour: ClassVar[str] = "#4477aa"
    title: ClassVar[str] = "full"

    def trains(self, arch, name):
        return True


@register_mode
@dataclass(frozen=True)
class LastBlock(Mode):
    name: ClassVar[str] = "last-block"
    colour: ClassVar[str] = "#228833"
    title: ClassVar[str] = "last block"

    def trains(self, arch, name):
        return arch.in_last_block(name)


@register_mode
@dataclass(frozen=True)
class LoRA(Mode):
    """``rank``: r of the adapters (``DEFAULT_LORA_RANK`` unless given)."""

    name: ClassVar[str] = "lora"
    colour: ClassVar[str] = "#ee6677"
    title: ClassVar[str] = "LoRA"
    options: ClassVar[dict[str, str]] = {"rank": "lora_rank"}
    rank: int = DEFAULT_LORA_RANK

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"finetune lora_rank must be an integer >= 1, got {self.rank!r}")

    @property
    def alpha(self) -> int:
        return LORA_ALPHA

    @property
    def scale(self) -> float:
        return LORA_ALPHA / self.rank

    def trains(self, arch, name):
        return arch.new_head and arch.in_head(name)

    def check(self, arch):
        layer, d_in, d_out = arch.narrowest_adapted()
        if self.rank > min(d_in, d_out):
            raise ValueError(f"finetune lora_rank={self.rank} exceeds the width {min(d_in, d_out)} of layer "
                             f"{arch.blocks[0].replace('0', '*', 1) if arch.blocks else ''}{layer} "
                             f"({d_in} -> {d_out}) of the public start's model")

    def added(self, arch):
        return len(arch.blocks) * sum(self.rank * (d_in + d_out) for _, d_in, d_out in arch.adapted)

    def apply(self, model, arch):
        from dpbench.problems.surgery import add_adapters

        return add_adapters(super().apply(model, arch), arch, self.rank, self.scale)

    @property
    def label(self):
        return f"lora-r{self.rank}"

    @property
    def caption(self):
        return f"LoRA (r = {self.rank})"

    @property
    def id_part(self):
        return f"-ftlora{self.rank}"

    def record(self):
        return {"mode": self.name, "lora_rank": self.rank, "lora_alpha": self.alpha}


@register_mode
@dataclass(frozen=True)
class Bias(Mode):
    name: ClassVar[str] = "bias"
    colour: ClassVar[str] = "#ccbb44"
    title: ClassVar[str] = "bias (BiTFiT)"

    def trains(self, arch, name):
        return name.endswith(".bias") or (arch.new_head and arch.in_head(name))


@register_mode
@dataclass(frozen=True)
class Head(Mode):
    name: ClassVar[str] = "head"
    colour: ClassVar[str] = "#aa3377"
    title: ClassVar[str] = "head (linear probe)"

    def trains(self, arch, name):
        return arch.in_head(name)


def parse(name: str, **settings: Any) -> Mode:
    """The mode named ``name`` with its options from ``settings`` (run settings such as
    ``lora_rank``; None: not given, the mode's default). ValueError naming the setting: an
    unknown mode, an option the mode does not take, a bad value."""
    if name not in MODES:
        raise ValueError(f"finetune mode {name!r} is unknown; choose one of {', '.join(MODES)}")
    cls = MODES[name]
    given = {s: v for s, v in settings.items() if v is not None}
    by_setting = {setting: f for f, setting in cls.options.items()}
    for setting, value in given.items():
        if setting not in by_setting:
            owners = [m for m, c in MODES.items() if setting in c.options.values()]
            raise ValueError(f"finetune {setting}={value!r} is given with mode {name!r}; it belongs to mode "
                             f"{' or '.join(repr(o) for o in owners) or 'none'} only")
    return cls(**{by_setting[s]: v for s, v in given.items()})


def option_settings() -> tuple[str, ...]:
    """Every run setting a registered mode reads (``lora_rank``)."""
    return tuple(dict.fromkeys(s for cls in MODES.values() for s in cls.options.values()))


@dataclass(frozen=True)
class Start:
    """Where a run of a problem with a public start begins: ``mode`` of the public start, or
    None for its twin from random initialisation (``SCRATCH``)."""

    mode: Mode | None = None

    @property
    def public(self) -> bool:
        return self.mode is not None

    @property
    def label(self) -> str:
        """``full``, ``lora-r16``, ``scratch``: the runs table's ``finetune`` column and the figures'."""
        return SCRATCH if self.mode is None else self.mode.label

    @property
    def id_part(self) -> str:
        return "-ftscratch" if self.mode is None else self.mode.id_part

    @property
    def caption(self) -> str:
        """Its name in figures: ``from scratch``, ``LoRA (r = 16)``."""
        return "from scratch" if self.mode is None else self.mode.caption

    @property
    def sort_key(self) -> tuple:
        """Tables' and figures' order: from scratch first, then the modes in registry order, each
        by its options' values."""
        if self.mode is None:
            return (0, 0, ())
        options = tuple(getattr(self.mode, f) for f in self.mode.options)
        return (1, list(MODES).index(self.mode.name) if self.mode.name in MODES else len(MODES), options)

    def settings(self) -> dict[str, Any]:
        """The run settings of this start (none for the twin from scratch)."""
        blank = {"finetune": None, **{s: None for s in option_settings()}}
        return blank if self.mode is None else {**blank, **self.mode.settings()}


def start_of(finetune: str, **options: Any) -> Start:
    """The start a run recorded (the runs table's ``finetune`` column, ``SCRATCH`` for the twin,
    and its options' columns, e.g. ``lora_rank``)."""
    return Start() if finetune == SCRATCH else Start(parse(finetune, **options))


def starts(names: list[str], options: dict[str, list] | None = None) -> list[Start]:
    """The starts of a config's ``finetune`` list: each mode once per combination of its
    options' values (``options``: setting -> values, e.g. lora_rank -> [4, 16]; a mode's
    default where none are given), ``scratch`` as the twin."""
    out = []
    for name in names:
        if name == SCRATCH:
            out.append(Start())
            continue
        cls = MODES.get(name)
        taken = [s for s in (cls.options.values() if cls else ()) if (options or {}).get(s) is not None]
        if not taken:
            out.append(Start(parse(name)))
            continue
        for values in itertools.product(*(options[s] for s in taken)):
            out.append(Start(parse(name, **dict(zip(taken, values)))))
    return out


__all__ = ["Mode", "MODES", "register_mode", "parse", "Start", "start_of", "starts", "SCRATCH", "LORA_ALPHA",
           "DEFAULT_LORA_RANK", "Full", "LastBlock", "LoRA", "Bias", "Head"]
