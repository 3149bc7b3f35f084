"""What one prefill did, apart from doing it: the per-cut and per-layer records, the tracer that the
pruner calls only when tracing, and their conversion to `Result` (everything the views draw).

Records are sample-major (`[batch, ...]`, on the CPU); token dimensions lie on the original visual
grid `[..., N]` (N visual tokens in row-major order), NaN where a token was already pruned.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from ..config import HAPConfig
from ..planning.flops import FLOPS_CONVENTION, DecoderShape, Schedule
from ..scoring.fusion import fuse, head_fusion, token_scores
from ..scoring.heads import HeadStats, classify, visual_distribution

STATS = ("sink_share", "dispersion", "visual_share", "paq")
GRIDDED = ("head_maps", "head_attention", "fused_map", "uniform_map")  # the `LayerTrace` fields [batch, ..., N]


@dataclass
class CutTrace:
    """One cut as the pruner made it: the scoring layers, what they weighed, what was kept."""

    layer: int  # first layer of the group that runs on the kept tokens
    scored_layers: list[int]
    kept: torch.Tensor  # long [batch, k] original visual indices, ascending
    paq: torch.Tensor | None = None  # [batch, scored layers, heads] the PAQ that weighted this cut
    weights: torch.Tensor | None = None  # [batch, scored layers, heads] the fusion weights the cut used
    recycled: torch.Tensor | None = None  # bool [batch, k]: the entries of `kept` that are recycled cluster means
    #                                       (SparseVLM, AutoPrune), each at its cluster centre's index; None: none


@dataclass
class LayerTrace:
    """What was captured at one decoder layer (docs/method.md §2, §5, §6)."""

    sink_share: torch.Tensor  # [batch, heads]
    dispersion: torch.Tensor  # [batch, heads]
    visual_share: torch.Tensor  # [batch, heads]
    paq: torch.Tensor  # [batch, heads]
    head_maps: torch.Tensor  # [batch, heads, N] token score per head
    head_attention: torch.Tensor  # [batch, heads, N] mean over prompt rows of the row's attention
    #                               renormalised over the visual tokens present (sums to 1)
    fused_map: torch.Tensor  # [batch, N] PAQ head fusion
    uniform_map: torch.Tensor  # [batch, N] plain head average
    sink_count: torch.Tensor  # [batch] visual tokens flagged as massive-activation sinks
    tokens_present: int  # visual tokens in the sequence when the layer was captured


def on_grid(values: torch.Tensor, kept: torch.Tensor, num_visual: int) -> torch.Tensor:
    """Scatter `[batch, ..., N_cur]` values of the present tokens onto `[batch, ..., N]`, NaN where pruned (CPU).

    kept long [batch, N_cur]: original index of each present token."""
    out = torch.full((*values.shape[:-1], num_visual), math.nan)
    idx = kept.cpu()
    idx = idx.view(idx.shape[0], *([1] * (values.dim() - 2)), idx.shape[1]).expand_as(values)
    return out.scatter(-1, idx, values.detach().float().cpu())


class Tracer:
    """Records the maps of every captured layer and cut of one prefill (the figures); used only when tracing."""

    def __init__(self, num_visual: int, temperature: float) -> None:
        self.num_visual = num_visual
        self.temperature = temperature
        self.layers: dict[int, LayerTrace] = {}
        self.cut_maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # cut layer -> (fused, uniform) [batch, N]

    def layer(self, index: int, attn: torch.Tensor, stats: HeadStats, sink: torch.Tensor, row_valid: torch.Tensor,
              kept: torch.Tensor) -> None:
        """Layer `index`: attn [batch, heads, P, N_cur] prompt rows over the present visual tokens, their stats,
        sink bool [batch, N_cur], row_valid bool [batch, P], kept long [batch, N_cur] original indices."""
        B, H = attn.shape[:2]
        per_head = token_scores(attn.flatten(0, 1), row_valid.repeat_interleave(H, 0)).view(B, H, -1)
        fused, uniform = (head_fusion(attn[:, None], stats.paq[:, None], t)[:, 0] for t in (self.temperature, math.inf))
        self.layers[index] = LayerTrace(
            *(getattr(stats, k).detach().cpu() for k in STATS),
            head_maps=on_grid(per_head, kept, self.num_visual),
            head_attention=on_grid(visual_distribution(attn, row_valid), kept, self.num_visual),
            fused_map=on_grid(token_scores(fused, row_valid), kept, self.num_visual),
            uniform_map=on_grid(token_scores(uniform, row_valid), kept, self.num_visual),
            sink_count=sink.sum(-1).cpu(),
            tokens_present=attn.shape[-1],
        )

    def regrid(self, kept: torch.Tensor, num_visual: int) -> Tracer:
        """This tracer's maps, recorded on visual tokens 0..N'-1, put on a grid of `num_visual` tokens at the original
        indices `kept` long [1, N'] (a resized image's tokens on the original image's grid), NaN elsewhere."""
        out = Tracer(num_visual, self.temperature)
        moved = lambda values: on_grid(values, kept.expand(values.shape[0], -1), num_visual)
        out.layers = {l: replace(tr, **{name: moved(getattr(tr, name)) for name in GRIDDED})
                      for l, tr in self.layers.items()}
        out.cut_maps = {l: tuple(moved(m) for m in maps) for l, maps in self.cut_maps.items()}
        return out

    def cut(self, layer: int, attn: torch.Tensor, weights: torch.Tensor, row_valid: torch.Tensor,
            kept: torch.Tensor) -> None:
        """The group maps that scored the cut entering `layer`: attn [batch, layers, heads, P, N_cur] fused with the
        head weights the method used, `weights` [batch, layers, heads] (softmax(PAQ / T), or static ones), and with
        uniform ones; kept long [batch, N_cur] original indices of the tokens before the cut."""
        uniform = torch.full_like(weights, 1.0 / weights[0].numel())
        maps = (token_scores(fuse(attn, w), row_valid) for w in (weights, uniform))
        self.cut_maps[layer] = tuple(on_grid(m, kept, self.num_visual) for m in maps)


@dataclass
class Group:
    """One group of decoder layers and the visual tokens it runs on."""

    index: int
    layers: tuple[int, int]  # decoder-layer range [start, end)
    scored_by: list[int]  # layers whose attention chose its tokens (layer 0 itself for a cut before it)
    kept: list[int]  # kept visual indices into the original 0..N-1 (row-major grid) order
    paq: list[list[float]]  # [scored_by][heads] the PAQ that weighted this cut (for a cut before layer 0:
    #                         layer 0 over all tokens, unlike `Result.paq[0]`, taken on the tokens it kept)
    weights: list[list[float]]  # [scored_by][heads] the fusion weights the method used (uniform for baselines)
    recycled: list[int] = field(default_factory=list)  # SparseVLM / AutoPrune: the cluster centre of each recycled
    #                                     token the group also runs on (a mean of dropped tokens, not in `kept`)


@dataclass
class Maps:
    """Token maps on the original visual grid, `[..., visual]`, NaN where a token was already pruned.

    Every map is the selection score s_v = ||M[:, v]||_2 over the prompt rows of some attention M.
    """

    head: torch.Tensor  # [layers, heads, visual] per head, before fusion (NaN rows: layer not captured)
    head_attention: torch.Tensor  # [layers, heads, visual] mean prompt-row attention over the image, sums to 1
    layer: torch.Tensor  # [layers, visual] head fusion with softmax(PAQ / T) within the layer
    layer_uniform: torch.Tensor  # [layers, visual] plain head average
    group: torch.Tensor  # [groups, visual] layer fusion over the layers that scored each group
    group_uniform: torch.Tensor  # [groups, visual] uniform-average counterpart


@dataclass
class Result:
    answer: str
    method: str
    config: dict  # the HAPConfig that ran, model-dependent defaults resolved
    prompt_text: str  # the full chat prompt given to the processor
    num_layers: int
    num_heads: int
    num_visual: int
    text_tokens: int
    visual_grid: tuple[int, int]  # (rows, cols) of the visual tokens over the image
    groups: list[Group]
    visual_per_layer: list[int]  # [layers] visual tokens present in each decoder layer
    retained_tokens: float  # average over all decoder layers of the visual tokens present
    retain: float  # retained_tokens / num_visual (achieved, after rounding)
    target_retain: float | None
    flops_ratio: float  # achieved prefill FLOPs / unpruned, FLOPS_CONVENTION
    target_flops_ratio: float | None
    paq: torch.Tensor  # [layers, heads], NaN where not scored
    sink_share: torch.Tensor  # [layers, heads]
    dispersion: torch.Tensor  # [layers, heads]
    visual_share: torch.Tensor  # [layers, heads]
    head_class: list[list[str]]  # [layers][heads] "sink"/"dispersed"/"optimal", "" where not scored
    sink_tokens: list[int]  # [layers] visual tokens flagged as sinks (-1 where not scored)
    maps: Maps
    timings: dict[str, float]
    notes: list[str] = field(default_factory=list)
    history: list[list[str]] = field(default_factory=list)  # earlier [question, answer] turns; prompt_text has them all
    plant: dict | None = None  # the head lab's plan when the run's model was planted (hap.plant): the plan, the sink
    #                            tokens used and the classifier's precision / recall on it; None on the stock model
    flops_convention: str = FLOPS_CONVENTION
    official_tokens: float | None = None  # sparsevlm / autoprune: their own accounting (visual tokens after each
    #                                       layer's drop, layer average), beside `retained_tokens` (what ran)
    curve: dict | None = None  # autoprune: the curve it chose (`hap.pruners.autoprune.Curve`: MI_0, MI_1, slope, fractions,
    #                            counts after each layer's drop)
    layout: dict | None = None  # where each visual token lies on the uploaded image (`hap.layout.Layout.to_dict`,
    #                             computed once by the model's adapter); None: the `visual_grid` over the whole image

    def kept_mask(self, group: int) -> torch.Tensor:
        """bool [visual] of the tokens group `group` runs on."""
        mask = torch.zeros(self.num_visual, dtype=torch.bool)
        mask[self.groups[group].kept] = True
        return mask

    def to_json(self) -> dict:
        """Plain JSON types; tensors become nested lists with NaN as null."""

        def plain(x):
            if isinstance(x, torch.Tensor):
                return plain(x.tolist())
            if isinstance(x, float):
                return None if math.isnan(x) else x
            if isinstance(x, (list, tuple)):
                return [plain(v) for v in x]
            if isinstance(x, dict):
                return {k: plain(v) for k, v in x.items()}
            return x

        return plain(asdict(self))


@dataclass
class Outcome:
    """The facts of one generate call that `to_result` turns into a `Result` (sample 0 of the batch)."""

    config: HAPConfig  # resolved for the decoder
    shape: DecoderShape
    heads: int
    num_visual: int
    prompt_len: int  # T: tokens of the prompt, visual ones included
    schedule: Schedule | None
    cuts: list[CutTrace]
    tracer: Tracer | None
    curve: dict | None = None  # the schedule the rule chose while it ran (`Pruner.curve`: AutoPrune's)


def to_result(outcome: Outcome, answer: str, text: str, grid: tuple[int, int], notes: list[str]) -> Result:
    """The Result of sample 0: per-layer statistics and maps from the tracer (NaN for layers it did not
    capture), groups from the cuts, retained tokens and FLOPs from the schedule (the unpruned ones without)."""
    L, H, N = outcome.shape.layers, outcome.heads, outcome.num_visual
    layers = {l: _sample(tr, 0) for l, tr in (outcome.tracer.layers if outcome.tracer else {}).items()}
    stats = {k: _per_layer(layers, k, (L, H)) for k in STATS}
    groups, group_maps = _groups(outcome, N)
    schedule = outcome.schedule
    visual_per_layer = schedule.visual_per_layer if schedule else [N] * L
    retained = sum(visual_per_layer) / L
    return Result(
        answer=answer,
        method=outcome.config.method,
        config=outcome.config.to_dict(),
        prompt_text=text,
        num_layers=L,
        num_heads=H,
        num_visual=N,
        text_tokens=outcome.prompt_len - N,
        visual_grid=grid,
        groups=groups,
        visual_per_layer=visual_per_layer,
        retained_tokens=retained,
        retain=retained / N,
        target_retain=outcome.config.retain,
        flops_ratio=schedule.flops_ratio(outcome.prompt_len - N, outcome.shape) if schedule else 1.0,
        target_flops_ratio=outcome.config.flops_ratio,
        **stats,
        head_class=_classes(stats, sorted(layers), outcome.config, L, H),
        sink_tokens=[int(layers[l].sink_count) if l in layers else -1 for l in range(L)],
        maps=Maps(
            head=_per_layer(layers, "head_maps", (L, H, N)),
            head_attention=_per_layer(layers, "head_attention", (L, H, N)),
            layer=_per_layer(layers, "fused_map", (L, N)),
            layer_uniform=_per_layer(layers, "uniform_map", (L, N)),
            group=group_maps[0],
            group_uniform=group_maps[1],
        ),
        timings={},
        notes=notes + (schedule.notes if schedule else []),
        official_tokens=schedule.official_tokens if schedule and schedule.budget is not None else None,
        curve=outcome.curve,
    )


def _sample(record, b: int):
    """The record with every tensor field indexed at sample `b`."""
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return type(record)(**{k: v[b] if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def _per_layer(layers: dict[int, LayerTrace], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Field `name` of every captured layer stacked on `shape` = [layers, ...], NaN for the others."""
    out = torch.full(shape, math.nan)
    for l, tr in layers.items():
        out[l] = getattr(tr, name)
    return out


def _classes(stats: dict[str, torch.Tensor], captured: list[int], config: HAPConfig, L: int, H: int) -> list[list[str]]:
    """[layers][heads] head class of the captured layers, "" for the others."""
    classes = [[""] * H for _ in range(L)]
    if captured:
        rows = classify(HeadStats(*(stats[k][captured] for k in STATS)), config.tau_sink, config.tau_disp)
        for l, row in zip(captured, rows):
            classes[l] = row
    return classes


def _groups(outcome: Outcome, N: int) -> tuple[list[Group], tuple[torch.Tensor, torch.Tensor]]:
    """Groups of sample 0 and their (PAQ-fused, uniform) maps, each [groups, N] (NaN rows: no maps traced)."""
    if outcome.schedule is None:
        return [], (torch.empty(0, N), torch.empty(0, N))
    groups = []
    maps = torch.full((2, len(outcome.cuts), N), math.nan)
    for g, (layers, cut) in enumerate(zip(outcome.schedule.ranges, outcome.cuts)):
        cut = _sample(cut, 0)
        paq, weights = ([] if t is None else t.tolist() for t in (cut.paq, cut.weights))
        kept, recycled = cut.kept, torch.zeros_like(cut.kept, dtype=torch.bool) if cut.recycled is None else cut.recycled
        groups.append(Group(g, layers, cut.scored_layers, kept[~recycled].tolist(), paq, weights,
                            kept[recycled].tolist()))
        if outcome.tracer is not None and cut.layer in outcome.tracer.cut_maps:
            maps[:, g] = torch.stack([m[0] for m in outcome.tracer.cut_maps[cut.layer]])
    return groups, (maps[0], maps[1])
