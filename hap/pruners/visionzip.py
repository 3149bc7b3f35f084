"""VisionZip before the decoder, as its official code selects and merges (docs/method.md §7).

On the vision tower's feature layer (the layer whose output LLaVA projects):
- dominant: the [CLS] token takes one slot, the other `dominant - 1` slots go to the patches the
  [CLS] row attends to most (summed over heads);
- contextual: of the R remaining patches, the targets are every `step`-th one, `step = max(1, R // c)`
  (the first c of them); every other remaining patch joins the target whose key (averaged over heads,
  L2-normalised) is most similar; a contextual token is the target's feature **plus the mean** of its
  members' features, on the tower's features before the projector.
The decoder receives one block in this order, [CLS, dominant patches ascending, contextual tokens in target
order], projected like any image feature, at consecutive positions. The tokens stay in every layer, so the
layer-averaged retained count is simply dominant + contextual.

Pure tensor functions, then the pruner (`VisionZip`): one cut before the decoder, positions renumbered 0..T'-1 as
the official decoder only sees the shorter sequence; the adapter supplies the cues (`hap.pruners.cues.VisionCues`) of one
prefill.
"""

from __future__ import annotations

import torch

from .base import BeforeDecoder, Selection
from .cues import VisionCues

DOMINANT_SHARE = 54 / 64  # the published 54 dominant ([CLS] included) + 10 contextual split of 64 tokens
MIN_TOKENS = 2  # [CLS] and one image token: [CLS] alone would leave the decoder no patch of the image


def split_budget(k: int, dominant_share: float = DOMINANT_SHARE) -> tuple[int, int]:
    """(dominant, contextual) slots for a budget of `k` >= MIN_TOKENS tokens, [CLS] counted among the dominant ones:
    at least one dominant slot and one contextual one."""
    if k < MIN_TOKENS:
        raise ValueError(f"a VisionZip budget needs at least {MIN_TOKENS} tokens ([CLS] and one image token); "
                         f"got k={k}")
    dominant = min(k - 1, max(1, round(k * dominant_share)))
    return dominant, k - dominant


def dominant_tokens(cls_attention: torch.Tensor, k: int) -> torch.Tensor:
    """Top-`k` patches by [CLS] attention: `cls_attention [batch, N]` -> long `[batch, k]`, ascending."""
    order = torch.sort(cls_attention.float(), dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=-1).values


def contextual_targets(remaining: int, k: int) -> torch.Tensor:
    """Positions in the list of `remaining` non-dominant patches that become the `k` contextual targets: every
    `max(1, remaining // k)`-th one from the first -> long [k]."""
    if k > remaining:
        raise ValueError(f"{k} contextual tokens need at least {k} non-dominant patches; there are {remaining}")
    return torch.arange(0, remaining, max(1, remaining // k))[:k]


def contextual_tokens(keys: torch.Tensor, features: torch.Tensor, dominant: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the non-dominant patches into `k` contextual tokens.

    keys [batch, N, d] (for similarity), features [batch, N, Dv] (the patches' tower features), dominant long
    [batch, n_dom]. Returns (targets long [batch, k]: the patch of each contextual token, ascending; merged
    [batch, k, Dv]: each target's feature plus the mean feature of the remaining patches that joined it).
    """
    B, N, _ = keys.shape
    if k == 0:
        return dominant.new_zeros(B, 0), features.new_zeros(B, 0, features.shape[-1])
    rest_mask = torch.ones(B, N, dtype=torch.bool, device=keys.device)
    rest_mask.scatter_(1, dominant, False)
    rest = rest_mask.nonzero()[:, 1].view(B, -1)  # [B, R] ascending
    pick = contextual_targets(rest.shape[1], k).to(keys.device)
    is_target = torch.zeros(rest.shape[1], dtype=torch.bool, device=keys.device)
    is_target[pick] = True
    targets, members = rest[:, pick], rest[:, ~is_target]  # [B, k], [B, R - k]
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = _rows(unit, members) @ _rows(unit, targets).transpose(1, 2)  # [B, R - k, k]
    assign = torch.nn.functional.one_hot(sim.argmax(-1), k).to(features.dtype)  # [B, R - k, k]
    mean = assign.transpose(1, 2) @ _rows(features, members) / assign.sum(1).clamp_min(1)[..., None]
    return targets, _rows(features, targets) + mean


def select(cues: VisionCues, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """VisionZip's `k` tokens from one prefill's cues: (patches long [batch, k - 1]: the patch each token after
    [CLS] stands for, dominant ones ascending then the contextual targets; tokens [batch, k, D]: [CLS], the dominant
    patches and the contextual tokens, projected for the decoder)."""
    n_dominant, n_contextual = split_budget(k)
    patches = cues.features[:, 1:]
    dominant = dominant_tokens(cues.cls_attention, n_dominant - 1)
    targets, merged = contextual_tokens(cues.keys, patches, dominant, n_contextual)
    block = torch.cat([cues.features[:, :1], _rows(patches, dominant), merged.to(patches.dtype)], 1)
    return torch.cat([dominant, targets], 1), cues.project(block)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x [batch, N, d]` at `index` long [batch, n] -> [batch, n, d]."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


class VisionZip(BeforeDecoder):
    name = "visionzip"
    cls_cues = True
    min_tokens = MIN_TOKENS
    writes_tokens = True

    def select(self, state, cut):
        """The first k visual slots carry VisionZip's block: [CLS], the dominant patches, the contextual tokens."""
        k = state.kept_count(cut.index)
        patches, tokens = select(state.cues(), k)
        chosen = torch.arange(k, device=state.visual_pos.device).expand(state.visual_pos.shape[0], -1)
        return Selection(chosen, tokens=tokens, patches=patches)


PRUNER = VisionZip
