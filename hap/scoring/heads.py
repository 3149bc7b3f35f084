"""Per-head statistics from prompt-row attention: sink share, dispersion, visual share, PAQ, class.

docs/method.md §2-§3. Input everywhere is the attention of one decoder layer's prompt rows over the
visual columns, `attn [batch, heads, prompt, visual]`, whose rows were softmaxed over ALL keys (so a
row sums to the head's visual share, not to 1). `row_valid [batch, prompt]` marks the rows that are
real prompt tokens of that sample (left padding makes prompts of different lengths share one
tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SINK, DISPERSED, OPTIMAL = "sink", "dispersed", "optimal"
CLASSES = (SINK, DISPERSED, OPTIMAL)
_EPS = 1e-12


@dataclass
class HeadStats:
    """Statistics of every head of one layer, each `[batch, heads]`."""

    sink_share: torch.Tensor  # sigma: mean over rows of the attention mass on sink tokens
    dispersion: torch.Tensor  # delta: mean over rows of normalised entropy over non-sink tokens
    visual_share: torch.Tensor  # mu: mean over rows of the attention mass on the image at all
    paq: torch.Tensor  # (1 - sigma) * (1 - delta), in [0, 1]


def sink_tokens(visual_hidden: torch.Tensor, rho: float) -> torch.Tensor:
    """Massive-activation detector: `visual_hidden [batch, visual, d]` -> bool `[batch, visual]`.

    A visual token is a sink when the L2 norm of its input hidden state exceeds `rho` times the
    median norm over the sample's visual tokens.
    """
    norms = visual_hidden.float().norm(dim=-1)
    return norms > rho * norms.median(dim=-1, keepdim=True).values


SINK_SET_TOP = 0.7  # a head's top tokens: those holding at least this fraction of its largest share
SINK_SET_CONCENTRATION = 8.0  # a parked set holds at least this many times its even share (|S| / N) of the attention


def parked_sets(dist: torch.Tensor, share: float = 0.5, tokens: int = 8) -> torch.Tensor:
    """Where each head parks its attention: `dist [..., heads, visual]` (each head's visual distribution over the N
    tokens present, summing to 1) -> bool `[..., heads, visual]`: the head's top tokens S (each holding at least
    SINK_SET_TOP x its largest share: sink tokens look alike to a head, so it splits its parked attention about
    evenly over them) where S spans at most `tokens` tokens and holds at least `share` of the head's visual
    attention and at least SINK_SET_CONCENTRATION x |S| / N (a few tokens of many: 0.5 on one of 8 tokens left is
    no sink); empty otherwise."""
    top = dist >= SINK_SET_TOP * dist.amax(-1, keepdim=True)
    size = top.sum(-1, keepdim=True)
    mass = (dist * top).sum(-1, keepdim=True)
    parked = (size <= tokens) & (mass >= share) & (mass >= SINK_SET_CONCENTRATION * size / dist.shape[-1])
    return top & parked


def consensus_sinks(dist: torch.Tensor, share: float = 0.5, quorum: float = 0.25, tokens: int = 8) -> torch.Tensor:
    """Attention-consensus sink test (docs/method.md §10): `dist [..., heads, visual]` -> bool `[..., visual]`: the
    tokens in the parked set (`parked_sets`: a head's top tokens, at most `tokens` of them, holding at least
    `share` of its visual attention together) of at least `quorum` of the heads. tokens=1: a head parks on one
    token only (the test before issue 47, which missed a sink split over several tokens)."""
    return parked_sets(dist, share, tokens).float().mean(-2) >= quorum


def detect_sinks(detector: str, visual_hidden: torch.Tensor, attn: torch.Tensor, row_valid: torch.Tensor,
                 rho: float, share: float, quorum: float, tokens: int = 8) -> torch.Tensor:
    """Sink tokens of one layer, bool `[batch, visual]`: by the norm test (`sink_tokens`, rho), by attention
    consensus over the layer's heads (`consensus_sinks` of `visual_distribution(attn, row_valid)`: share, quorum,
    tokens), or by either ("both"). visual_hidden [batch, visual, d]; attn [batch, heads, P, visual]; row_valid
    [batch, P]."""
    found = torch.zeros(attn.shape[0], attn.shape[-1], dtype=torch.bool, device=attn.device)
    if detector in ("norm", "both"):
        found |= sink_tokens(visual_hidden, rho).to(attn.device)
    if detector in ("consensus", "both"):
        found |= consensus_sinks(visual_distribution(attn, row_valid), share, quorum, tokens)
    return found


def _row_mean(x: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """Mean of `x [..., batch, heads, prompt]` over the valid rows -> `[..., batch, heads]`."""
    w = row_valid[:, None, :].to(x.dtype)
    return (x * w).sum(-1) / w.sum(-1).clamp_min(1.0)


def visual_distribution(attn: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """Where each head looks in the image: rows renormalised over the visual tokens, then averaged over
    the valid rows. attn [batch, heads, P, visual] -> [batch, heads, visual], summing to 1."""
    a = attn.float() / attn.float().sum(-1, keepdim=True).clamp_min(_EPS)
    w = row_valid[:, None, :, None].to(a.dtype)
    return (a * w).sum(2) / w.sum(2).clamp_min(1.0)


def head_stats(attn: torch.Tensor, row_valid: torch.Tensor, sink: torch.Tensor) -> HeadStats:
    """PAQ and its parts for every head.

    attn [batch, heads, prompt, visual]; row_valid bool [batch, prompt]; sink bool [batch, visual].
    With at most one non-sink token the dispersion is 0 (one token is perfectly focused). One pass over the
    rows without renormalising them: with y the row restricted to the non-sink tokens and Z its sum, the
    entropy of b = y / Z is log Z - sum(y log y) / Z (0 where Z = 0).
    """
    attn = attn.float()
    mass = attn.sum(-1)  # [B, H, P] the row's visual share
    if bool(sink.any()):
        y = attn * (~sink)[:, None, None, :].to(attn.dtype)
        free_mass = y.sum(-1)
    else:
        y, free_mass = attn, mass
    sink_mass = (mass - free_mass) / torch.where(mass > 0, mass, 1.0)  # share of the row's visual attention on sinks
    z = torch.where(free_mass > 0, free_mass, 1.0)  # the unfloored mass: a row can hold 1e-31 of its head's attention
    entropy = torch.where(free_mass > 0, z.log() - torch.special.xlogy(y, y).sum(-1) / z, 0.0)  # [B, H, P]
    free = (~sink).sum(-1).to(attn.dtype)  # [B] non-sink tokens
    norm_entropy = entropy / free.clamp_min(2).log()[:, None, None] * (free > 1)[:, None, None]
    norm_entropy = norm_entropy.clamp(0.0, 1.0)  # per row: float error on one row must not drag the head's mean
    sigma, delta, mu = _row_mean(torch.stack([sink_mass, norm_entropy, mass]), row_valid)  # each [B, H]
    return HeadStats(sink_share=sigma, dispersion=delta, visual_share=mu, paq=(1 - sigma) * (1 - delta))


def classify(stats: HeadStats, tau_sink: float, tau_disp: float) -> list[list[list[str]]]:
    """Head class per `[batch][head]`: sink if sigma >= tau_sink, else dispersed if delta >= tau_disp,
    else optimal."""
    sink = stats.sink_share >= tau_sink
    dispersed = stats.dispersion >= tau_disp
    out = []
    for b in range(sink.shape[0]):
        out.append(
            [SINK if s else DISPERSED if d else OPTIMAL for s, d in zip(sink[b].tolist(), dispersed[b].tolist())]
        )
    return out

