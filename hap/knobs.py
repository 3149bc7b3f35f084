"""The knob registry: every setting of the pruner once, with its type, range, default and meaning.

`HAPConfig` (hap/config.py) takes its fields' defaults and its validation from here; the CLI flags
(`python -m hap run --first-layers 0 ...`), the lmms-eval `model_args`, the benchmark flags and
the app's controls are generated from or checked against `KNOBS`. A knob whose good default
depends on the model carries a `rule` (decoder layers -> default) and the default None, which
`HAPConfig.resolved` fills in once the decoder is known (docs/method.md §4).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

from .methods import DEFAULT, METHODS  # the registry of methods (a leaf)

ROWS = ("prompt", "last", "question")
HEAD_WEIGHTS = ("paq", "paq_visual", "static")
SINK_RANKINGS = ("keep", "mask", "mask_keep_one")
SINK_DETECTORS = ("norm", "consensus", "both")
FIRST_CUTS = ("attention", "prerope", "vision")
SCORE_LAYERS = ("segment", "last")
MERGES = ("none", "average", "proportional")
DEEP_DECODER = 16  # decoder layers from which a model counts as deep for the per-model defaults


def by_depth(deep: object, shallow: object) -> Callable[[int], object]:
    """A per-model rule: `deep` on decoders of DEEP_DECODER+ layers, else `shallow`."""

    def rule(n_layers: int) -> object:
        return deep if n_layers >= DEEP_DECODER else shallow

    return rule


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class Knob:
    """One setting: `HAPConfig` field, `/analyze` parameter and CLI flag `--` + name with dashes."""

    name: str  # the HAPConfig field name, also the /analyze parameter name
    kind: type  # int, float or str
    default: object  # the library default (None where the default depends on the model: see `rule`)
    help: str  # one-line meaning
    low: float | None = None  # inclusive lower bound (or exclusive when low_open)
    high: float | None = None  # inclusive upper bound; None = unbounded (inf allowed for floats)
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    optional: bool = False  # None allowed (retain / flops_ratio)
    rule: Callable[[int], object] | None = None  # per-model default from the number of decoder layers
    paper: object = None  # the value of HAP as the paper formulates it (docs/method.md §2-§6); None: no such value

    @property
    def flag(self) -> str:
        """The command-line flag, e.g. `--first-layers`."""
        return "--" + self.name.replace("_", "-")

    @property
    def allowed(self) -> str:
        """What the knob accepts, in words: "a number in (0, 1]", "an integer >= 1", "one of a, b"."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.kind is str:
            return "a non-empty text"
        what = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {self.low:g}"
        return what

    def check(self, value: object) -> object:
        """`value` if allowed (ints coerced from integral floats, floats from ints), else ValueError
        naming the knob and what is allowed. None passes where the knob is optional or has a rule."""
        if value is None and (self.optional or self.rule is not None):
            return None
        if self.kind is str and self.optional and isinstance(value, str) and not value.strip():
            return None  # an empty text box: not given
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{self.name}={value!r} is not allowed; choose {self.allowed}")
            return value
        if self.kind is str:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{self.name}={value!r} must be {self.allowed}")
            return value
        ok = _is_real(value) and (self.kind is float or float(value).is_integer())
        ok = ok and (self.low is None or (value > self.low if self.low_open else value >= self.low))
        ok = ok and (self.high is None or value <= self.high)
        if not ok:
            raise ValueError(f"{self.name}={value!r} must be {self.allowed}")
        return int(value) if self.kind is int else float(value)

    def parse(self, text: str) -> object:
        """A textual value (lmms-eval `model_args`, a query string) as the knob's type; "none"/"" -> None
        where None is allowed. Text that does not parse is returned as is, for `check` to refuse."""
        stripped = text.strip()
        if stripped.lower() in ("", "none", "null") and (self.optional or self.rule is not None):
            return None
        if self.kind is str:
            return stripped
        try:
            number = float(stripped)
        except ValueError:
            return text
        return int(number) if self.kind is int and number.is_integer() else number

    def resolve(self, n_layers: int) -> object:
        """The default for a decoder of `n_layers` layers."""
        return self.rule(n_layers) if self.rule is not None else self.default

    def add_to(self, parser: argparse._ActionsContainer, default: object = None) -> None:
        """Add the knob's flag to an argparse parser (or group); an unset flag is None unless `default` is given
        (None leaves the library default, resolved per model where the knob has a rule)."""
        kind = self.kind if self.kind is str else self.parse
        library = "per model" if self.rule is not None else self.default
        parser.add_argument(self.flag, dest=self.name, type=kind, choices=self.choices, default=default,
                            help=f"{self.help} (default: {library if default is None else default})")


KNOBS: tuple[Knob, ...] = (
    Knob("method", str, DEFAULT, "pruning method: HAP or a baseline; none runs the stock model", choices=METHODS,
         paper=DEFAULT),
    Knob("retain", float, None,
         "visual tokens kept, averaged over all decoder layers, as a fraction; when neither retain nor flops_ratio "
         f"is given: 0.111 on decoders of {DEEP_DECODER}+ layers, else 0.25",
         low=0.0, high=1.0, low_open=True, optional=True, rule=by_depth(0.111, 0.25)),
    Knob("flops_ratio", float, None, "target prefill FLOPs / unpruned prefill FLOPs, instead of retain",
         low=0.0, high=1.0, low_open=True, optional=True),
    Knob("first_layers", int, None,
         f"K: layers [0, K) see every token; 0 cuts before the first layer; 2 on decoders of {DEEP_DECODER}+ layers "
         "(FastV's K), else 0", low=0, rule=by_depth(2, 0)),
    Knob("groups", int, 3, "G: contiguous layer groups after the first K, each with its own budget", low=1),
    Knob("decay", float, 0.5, "lambda: each group keeps lambda times the tokens of the one before",
         low=0.0, high=1.0, low_open=True),
    Knob("temperature", float, 0.1, "T of softmax(PAQ / T) over heads; inf = uniform averaging", low=0.0,
         low_open=True, paper=0.1),
    Knob("tau_sink", float, 0.5, "a head whose sink share is >= tau_sink is a sink head", low=0.0, high=1.0,
         paper=0.5),
    Knob("tau_disp", float, 0.9, "a non-sink head whose normalised entropy is >= tau_disp is dispersed",
         low=0.0, high=1.0, paper=0.9),
    Knob("sink_rho", float, 10.0, "a visual token is a sink when its hidden-state norm > rho x the median norm",
         low=1.0, paper=10.0),
    Knob("rows", str, "last",
         "prompt rows scoring the tokens: every text token after the image, the last one, or the question's "
         "(the prompt rows minus the chat template's tail, e.g. ' ASSISTANT:')", choices=ROWS, paper="prompt"),
    Knob("head_weight", str, "paq",
         "head weights of the fusion: softmax(PAQ / T) (paq), or x each head's visual share (paq_visual: "
         "w ~ mu exp(PAQ / T)), or each head's static importance, measured once per model (static: the "
         "head_importance file)", choices=HEAD_WEIGHTS, paper="paq"),
    Knob("sink_ranking", str, "keep",
         "sink tokens in the ranking of a cut: kept as scored (keep), ranked last (mask), or ranked last but the "
         "best-scored one kept first as an anchor (mask_keep_one)", choices=SINK_RANKINGS, paper="keep"),
    Knob("sink_detector", str, "norm",
         "sink tokens: hidden-state norm test (norm), attention consensus over the layer's heads (consensus), "
         "or either (both)", choices=SINK_DETECTORS, paper="norm"),
    Knob("consensus_share", float, 0.5,
         "consensus sink test: a head's top tokens (at most consensus_tokens) holding >= this share of its visual "
         "attention...", low=0.0, high=1.0, low_open=True),
    Knob("consensus_quorum", float, 0.25, "...for >= this fraction of the layer's heads", low=0.0, high=1.0,
         low_open=True),
    Knob("consensus_tokens", int, 8,
         "consensus sink test: the most tokens a head's parked attention may be split over (1: one token)", low=1),
    Knob("score_layers", str, "last",
         "layers whose maps score a cut: every layer of the segment before it (segment), or only its last layer "
         "(last, as PyramidDrop scores)", choices=SCORE_LAYERS, paper="segment"),
    Knob("merge", str, "proportional",
         "dropped visual tokens: discarded (none), or folded into the most similar kept token (average), whose "
         "attention logit also gains log(tokens it stands for) so it draws their attention (proportional)",
         choices=MERGES,
         paper="none"),
    Knob("first_cut", str, "attention",
         "scores of a cut before layer 0: layer 0's attention (attention), or its q.k without rotary embedding "
         "(prerope: no recency bias), or the vision tower's [CLS] attention (vision; CLIP towers)",
         choices=FIRST_CUTS, paper="attention"),
    Knob("diversity", float, 0.25,
         "weight w of diversity at a cut: keep, one at a time, the token of largest relevance (rescaled to [0, 1]) + "
         "w log(its squared distance from the span of the kept tokens' unit hidden states), the greedy MAP of a "
         "conditional DPP; detected sinks kept after every other token (0: the relevance top-k)", low=0.0, paper=0.0),
    Knob("head_importance", str, None,
         "the static head importance file (JSON, {\"weights\": [[per head] per layer]}) read by hawk and "
         "head_weight=static; unset: the model folder's head_importance.json (python -m analysis.head_importance "
         "makes one)", optional=True),
    Knob("clip_model", str, "openai/clip-vit-large-patch14-336",
         "cdpruner: the CLIP checkpoint whose text tower and projections pair with the vision tower (a hub id, or a "
         "local folder holding a CLIPModel and its tokenizer)"),
)
SEED = Knob("seed", int, 0, "seed of the random baseline", low=0)  # a HAPConfig field, not a user-facing knob
_BY_NAME = {k.name: k for k in (*KNOBS, SEED)}


def knob(name: str) -> Knob:
    """The knob called `name` (a HAPConfig field name, `seed` included); KeyError names the known ones."""
    if name not in _BY_NAME:
        raise KeyError(f"no knob {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]
