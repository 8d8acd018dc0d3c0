"""How a step of an encoder problem is laid out, chosen once: ``StepLayout``. Performance only,
never privacy: every layout computes each record's loss and per-record gradient from that record
alone (the per-sample contract), so sampling, clipping, noise and the accounting are the same in
all of them, and the numbers the same up to floating-point order.

* ``groups``: a batch runs in groups of records of similar length (``Task.groups``), each group
  cut to its longest record, so padding costs nothing; measured to pay on the CPU
  (docs/encoders.md). Off: one padded pass over the batch (a GPU: one kernel per layer, and
  more passes would be more launches), or nothing to pad (mode ``head`` reads one vector per record).
* ``prefix``: what the frozen public prefix of the encoder is at each step. ``none``: computed
  in the forward pass, as every trained layer is; ``memory``: mode ``head``'s pooled features
  computed once per record the first time it is seen and kept in memory
  (``CachedFeatureClassifier``); ``store``: read from a prefix store file made once for every
  run that needs it (``dpbench.problems.prefix_store``: mode ``head``'s pooled features, mode
  ``last-block``'s hidden states entering the last block).

Torch-free: the workflow reads which cells want a store without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIXES = ("none", "memory", "store")
# the modes whose frozen part is a prefix of the encoder, and what a store of it holds (the cut)
STORED_MODES = ("head", "last-block")


@dataclass(frozen=True)
class StepLayout:
    """One step's layout (module docstring)."""

    groups: bool
    prefix: str = "none"
    store: str | None = None  # the prefix store file, where prefix == "store"

    def __post_init__(self):
        if self.prefix not in PREFIXES:
            raise ValueError(f"unknown prefix layout {self.prefix!r}; choose one of {PREFIXES}")
        if (self.prefix == "store") != (self.store is not None):
            raise ValueError("a prefix store file is given with prefix 'store', and only then")

    @classmethod
    def choose(cls, mode=None, device: str = "cpu", store: str | None = None) -> "StepLayout":
        """The layout of a run in ``mode`` (a ``modes.Mode``, None: from scratch) on ``device``
        (its type: cpu, cuda), reading its frozen prefix from ``store`` where one is given."""
        name = getattr(mode, "name", None)
        if store is not None and name not in STORED_MODES:
            raise ValueError(f"a prefix store serves the modes {' and '.join(STORED_MODES)}, whose frozen part is a "
                             f"prefix of the encoder; mode {name or 'none (from scratch)'} trains it")
        prefix = "store" if store is not None else ("memory" if name == "head" else "none")
        # groups shed padding on the CPU; mode head reads one pooled vector per record: nothing to pad
        return cls(groups=str(device).split(":")[0] == "cpu" and name != "head", prefix=prefix,
                   store=None if store is None else str(store))

    def record(self) -> dict:
        """What a run records of its layout."""
        return {"groups": self.groups, "prefix": self.prefix, "store": self.store}
