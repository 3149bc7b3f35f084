"""HAPConfig: the settings of one pruning run, with defaults and checks from the knob registry (hap/knobs.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .knobs import KNOBS, SEED, knob


@dataclass
class HAPConfig:
    """Configuration of one pruning run; each field is the knob of the same name in `hap.knobs.KNOBS`.

    Give `retain` or `flops_ratio` (not both); the other is derived from the FLOPs accounting in
    `hap.planning.budget` once the sequence is known. Model-dependent defaults are None here and resolve when
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
    rows: str = knob("rows").default  # "prompt" (every text token after the image), "last" or "question"
    head_weight: str = knob("head_weight").default  # "paq" (paper), "paq_visual" (x visual share) or "static"
    sink_ranking: str = knob("sink_ranking").default  # "keep" (paper), "mask" or "mask_keep_one"
    sink_detector: str = knob("sink_detector").default  # "norm" (paper), "consensus" or "both"
    consensus_share: float = knob("consensus_share").default  # consensus sink: share of a head's visual attention
    consensus_quorum: float = knob("consensus_quorum").default  # consensus sink: fraction of the layer's heads
    consensus_tokens: int = knob("consensus_tokens").default  # consensus sink: most tokens of a head's parked set
    score_layers: str = knob("score_layers").default  # "segment" (paper) or "last" (the segment's last layer)
    merge: str = knob("merge").default  # "none" (paper) or "proportional" (dropped tokens folded into kept ones)
    first_cut: str = knob("first_cut").default  # "attention" (paper) or "prerope"
    diversity: float = knob("diversity").default  # w: relevance + w log(residual), a conditional DPP; 0 = paper
    head_importance: str | None = knob("head_importance").default  # static head importance file (None: the model's)
    clip_model: str = knob("clip_model").default  # cdpruner's CLIP checkpoint (hub id or local folder)
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

    @classmethod
    def paper(cls, **overrides) -> HAPConfig:
        """HAP exactly as docs/method.md formulates the paper: every knob with a paper value (`Knob.paper`) at
        it, the others (budget, schedule) at their defaults; `overrides` win (e.g. retain, first_layers)."""
        return cls(**{**{k.name: k.paper for k in KNOBS if k.paper is not None}, **overrides})

    def resolved(self, n_layers: int) -> HAPConfig:
        """A copy with the model-dependent defaults filled in for a decoder of `n_layers` layers."""
        changes = {k.name: k.resolve(n_layers) for k in KNOBS if k.rule is not None and getattr(self, k.name) is None}
        if self.flops_ratio is not None:
            changes.pop("retain", None)
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
