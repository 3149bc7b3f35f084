"""HAP (docs/method.md §2-§6): G groups after the first K full layers, each cut scored by the prompt rows' attention
of the previous segment's layers (or its last, `score_layers`), heads fused by softmax(PAQ / T); original positions
kept. Its knobs beyond the paper (§10: `head_weight`, `sink_ranking`, `score_layers`, `merge`, `first_cut`,
`diversity`) shape this pruner only."""

from __future__ import annotations

from dataclasses import dataclass

from ..diversity import select as select_diverse
from ..scoring import importance
from ..scoring.fusion import fuse, fusion_weights, token_scores
from .base import Pruner, Selection, rank_sinks


@dataclass(frozen=True)
class Hap(Pruner):
    visual_weights: bool = False  # head weights x visual share (head_weight="paq_visual")
    static: bool = False  # head_weight="static": heads weighted by their static importance instead of PAQ
    importance: str | None = None  # that importance's file (the `head_importance` knob, resolved by `hap.patch.apply`)
    sink_ranking: str = "keep"  # sink tokens at a cut: "keep", "mask" or "mask_keep_one"
    diversity: float = 0.0  # w of relevance + w log(residual) of a conditional DPP (`hap.diversity`); 0: top-k

    name = "hap"
    cls_knob = "first_cut='vision'"  # it asks for the [CLS] cues through this knob only

    @classmethod
    def from_config(cls, config):
        return cls(config.groups, config.rows, config.score_layers == "segment", config.temperature,
                   merge=config.merge, first_cut=config.first_cut, visual_weights=config.head_weight == "paq_visual",
                   static=config.head_weight == "static", importance=config.head_importance,
                   sink_ranking=config.sink_ranking, diversity=config.diversity)

    @property
    def static_heads(self) -> bool:
        """head_weight="static" reads the static head importance file."""
        return self.groups > 0 and self.static

    @property
    def embeds(self) -> bool:
        """A diversity weight reads the hidden states entering each cut (`Cut.embeds`)."""
        return self.diversity > 0

    @property
    def needs_cls(self) -> bool:
        """first_cut="vision" scores a cut before layer 0 by the vision tower's [CLS] attention (§10)."""
        return self.groups > 0 and self.first_cut == "vision"

    def scoring_layers(self, segment):
        """As every pruner's, but a cut before layer 0 under first_cut="vision" is scored by no decoder layer."""
        if segment[0] == segment[1] and self.first_cut == "vision":
            return []
        return super().scoring_layers(segment)

    def head_weights(self, paq, visual_share, layers):
        """softmax(PAQ / T), times the visual share under head_weight="paq_visual"; under head_weight="static" the
        static importance of the scoring layers' heads instead (`hap.scoring.importance.layer_weights`)."""
        if self.static:
            return importance.static_weights(self.importance, layers, paq)
        return fusion_weights(paq, self.temperature, visual_share if self.visual_weights else None)

    def scores(self, state, cut):
        """The fused scores with the sinks ranked as `sink_ranking` says; the [CLS] attention where no layer scores."""
        if cut.attn is None:
            return state.cues().cls_attention
        return rank_sinks(token_scores(fuse(cut.attn, cut.weights), state.row_valid), cut.sink, self.sink_ranking)

    def select(self, state, cut):
        """The relevance top-k (`Pruner.select`), or with a diversity weight the greedy conditional DPP of
        `hap.diversity.select` on the hidden states entering the cut, detected sinks kept after every other token."""
        if self.diversity == 0:
            return super().select(state, cut)
        scores = self.scores(state, cut).to(state.visual_pos.device)
        sink = None if cut.sink is None else cut.sink.to(scores.device)
        chosen = select_diverse(scores, cut.embeds, state.kept_count(cut.index), self.diversity, sink,
                                state.current_priority())
        return Selection(chosen, scores)


PRUNER = Hap
