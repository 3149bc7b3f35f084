"""HAWK (CVPR 2026, arXiv 2604.07812; its code peppery77/HAWK, `src/hawk/pruning.py`): static head importance times
text-guided attention, one cut before layer 0 (docs/method.md §7, §16).

Before the decoder runs, layer 0's input norm and q, k projections are applied to the input embeddings *without*
RoPE (grouped keys serve their query heads); per head, the question's tokens' q.k / sqrt(d) over the visual tokens
is averaged over those tokens (rows="question": after the image, before the chat template's tail), NaN and inf set to
0 and L2-normalised over the visual tokens; the heads are summed with layer 0's static weights (the `head_importance`
file, each layer's row summing to 1) and the top k kept in their original order, with their original positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import importance
from .base import Pruner

_EPS = 1e-12  # torch.nn.functional.normalize's floor on the norm, as the official code normalises


def hawk_scores(logits: torch.Tensor, row_valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """HAWK's token scores: `logits [batch, heads, P, visual]` the rows' q.k / sqrt(d) (pre-RoPE), `row_valid` bool
    [batch, P] the question's rows, `weights [batch, heads]` the heads' static weights -> `[batch, visual]`: per head
    the mean over the valid rows, NaN / inf -> 0, L2-normalised over the visual tokens, summed with the weights."""
    valid = row_valid[:, None, :, None].to(torch.float32)
    rows = logits.float().nan_to_num(0.0, posinf=0.0, neginf=0.0) * valid  # a masked key's -inf never reaches the mean
    mean = rows.sum(2) / valid.sum(2).clamp_min(1)  # [B, H, V]
    mean = mean.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    unit = mean / mean.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    return (unit * weights.to(unit)[:, :, None]).sum(1)


@dataclass(frozen=True)
class Hawk(Pruner):
    importance: str | None = None  # the static head importance file (the `head_importance` knob)

    name = "hawk"
    fixed_rows = "question"
    fixed_cuts = 1
    before_decoder = True
    logits = True

    @classmethod
    def from_config(cls, config):
        return cls(1, "question", first_cut="prerope", importance=config.head_importance)

    @property
    def static_heads(self) -> bool:
        return True

    def head_weights(self, paq, visual_share, layers):
        """The static weights of the scoring layer's heads (layer 0's), as reported with the run."""
        return importance.static_weights(self.importance, layers, paq)

    def scores(self, state, cut):
        """`hawk_scores` of layer 0's pre-RoPE logits with its static head weights (`cut.weights`, the ones reported
        with the run)."""
        return hawk_scores(cut.logits[:, 0], state.row_valid.to(cut.logits.device), cut.weights[:, 0])


PRUNER = Hawk
