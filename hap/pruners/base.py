"""The pruner interface: what a method needs captured, where it cuts, how it selects, how positions continue.

Every method is one `Pruner` subclass in its own module of `hap.pruners` (or outside the package, registered with
`hap.pruners.register`), run by one executor (`hap.patch.state.PruneState` with the adapters' hooks,
`hap.patch.decoder`): the executor plans the cuts (`plan`), captures what the pruner asks for (`needs_maps`,
`needs_cls`, `embeds`, `layer_states`, ...), scores the captured layers the pruner names (`scoring_layers`) and at each
cut asks it to `select` the kept visual tokens, then continues positions as the pruner says (`renumber`). A pruner
reads the executor only through `State`, the small part of it a rule needs. The shared scoring helpers (head weights,
sink ranking, the fused scores of a cut) are here too.

The smallest pruner of your own, on HAP's schedule, is ten lines: `tests/own_pruners.py` (README, "A pruner of
your own").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from ..scoring.fusion import fuse, fusion_weights, row_mean, select_top, token_scores
from .cues import TowerRead

if TYPE_CHECKING:
    from ..config import HAPConfig
    from ..planning.flops import Schedule
    from .cues import VisionCues


class State(Protocol):
    """What a pruner reads of the executor's state of one prefill (`hap.patch.state.PruneState` is one). Positions are
    indices into the current, possibly already shortened, sequence of length T_cur; N_cur visual tokens are present."""

    config: HAPConfig  # the run's settings, model-dependent defaults resolved
    schedule: Schedule  # the planned cuts; a pruner whose rule sets its own counts may rewrite them (AutoPrune)
    row_valid: torch.Tensor  # bool [batch, P] the prompt rows that score; `on_input` may narrow them (SparseVLM)
    visual_pos: torch.Tensor  # long [batch, N_cur] current positions of the visual tokens
    whole_pos: torch.Tensor | None  # long [batch, R] the image's tokens beyond the visual ones (`whole_tokens`)
    seq_index: torch.Tensor  # long [batch, T_cur] the original position of each current token
    grids: tuple[tuple[int, int], ...]  # the (rows, cols) of each view's token grid (`views`), else ()
    question: torch.Tensor | None  # [M, E] the raw question's CLIP text embeddings (`clip`), else None
    memo: dict  # the pruner's own values across the cuts of one prefill (AutoPrune's MI_0 and curve)

    def kept_count(self, cut_index: int) -> int: ...  # visual tokens cut `cut_index` keeps

    def current_priority(self) -> torch.Tensor | None: ...  # [batch, N_cur] an analysis priority ranked first, or None

    def cues(self) -> VisionCues: ...  # the vision tower's [CLS] cues of this prefill (`cls_cues`)

    def row_positions(self, seq_len: int) -> torch.Tensor: ...  # long [batch, P] the prompt rows' current positions

    def key_valid(self) -> torch.Tensor | None: ...  # bool [batch, T_cur] the padding mask of the current sequence


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
    logits: torch.Tensor | None = None  # [batch, layers, heads, P, visual] the scoring layers' q.k / sqrt(d) before
    #                                     the softmax (`Pruner.logits`, else None)


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
    logits: ClassVar[bool] = False  # those maps' logits before the softmax too (`Cut.logits`; HAWK)
    cls_cues: ClassVar[bool] = False  # the vision tower's [CLS] cues (`hap.pruners.visionzip.VisionCues`)
    tower: ClassVar[tuple[TowerRead, ...]] = ()  # tower layers whose attention / hidden states it reads, captured
    #                                             once per image from q and k (`VisionCues.layers`); implies cls_cues
    clip: ClassVar[bool] = False  # CLIP's projections of those cues and of the raw question (`clip_model`:
    #                             `VisionCues.image_embeds`, `State.question`; CDPruner)
    crops: ClassVar[bool] = False  # those cues per crop where the tower encodes the image's crops apart (LLaVA-NeXT's
    #                                base view and tiles, `VisionCues.places`): one selection per crop
    embeds: ClassVar[bool] = False  # the visual rows of the hidden states entering the cut (`Cut.embeds`)
    layer_states: ClassVar[bool] = False  # the previous layer's keys and final-normed output (`Cut.keys`, DART)
    views: ClassVar[bool] = False  # the (rows, cols) of each view's token grid, from the adapter (`PruneState.grids`)
    whole_tokens: ClassVar[bool] = False  # the image's tokens beyond the visual ones too (`Cut.whole_embeds`: the
    #                                       newlines of LLaVA-NeXT, which other pruners always keep), may drop them
    reads_input: ClassVar[bool] = False  # the decoder's input embeddings before layer 0 (`on_input`, SparseVLM)
    cls_knob: ClassVar[str | None] = None  # the knob through which it asks for [CLS] cues, named in refusals (HAP)
    # how it runs
    max_batch: ClassVar[int | None] = None  # the most prompts one prefill may hold (None: any), and why
    batch_rule: ClassVar[str] = ""
    # where it cuts
    fixed_cuts: ClassVar[int | None] = None  # how many cuts it always makes (None: the `groups` knob)
    lookahead: ClassVar[bool] = False  # score every cut with the next layer's attention on the tokens about to enter it
    before_decoder: ClassVar[bool] = False  # one cut before layer 0, whatever first_layers says
    min_full_layers: ClassVar[int] = 0  # the fewest layers before its first cut (first_layers is raised to it)
    min_tokens: ClassVar[int] = 1  # the fewest visual tokens a cut may keep
    official: ClassVar[bool] = False  # its official code's schedule, solved on its budget T (`official_schedule`)
    # how it selects
    writes_tokens: ClassVar[bool] = False  # the kept slots carry tokens it builds (`Selection.tokens`)
    recycle: ClassVar[bool] = False  # the dropped tokens' cluster means join the kept ones (`hap.pruners.recycle`)
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
        """Whether a cut uses the vision tower's [CLS] cues (the feature layer's, or other layers', `tower`)."""
        return self.cls_cues or bool(self.tower)

    @classmethod
    def official_schedule(cls, budget: int, num_visual: int, num_layers: int) -> Schedule:
        """The schedule of its official code at budget `budget` (`official` pruners only)."""
        raise NotImplementedError(f"{cls.name} has no official schedule")

    def on_input(self, state: State, embeds: torch.Tensor) -> None:
        """Called with the decoder's input embeddings `embeds` [batch, T, D] before layer 0 (`reads_input` pruners)."""

    def embed_question(self, clip: tuple, question: str) -> torch.Tensor | None:
        """The raw question's cue, `State.question` ([M, E]), from CLIP (`clip` = (CLIPModel, tokenizer) of the
        `clip_model` knob, loaded by the adapter for `clip` pruners); None: the pruner reads no question."""
        return None

    def curve(self, state: State) -> dict | None:
        """The schedule the rule chose while it ran, reported with the run (`Result.curve`; AutoPrune's), or None."""
        return None

    def check_batch(self, batch: int) -> None:
        """ValueError where a prefill of `batch` prompts exceeds the pruner's `max_batch`."""
        if self.max_batch is not None and batch > self.max_batch:
            raise ValueError(f"method={self.name!r} prunes {self.batch_limit()} at a time ({self.batch_rule}); "
                             f"got a batch of {batch}")

    @classmethod
    def batch_limit(cls) -> str:
        """`max_batch` in words: "one prompt", "at most 4 prompts"."""
        return "one prompt" if cls.max_batch == 1 else f"at most {cls.max_batch} prompts"

    def refuses(self, family: str) -> str | None:
        """Why the pruner does not run on the models of adapter `family` (`hap.patch` module name: "llava",
        "llava_next", "qwen2_vl", ...), or None; asked before any work with the model."""
        return None

    def resizes_image(self, family: str) -> bool:
        """Whether, on the models of adapter `family`, the method shrinks the image itself before the processor rather
        than cutting tokens (downsample on dynamic resolution): `hap.run` then gives the processor the image resized
        to the budget (`hap.runs.run.for_config`) and the decoder runs every token of it, no cut."""
        return False

    def image_size(self, height: int, width: int, budget: int, settings: tuple) -> tuple[int, int]:
        """(height, width) in pixels to resize an `height` x `width` image to, so that the processor (its adapter's
        `image_settings`, `settings`) emits about `budget` visual tokens (`resizes_image` pruners only)."""
        raise NotImplementedError(f"{self.name} does not resize the image")

    def resized_kept(self, before: tuple[int, int], after: tuple[int, int]) -> list[int]:
        """Per visual token of the resized image (a grid of `after` = (rows, cols) tokens, raster order), the index of
        the original image's token (a grid of `before`) it is reported at (`resizes_image` pruners only)."""
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

    @property
    def static_heads(self) -> bool:
        """Whether it weights heads by the static head importance of the `head_importance` knob's file."""
        return False

    def head_weights(self, paq: torch.Tensor, visual_share: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """The fusion weights of the scoring heads of decoder layers `layers`, `paq`, `visual_share`
        [batch, layers, heads] -> the same shape, summing to 1 per sample: softmax(PAQ / T)."""
        return fusion_weights(paq, self.temperature)

    def scores(self, state: State, cut: Cut) -> torch.Tensor:
        """Scores of the visual tokens present at `cut`, `[batch, visual]` (higher = keep): the fused maps' L2 norm
        over the prompt rows."""
        return token_scores(fuse(cut.attn, cut.weights), state.row_valid)

    def select(self, state: State, cut: Cut) -> Selection:
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
    dropped tokens recycled (`hap.pruners.recycle`), positions renumbered."""

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
