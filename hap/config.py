"""HAPConfig: the settings of one pruning run, with defaults and checks from the knob registry (hap/knobs.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .knobs import KNOBS, SEED, knob


@dataclass
class HAPConfig:
    """Configuration of one pruning run; each field is the knob of the same name in `hap.knobs.KNOBS`.

    Give `retain` or `flops_ratio` (not both); the other is derived from the FLOPs accounting in
    `hap.budget` once the sequence is known. Model-dependent defaults are None here and resolve when
    the decoder's depth is known (`resolved(n_layers)`, done by the planner): `first_layers` is 2 on
    decoders of 16+ layers, else 0; with neither budget given, `retain` is 0.111 on decoders of 16+
    layers, else 0.25. So `HAPConfig()` runs on every supported model, the 6-layer shipped one included.
    """

    method: str = knob("method").default  # one of METHODS; "none" runs the stock model
    retain: float | None = knob("retain").default  # visual tokens kept, averaged over ALL decoder layers, (0, 1]
    flops_ratio: float | None = knob("flops_ratio").default  # target prefill FLOPs / unpruned, (0, 1]
    first_layers: int | None = knob("first_layers").default  # K: layers [0, K) see every token
    groups: int = knob("groups").default  # G: contiguous layer groups after the first K
    decay: float = knob("decay").default  # lambda: k_{g+1} = lambda * k_g
    temperature: float = knob("temperature").default  # T of softmax(PAQ / T) over heads; inf = uniform
    tau_sink: float = knob("tau_sink").default  # sink share threshold of a sink head
    tau_disp: float = knob("tau_disp").default  # normalised entropy threshold of a dispersed head
    sink_rho: float = knob("sink_rho").default  # sink token: hidden-state norm > rho * median norm
    rows: str = knob("rows").default  # "prompt" (every text token after the image) or "last"
    seed: int = SEED.default  # seed of the `random` baseline

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field against its knob (coercing integral floats of integer knobs); raise
        ValueError naming the first invalid field and what it allows."""
        for k in (*KNOBS, SEED):
            setattr(self, k.name, k.check(getattr(self, k.name)))
        if self.retain is not None and self.flops_ratio is not None:
            raise ValueError("give either retain or flops_ratio, not both (the other is derived)")

    def resolved(self, n_layers: int) -> HAPConfig:
        """A copy with the model-dependent defaults filled in for a decoder of `n_layers` layers."""
        changes = {k.name: k.resolve(n_layers) for k in KNOBS if k.rule is not None and getattr(self, k.name) is None}
        if self.flops_ratio is not None:
            changes.pop("retain", None)
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
