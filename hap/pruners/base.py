"""The pruner interface: what a method needs captured, where it cuts, how it selects, how positions continue.

Every method is one `Pruner` subclass in its own module of `hap.pruners`, run by one executor (`hap.pruner.PruneState`
with the adapters' hooks, `hap.patch.decoder`): the executor plans the cuts (`plan`), captures what the pruner
asks for (`needs_maps`, `needs_cls`), scores the captured layers the pruner names (`scoring_layers`) and at each cut
asks it to `select` the kept visual tokens, then continues positions as the pruner says (`renumber`). The shared
scoring helpers (head weights, sink ranking, the fused scores of a cut) are here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..fusion import fuse, fusion_weights, row_mean, select_top, token_scores

if TYPE_CHECKING:
    from ..budget import Schedule
    from ..config import HAPConfig
    from ..pruner import PruneState


@dataclass
class Cut:
    """What the executor hands a pruner at one cut: its index in the schedule, the count its budget plans (before
    the rule's own count, `Pruner.realised`) and what was captured for it.

    attn [batch, layers, heads, P, visual] and weights [batch, layers, heads] (`Pruner.head_weights`) of the scoring
    layers, sink bool [batch, visual] the tokens any of them flagged as sinks (None where no layer scores); embeds
    [batch, visual, D] the visual rows of the hidden states entering the cut (None unless the pruner or a merge asks
    for them); keys [batch, T, kv_heads * head_dim] the previous layer's keys after its k projection, key norm and
    RoPE, and normed [batch, T, D] its output through the decoder's final norm (`Pruner.layer_states`, else None)."""

    index: int
    budget: int = 0
    attn: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    whole_embeds: torch.Tensor | None = None  # [batch, R, D] the image's tokens beyond the visual ones (`whole_tokens`)


@dataclass
class Selection:
    """What a cut keeps: `chosen` long [batch, k] indexes the visual tokens present before it; `scores` [batch, n_cur]
    the scores it ranked by (recycling clusters by them), None where it ranked none. A pruner that builds its own
    tokens (VisionZip's block) gives them as `tokens` [batch, k, D], written into the k kept slots, and `patches`
    long [batch, k'] the original patch each of the last k' slots stands for (the first k - k' slots are no patch:
    VisionZip's [CLS]) ."""

    chosen: torch.Tensor
    scores: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    patches: torch.Tensor | None = None
    whole: torch.Tensor | None = None  # bool [batch, R] which of `Cut.whole_embeds`' tokens stay (None: all)


@dataclass(frozen=True)
class Pruner:
    """One pruning method. Fields: how it scores its cuts (from `HAPConfig` by `from_config`); class attributes:
    what it needs captured, where it cuts and how positions continue after a cut."""

    groups: int  # cuts the schedule plans after the first full layers (0: no pruning)
    rows: str = "last"  # prompt rows scoring a cut: "prompt", "last", "question" or "raters" (SparseVLM's)
    whole_segment: bool = False  # score with every layer of the previous segment, else only its last layer
    temperature: float = math.inf  # T of softmax(PAQ / T) over heads; inf = plain head averaging
    merge: str = "none"  # dropped tokens folded into the kept ones (HAP's knob, docs/method.md §10)
    first_cut: str = "attention"  # a cut before layer 0 scored by layer 0's attention, its pre-RoPE q.k, or [CLS]

    name: ClassVar[str] = ""
    fixed_rows: ClassVar[str | None] = None  # the prompt rows it always scores with (None: the `rows` knob)
    # what it needs captured
    maps: ClassVar[bool] = True  # decoder attention maps of the scoring layers
    cls_cues: ClassVar[bool] = False  # the vision tower's [CLS] cues (`hap.pruners.visionzip.VisionCues`)
    clip: ClassVar[bool] = False  # CLIP's projections of those cues and of the raw question (`clip_model`, CDPruner)
    crops: ClassVar[bool] = False  # those cues per crop where the tower encodes the image's crops apart (LLaVA-NeXT's
    #                                base view and tiles, `VisionCues.places`): one selection per crop
    embeds: ClassVar[bool] = False  # the visual rows of the hidden states entering the cut (`Cut.embeds`)
    layer_states: ClassVar[bool] = False  # the previous layer's keys and final-normed output (`Cut.keys`, DART)
    views: ClassVar[bool] = False  # the (rows, cols) of each view's token grid, from the adapter (`PruneState.grids`)
    whole_tokens: ClassVar[bool] = False  # the image's tokens beyond the visual ones too (`Cut.whole_embeds`: the
    #                                       newlines of LLaVA-NeXT, which other pruners always keep), may drop them
    # where it cuts
    fixed_cuts: ClassVar[int | None] = None  # how many cuts it always makes (None: the `groups` knob)
    lookahead: ClassVar[bool] = False  # score every cut with the next layer's attention on the tokens about to enter it
    before_decoder: ClassVar[bool] = False  # one cut before layer 0, whatever first_layers says
    min_full_layers: ClassVar[int] = 0  # the fewest layers before its first cut (first_layers is raised to it)
    min_tokens: ClassVar[int] = 1  # the fewest visual tokens a cut may keep
    official: ClassVar[bool] = False  # its official code's schedule, solved on its budget T (`official_schedule`)
    # how it selects
    writes_tokens: ClassVar[bool] = False  # the kept slots carry tokens it builds (`Selection.tokens`)
    recycle: ClassVar[bool] = False  # the dropped tokens' cluster means join the kept ones (`hap.recycle`)
    # how positions continue
    renumber: ClassVar[bool] = False  # positions 0..T'-1 after each cut (their official code), else original

    @classmethod
    def from_config(cls, config: HAPConfig) -> Pruner:
        """The pruner `config` asks for (its method's scoring knobs)."""
        return cls(config.groups if cls.fixed_cuts is None else cls.fixed_cuts, cls.fixed_rows or config.rows)

    @property
    def needs_maps(self) -> bool:
        """Whether the cuts are scored by decoder attention maps."""
        return self.maps

    @property
    def needs_cls(self) -> bool:
        """Whether a cut uses the vision tower's [CLS] cues."""
        return self.cls_cues

    @classmethod
    def official_schedule(cls, budget: int, num_visual: int, num_layers: int) -> Schedule:
        """The schedule of its official code at budget `budget` (`official` pruners only)."""
        raise NotImplementedError(f"{cls.name} has no official schedule")

    def refuses(self, family: str) -> str | None:
        """Why the pruner does not run on the models of adapter `family` (`hap.patch` module name: "llava",
        "llava_next", "qwen2_vl", ...), or None; asked before any work with the model."""
        return None

    def resizes_image(self, family: str) -> bool:
        """Whether, on the models of adapter `family`, the method shrinks the image itself before the processor rather
        than cutting tokens (downsample on dynamic resolution): `hap.run` then gives the processor the image resized
        to the budget (`hap.run.for_config`) and the decoder runs every token of it, no cut."""
        return False

    def image_size(self, height: int, width: int, budget: int, settings: tuple) -> tuple[int, int]:
        """(height, width) in pixels to resize an `height` x `width` image to, so that the processor (its adapter's
        `image_settings`, `settings`) emits about `budget` visual tokens (`resizes_image` pruners only)."""
        raise NotImplementedError(f"{self.name} does not resize the image")

    def rewrites(self, k: int, num_visual: int) -> bool:
        """Whether a cut keeping `k` of `num_visual` visual tokens hands the decoder tokens other than the model's own
        (`writes_tokens`, unless the pruner's rule gives back its inputs there)."""
        return self.writes_tokens

    def realised(self, k: int, num_visual: int, grids: tuple[tuple[int, int], ...] = ()) -> int:
        """Visual tokens a cut planned to keep `k` of `num_visual` really keeps (its rule's count; default k); `grids`:
        the (rows, cols) of each view's token grid in token order where the planner knows them (`Pruner.views`)."""
        return k

    def scoring_layers(self, segment: tuple[int, int]) -> list[int]:
        """Layers whose maps score the cut that follows `segment` = [start, end).

        A cut before layer 0 has no layer behind it; it looks ahead at layer 0's own attention over the full input
        (as PyramidDrop scores every cut with the next layer's queries and keys). A lookahead pruner (pdrop) scores
        every cut with layer `end` itself (`looks_ahead`)."""
        start, end = segment
        if not self.needs_maps:
            return []
        if self.looks_ahead(segment):
            return [end]
        return list(range(start, end)) if self.whole_segment else [end - 1]

    def looks_ahead(self, segment: tuple[int, int]) -> bool:
        """Whether the cut after `segment` = [start, end) is scored by layer `end` before it runs (on the tokens about
        to enter it), rather than by layers that ran: always for a lookahead pruner, and for a cut before layer 0."""
        return self.lookahead or segment[0] == segment[1]

    def recycles(self, cut_index: int) -> bool:
        """Whether cut `cut_index` recycles its dropped tokens."""
        return self.recycle

    def head_weights(self, paq: torch.Tensor, visual_share: torch.Tensor) -> torch.Tensor:
        """The fusion weights of the scoring heads, `paq`, `visual_share` [batch, layers, heads] -> the same shape,
        summing to 1 per sample: softmax(PAQ / T)."""
        return fusion_weights(paq, self.temperature)

    def scores(self, state: PruneState, cut: Cut) -> torch.Tensor:
        """Scores of the visual tokens present at `cut`, `[batch, visual]` (higher = keep): the fused maps' L2 norm
        over the prompt rows."""
        return token_scores(fuse(cut.attn, cut.weights), state.row_valid)

    def select(self, state: PruneState, cut: Cut) -> Selection:
        """The visual tokens `cut` keeps: the top `state.kept_count` by `scores`, the state's priority (an analysis
        hook) ranked first."""
        scores = self.scores(state, cut)
        chosen = select_top(scores.to(state.visual_pos.device), state.kept_count(cut.index), state.current_priority())
        return Selection(chosen, scores)


class BeforeDecoder(Pruner):
    """One selection before the first decoder layer from what the vision side gives (no decoder maps), the kept
    tokens renumbered 0..T'-1 as the decoder of their official code only sees the shorter sequence."""

    maps = False
    fixed_cuts = 1
    before_decoder = True
    renumber = True


class Official(Pruner):
    """SparseVLM and AutoPrune: their official schedule solved on their budget T, each cut scored by the head-mean
    attention of the layer that just ran averaged over the scoring rows `fixed_rows` (not their L2 norm), the
    dropped tokens recycled (`hap.recycle`), positions renumbered."""

    fixed_rows = "prompt"
    fixed_cuts = 1  # a placeholder: the official schedule sets the cuts
    official = True
    recycle = True
    renumber = True

    def scores(self, state, cut):
        return row_mean(fuse(cut.attn, cut.weights), state.row_valid)


def rank_sinks(scores: torch.Tensor, sink: torch.Tensor, mode: str) -> torch.Tensor:
    """Scores with the sink tokens moved in the ranking (docs/method.md §10): `scores [batch, visual]`,
    `sink` bool [batch, visual]; "keep": unchanged; "mask": sinks last; "mask_keep_one": sinks last except
    the best-scored sink of each sample, first (an anchor)."""
    if mode == "keep":
        return scores
    out = scores.masked_fill(sink, -math.inf)
    if mode == "mask_keep_one":
        best = scores.masked_fill(~sink, -math.inf).argmax(-1, keepdim=True)  # [B, 1]
        anchor = torch.zeros_like(sink).scatter_(1, best, True) & sink
        out = out.masked_fill(anchor, math.inf)
    return out
