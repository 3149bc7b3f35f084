"""HAPConfig: every knob of the pruner, its default and the reason for it (DESIGN.md sections 2-5)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

METHODS = ("hap", "uniform", "fastv", "pdrop", "random", "none")
ROWS = ("prompt", "last")
DEFAULT_RETAIN = 0.222  # the 128-of-576 budget, when neither retain nor flops_ratio is given


@dataclass
class HAPConfig:
    """Configuration of one pruning run.

    Give `retain` or `flops_ratio` (not both); the other is derived from the FLOPs accounting in
    `hap.budget` once the sequence is known. Neither given means `retain=0.222`.
    """

    method: str = "hap"  # one of METHODS; "none" runs the stock model
    retain: float | None = None  # visual tokens kept, averaged over ALL decoder layers, as a fraction (0, 1]
    flops_ratio: float | None = None  # target prefill FLOPs / unpruned prefill FLOPs, (0, 1]
    first_layers: int = 2  # K: layers [0, K) see every token (FastV's K=2); 0 cuts before the first layer
    groups: int = 3  # G: contiguous layer groups after the first K, each with its own budget
    decay: float = 0.5  # lambda: k_{g+1} = lambda * k_g, so later (more abstract) layers keep fewer tokens
    temperature: float = 0.1  # T of softmax(PAQ / T) over heads; inf = uniform averaging (the ablation)
    tau_sink: float = 0.5  # a head with sink share >= tau_sink is a sink head
    tau_disp: float = 0.9  # a non-sink head with normalised entropy >= tau_disp is dispersed
    sink_rho: float = 10.0  # a visual token is a sink when its hidden-state norm > rho * median norm
    rows: str = "prompt"  # prompt rows scoring tokens: every text token after the image, or the last one
    seed: int = 0  # seed of the `random` baseline

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and its allowed range."""
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not allowed; choose one of {', '.join(METHODS)}")
        if self.rows not in ROWS:
            raise ValueError(f"rows={self.rows!r} is not allowed; choose 'prompt' or 'last'")
        if self.retain is not None and self.flops_ratio is not None:
            raise ValueError("give either retain or flops_ratio, not both (the other is derived)")
        for name in ("retain", "flops_ratio"):
            value = getattr(self, name)
            if value is not None:
                _check_real(name, value, low=0.0, high=1.0, low_open=True)
        for name, low in (("first_layers", 0), ("groups", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        _check_real("decay", self.decay, low=0.0, high=1.0, low_open=True)
        if not _is_real(self.temperature) or not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number > 0 (inf = uniform averaging)")
        _check_real("tau_sink", self.tau_sink, low=0.0, high=1.0)
        _check_real("tau_disp", self.tau_disp, low=0.0, high=1.0)
        _check_real("sink_rho", self.sink_rho, low=1.0, high=math.inf)

    @property
    def target_retain(self) -> float | None:
        """The retain target, with the default applied when no budget was given."""
        if self.retain is None and self.flops_ratio is None:
            return DEFAULT_RETAIN
        return self.retain

    def to_dict(self) -> dict:
        return asdict(self)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _check_real(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> None:
    ok = _is_real(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}={value!r} must be a number in {bracket}{low:g}, {high:g}]")
