"""The head lab's plan and its arithmetic: planted sink and dispersed heads (docs/method.md §14).

A plan names query heads `(layer, head)` to make misaligned, on purpose and labelled as such (`hap.plant`
applies it to a model for a block):

* a planted **sink** head moves `strength` of its attention, in every row it plants, onto the sink tokens (visual
  tokens; split evenly among those present), keeping the rest of its own pattern scaled by `1 - strength`, and
  reads nothing from the sink tokens (their values count as zero for that head, as a real sink's small values
  contribute little);
* a planted **dispersed** head spreads `strength` of its visual attention evenly over the visual tokens present
  (its text attention and its visual share unchanged);
* with `massive` (the default) the sink tokens also carry a **massive activation**, as real visual sinks do (Sun et
  al. 2024; Kang et al. 2025): from the input of the first layer holding a planted sink head on, the residual stream
  of each sink token gains `MASSIVE_RATIO` times the median visual token's hidden-state norm there, split evenly
  over the fixed hidden dimensions `massive_dims` (the same for every token, image and layer). It is added once;
  the residual connections carry it to every later layer, where every head (planted or not) and the norm sink test
  see it.

The rows planted are those after the image (the text that reads it: the prompt rows HAP scores and every generated
token); rows before or inside the image are left as they are, so nothing reads a token it may not see. The same
`plant_attention` turns a head's stock attention into its planted one in the model's forward and in HAP's capture
of the prompt rows, so what the pruner scores is what the model runs.

Everything here is plain tensors; the hooks that apply a plan to a model are in `hap/lab/planted.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch

DEFAULT_STRENGTH = 0.9
DEFAULT_SINK_COUNT = 1  # default sink tokens per image: the most redundant visual token (`redundant_tokens`)
MASSIVE_RATIO = 100.0  # a massive sink token's added activation: this many times the median visual token's norm
LLAMA2_MASSIVE_DIMS = (1415, 2533)  # LLaMA-2-7B's own massive-activation dimensions of its 4096 (Sun et al. 2024)
PLAN_KEYS = ("sink", "dispersed", "sink_tokens", "strength", "massive")
Head = tuple[int, int]


def _heads(field: str, value) -> tuple[Head, ...]:
    """`value` as sorted unique (layer, head) pairs of ints; ValueError naming `field` otherwise."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{field} must be a list of [layer, head] pairs; got {value!r}")
    pairs = []
    for pair in value:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable):
            raise ValueError(f"{field}: each entry must be a [layer, head] pair of integers; got {pair!r}")
        pair = tuple(pair)
        if len(pair) != 2 or not all(_is_int(v) for v in pair):
            raise ValueError(f"{field}: each entry must be a [layer, head] pair of integers; got {list(pair)!r}")
        pairs.append((int(pair[0]), int(pair[1])))
    return tuple(sorted(set(pairs)))


def _is_int(v) -> bool:
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


@dataclass(frozen=True)
class Plan:
    """Which heads to plant and how (see the module docstring). `sink_tokens`: visual-token indices (row-major over
    the image's token grid), or a count k for the k most redundant visual tokens of each image (`redundant_tokens`),
    or None for the default (the most redundant one); `massive`: the sink tokens carry a massive activation."""

    sink: tuple[Head, ...] = ()
    dispersed: tuple[Head, ...] = ()
    sink_tokens: tuple[int, ...] | int | None = None
    strength: float = DEFAULT_STRENGTH
    massive: bool = True

    @classmethod
    def of(cls, sink=(), dispersed=(), sink_tokens=None, strength=DEFAULT_STRENGTH, massive=True) -> Plan:
        """A checked plan from plain values (lists, tuples, JSON numbers); ValueError naming the field and what it
        allows. The ranges that depend on the model are checked by `check_model` and `check_tokens`."""
        sink, dispersed = _heads("sink", sink), _heads("dispersed", dispersed)
        both = sorted(set(sink) & set(dispersed))
        if both:
            raise ValueError(f"dispersed: head {list(both[0])} is also planted as a sink; a head is planted once")
        if _is_int(sink_tokens):
            if sink_tokens < 1:
                raise ValueError(f"sink_tokens={sink_tokens!r}: a count of sink tokens per image must be >= 1")
            sink_tokens = int(sink_tokens)
        elif sink_tokens is not None:
            if isinstance(sink_tokens, (str, bytes)) or not isinstance(sink_tokens, Iterable):
                raise ValueError(f"sink_tokens must be a list of visual-token indices, a count of tokens per image or "
                                 f"null; got {sink_tokens!r}")
            tokens = list(sink_tokens)
            if not tokens:
                raise ValueError("sink_tokens must name at least one visual token (or be null for the default: "
                                 "the most redundant background patch of each image)")
            if not all(_is_int(t) for t in tokens):
                raise ValueError(f"sink_tokens must be integers (visual-token indices); got {tokens!r}")
            sink_tokens = tuple(sorted({int(t) for t in tokens}))
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 <= strength <= 1.0:
            raise ValueError(f"strength={strength!r} must be a number in [0, 1]")
        if not isinstance(massive, bool):
            raise ValueError(f"massive={massive!r} must be true or false")
        return cls(sink, dispersed, sink_tokens, float(strength), massive)

    @classmethod
    def from_json(cls, value) -> Plan:
        """A plan from `/analyze`'s `plant` parameter or a `--plant` file: a JSON object (or its text)
        `{"sink": [[l, h], ...], "dispersed": [...], "sink_tokens": [...], "strength": 0.9, "massive": true}`, every
        key optional; None, "" and {} are the empty plan."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"plant is not valid JSON ({err.msg} at character {err.pos})") from err
        if not isinstance(value, dict):
            raise ValueError(f"plant must be a JSON object with keys {', '.join(PLAN_KEYS)}; got {type(value).__name__}")
        unknown = sorted(set(value) - set(PLAN_KEYS))
        if unknown:
            raise ValueError(f"plant: unknown keys {', '.join(unknown)}; allowed: {', '.join(PLAN_KEYS)}")
        strength = value.get("strength", DEFAULT_STRENGTH)
        massive = value.get("massive", True)
        return cls.of(value.get("sink", ()), value.get("dispersed", ()), value.get("sink_tokens"),
                      DEFAULT_STRENGTH if strength is None else strength, True if massive is None else massive)

    @property
    def empty(self) -> bool:
        return not self.sink and not self.dispersed

    def to_json(self) -> dict:
        tokens = self.sink_tokens if self.sink_tokens is None or isinstance(self.sink_tokens, int) else list(
            self.sink_tokens)
        return {"sink": [list(p) for p in self.sink], "dispersed": [list(p) for p in self.dispersed],
                "sink_tokens": tokens, "strength": self.strength, "massive": self.massive}

    def check_model(self, layers: int, heads: int, windows: tuple[int | None, ...] = (), name: str = "") -> None:
        """ValueError naming the field when a planted head lies outside a decoder of `layers` x `heads` query
        heads, or in a layer that slides a window (`windows`: each layer's, None for full attention) over the keys:
        the planted rows are recomputed over every key, so heads are planted in full-attention layers only."""
        for field, pairs in (("sink", self.sink), ("dispersed", self.dispersed)):
            for layer, head in pairs:
                if not 0 <= layer < layers:
                    raise ValueError(f"{field}: layer {layer} of [{layer}, {head}] is out of range; the model's "
                                     f"layers are 0..{layers - 1}")
                if not 0 <= head < heads:
                    raise ValueError(f"{field}: head {head} of [{layer}, {head}] is out of range; each layer has "
                                     f"query heads 0..{heads - 1}")
                if windows and windows[layer] is not None:
                    full = [l for l, w in enumerate(windows) if w is None]
                    raise ValueError(f"{field}: layer {layer} of {name} slides a window of {windows[layer]} tokens; "
                                     f"hap.plant plants heads in full-attention layers only "
                                     f"({', '.join(map(str, full)) or 'none in this model'})")

    def check_tokens(self, num_visual: int) -> None:
        """ValueError when a sink token is not a visual-token index of an image of `num_visual` tokens (or a count
        of them exceeds it)."""
        if isinstance(self.sink_tokens, int):
            if self.sink_tokens > num_visual:
                raise ValueError(f"sink_tokens={self.sink_tokens} is more than this image's {num_visual} visual tokens")
        elif self.sink_tokens is not None and not all(0 <= t < num_visual for t in self.sink_tokens):
            bad = [t for t in self.sink_tokens if not 0 <= t < num_visual]
            raise ValueError(f"sink_tokens {bad} are out of range; this image has visual tokens 0..{num_visual - 1}")

    def at_layer(self, layer: int) -> tuple[list[int], list[int]]:
        """(sink heads, dispersed heads) planted in `layer`."""
        return [h for l, h in self.sink if l == layer], [h for l, h in self.dispersed if l == layer]

    @property
    def layers(self) -> list[int]:
        return sorted({l for l, _ in (*self.sink, *self.dispersed)})

    @property
    def massive_layer(self) -> int | None:
        """The layer at whose input the sink tokens gain their massive activation: the first holding a planted sink
        head (None: no sink head, or `massive` off)."""
        return min(l for l, _ in self.sink) if self.massive and self.sink else None


def share_plan(layers: Iterable[int], heads: int, share: float, seed: int, kind: str = "sink",
               sink_tokens=None, strength: float = DEFAULT_STRENGTH, massive: bool = True) -> Plan:
    """"Plant `kind` heads in `share` of the heads of `layers`": round(share x heads) heads of each layer, drawn
    without replacement by a generator seeded with `seed` (the same heads for the same arguments)."""
    if kind not in ("sink", "dispersed"):
        raise ValueError(f"kind={kind!r}: choose sink or dispersed")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise ValueError(f"share={share!r} must be a number in [0, 1]")
    generator = torch.Generator().manual_seed(int(seed))
    count = round(share * heads)
    chosen = [(l, int(h)) for l in layers for h in torch.randperm(heads, generator=generator)[:count]]
    return Plan.of(**{kind: chosen}, sink_tokens=sink_tokens, strength=strength, massive=massive)


def redundant_tokens(visual_embeds: torch.Tensor, count: int = DEFAULT_SINK_COUNT) -> torch.Tensor:
    """The default sink tokens: `visual_embeds [batch, N, d]` (the visual tokens entering the decoder) -> long
    `[batch, count]`, the visual tokens of highest mean cosine similarity to the image's visual tokens (the most
    redundant: a patch of plain background, where real visual sinks sit), ties to the lower index, sorted."""
    x = torch.nn.functional.normalize(visual_embeds.detach().float(), dim=-1)
    typical = (x @ x.transpose(-1, -2)).mean(-1)  # [B, N]
    return torch.argsort(-typical, dim=-1, stable=True)[:, :count].sort(-1).values


def massive_dims(hidden_size: int) -> list[int]:
    """The hidden dimensions a planted sink's massive activation lives in, for a residual stream of `hidden_size`:
    LLaMA-2-7B's own (1415 and 2533 of 4096), at the same fractions of `hidden_size`."""
    return sorted({d * hidden_size // 4096 for d in LLAMA2_MASSIVE_DIMS})


def massive_activation(hidden: torch.Tensor, visual: torch.Tensor, sink: torch.Tensor,
                       ratio: float = MASSIVE_RATIO) -> torch.Tensor:
    """`hidden [batch, T, d]` (a layer's input, the residual stream) with a massive activation added on the sink
    rows: `ratio` x the sample's median visual-token norm (float32), split evenly over `massive_dims(d)`. visual,
    sink bool [batch, T]: the visual rows and the sink tokens among them (a sample without visual rows gains
    nothing). Returns a new tensor of `hidden`'s dtype."""
    norms = hidden.detach().float().norm(dim=-1).masked_fill(~visual, float("nan"))  # [B, T]
    median = norms.nanmedian(-1).values.nan_to_num(0.0)  # [B]
    dims = massive_dims(hidden.shape[-1])
    delta = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    delta[..., dims] = (ratio * median / len(dims) ** 0.5)[:, None, None]
    return hidden + (delta * sink[..., None]).to(hidden.dtype)


def plant_attention(attn: torch.Tensor, visual: torch.Tensor, sink: torch.Tensor, sink_heads: list[int],
                    dispersed_heads: list[int], strength: float) -> torch.Tensor:
    """The planted attention of one layer's heads.

    attn [batch, heads, rows, keys]: stock probabilities (each row softmaxed over every key); visual, sink bool
    [batch, keys]: the visual keys and the sink tokens among them; `sink_heads`, `dispersed_heads`: indices into
    `heads`. A sink head's row becomes
    (1 - s) row + s * (even over the sink tokens present; the row unchanged where none is); a dispersed head's
    visual part becomes (1 - s) row + s * (its visual mass, even over the visual tokens). Rows still sum as before.
    Returns a new tensor of `attn`'s shape and dtype.
    """
    s = float(strength)
    out = attn.clone()
    if sink_heads:
        a = attn[:, sink_heads]
        target = sink.to(attn.dtype) / sink.sum(-1, keepdim=True).clamp_min(1).to(attn.dtype)  # [B, K]
        planted = (1 - s) * a + s * target[:, None, None, :]
        out[:, sink_heads] = torch.where(sink.any(-1)[:, None, None, None], planted, a)
    if dispersed_heads:
        a = attn[:, dispersed_heads]
        vis = visual[:, None, None, :]
        mass = (a * vis).sum(-1, keepdim=True)
        even = mass / visual.sum(-1).clamp_min(1).to(attn.dtype)[:, None, None, None]
        out[:, dispersed_heads] = torch.where(vis, (1 - s) * a + s * even, a)
    return out


def planted_values(values: torch.Tensor, sink: torch.Tensor, is_sink: list[bool]) -> torch.Tensor:
    """values [batch, planted heads, keys, d] of the planted heads, with the sink tokens' values (sink bool
    [batch, keys]) zeroed for the heads planted as sinks (`is_sink`, one flag per head)."""
    reads = torch.ones(values.shape[:3], dtype=values.dtype, device=values.device)
    flags = torch.tensor(is_sink, device=values.device)
    reads = torch.where(flags[None, :, None] & sink[:, None, :], 0.0, reads)
    return values * reads[..., None]


def precision_recall(planted: Iterable[Head], found: Iterable[Head]) -> dict:
    """How the classifier did on the plan for one class: planted heads `planted`, heads it put in the class `found`;
    precision = |both| / |found| and recall = |both| / |planted| (None where the denominator is 0)."""
    planted, found = set(map(tuple, planted)), set(map(tuple, found))
    both = planted & found
    return {"planted": len(planted), "classified": len(found), "found": sorted(map(list, both)),
            "missed": sorted(map(list, planted - found)),
            "precision": len(both) / len(found) if found else None,
            "recall": len(both) / len(planted) if planted else None}


def classifier_report(plan: Plan, head_class: list[list[str]]) -> dict:
    """The classifier's precision / recall on `plan` from a run's classes `[layers][heads]` ("" where not scored):
    per planted class, over the scored heads (a planted head in an unscored layer counts as missed)."""
    classes = {(l, h): c for l, row in enumerate(head_class) for h, c in enumerate(row)}
    report = {}
    for kind, heads in (("sink", plan.sink), ("dispersed", plan.dispersed)):
        report[kind] = precision_recall(heads, [k for k, c in classes.items() if c == kind])
    return report


def plant_line(report: dict) -> str:
    """One line on a planted run (`Planting.report` with its classifier entry): the plan and what the classifier
    found of it."""
    parts = [f"PLANTED heads (hap.plant, not the model's own): {len(report['sink'])} sink, {len(report['dispersed'])} "
             f"dispersed, strength {report['strength']}, sink tokens {report['sink_tokens_used']}"]
    for kind in ("sink", "dispersed"):
        c = report["classifier"][kind]
        if c["planted"]:
            parts.append(f"classified {kind}: {len(c['found'])} of {c['planted']} planted (recall {_num(c['recall'])}, "
                         f"precision {_num(c['precision'])})")
    return "; ".join(parts)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
