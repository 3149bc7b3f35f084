"""PruneSID's selection rule (ICLR 2026; official ZhengyaoFang/PruneSID, `prunesid/prunesid_llava/clip_encoder.py`
`CLIPVisionTower_PruneSID.forward`, `batch_pca`, `batch_similarity_nms`), docs/method.md §7.

Before the decoder, once per image, from the vision tower's layer -2 (HF `attentions[-2]`, `hidden_states[-2]`,
[CLS] included; hard-coded officially, LLaVA's feature layer on every checkpoint it runs: here the model's feature
layer, whose states the projector maps), for a budget of K tokens ([CLS] one of them):
- a_i: the [CLS] row's attention to patch i, **summed** over heads;
- groups: the principal components of sigmoid(H) over the patches (H^T [Dv, N], each patch's column centred over its
  Dv features), q = int(K / 4) of them (at most min(Dv, N), the rank the states allow: the official PCA raises past
  it, which no CLIP-L budget reaches); patch i joins the component of largest |V[i, c]|. The official PCA is
  `torch.pca_lowrank` (randomised, niter 2), which agrees with an exact one on only part of the groups; here the
  exact, deterministic decomposition (`torch.linalg.svd`);
- NMS inside each group: threshold (K / 32) x the mean pairwise cosine of the patches (i < j); repeatedly the group's
  best remaining attention is picked and the group members more similar to it than the threshold leave;
- quotas: lower = min(1, size), upper = min(5 ceil(K / 64), size, NMS count), raised by one (capped at the size)
  until it sums to K; other = K - sum(lower) - 1 (one slot for [CLS]) shared by cumulative rounding (half to even)
  of the NMS counts' shares; each quota = min(lower + its share, upper); the shortfall filled in descending NMS count
  (ties to the lower group; `argsort` officially);
- inside a group: its NMS picks in pick order, then its other patches by attention.
Kept: exactly K tokens, [CLS] first, then group by group, each projected from the feature layer (the official order,
written into the first K slots, `Selection.tokens`). Float32 throughout (the official features are fp16).

Refused on LLaVA-NeXT: the official LLaVA-NeXT path keeps K tokens per crop (the whole image keeps crops x K, each
crop's [CLS] appended after the tiles) and places the tiles' picks on the stitched grid without unpadding, a budget
and a packing the HF model's sequence does not hold.
"""

from __future__ import annotations

import math

import torch

from .base import BeforeDecoder, Selection

MIN_TOKENS = 4  # [CLS] and at least one group: q = int(K / 4) >= 1


def group_of(hidden: torch.Tensor, components: int) -> torch.Tensor:
    """Each patch's group: hidden [1 + N, Dv] ([CLS] first) -> long [N], the principal component (the first
    `components`, at most min(Dv, N)) of sigmoid(hidden)^T's patch columns, each centred over its features, with the
    largest |loading|."""
    x = torch.sigmoid(hidden.float()).T[:, 1:]  # [Dv, N]
    x = x - x.mean(dim=0, keepdim=True)
    loadings = torch.linalg.svd(x, full_matrices=False).Vh[:min(components, *x.shape)].T.abs()  # [N, q]
    return loadings.argmax(-1)


def group_nms(sim: torch.Tensor, scores: torch.Tensor, members: torch.Tensor, threshold: float) -> torch.Tensor:
    """One group's NMS picks in pick order: sim [N, N], scores [N] (> 0), members long [n] -> long [m]."""
    left = torch.zeros_like(scores)
    left[members] = scores[members]
    picks = []
    while bool((left > 0).any()):
        best = int(left.argmax())
        picks.append(best)
        left[best] = 0
        left[sim[best] > threshold] = 0
    return torch.tensor(picks, dtype=torch.long, device=scores.device)


def quotas(sizes: torch.Tensor, nms: torch.Tensor, k: int) -> torch.Tensor:
    """Each group's count: sizes, nms long [G] (its patches, its NMS picks), budget k ([CLS] included) -> long [G]
    summing to k - 1."""
    lower = sizes.clamp(max=1)
    upper = torch.minimum(torch.minimum(torch.full_like(sizes, 5 * math.ceil(k / 64)), sizes), nms)
    while int(upper.sum()) < k:
        upper = torch.minimum(upper + 1, sizes)
    other = max(k - int(lower.sum()) - 1, 0)
    cumulative = torch.cumsum(nms.float() / nms.sum().float(), 0)
    share = (cumulative * other).round().long()
    share = share - torch.cat([share.new_zeros(1), share[:-1]])
    counts = torch.minimum(share + lower, upper)
    target, order = other + int(lower.sum()), torch.sort(nms, descending=True, stable=True).indices
    for g in order.tolist():
        if int(counts.sum()) >= target:
            break
        counts[g] += min(int(upper[g] - counts[g]), target - int(counts.sum()))
    return counts


def diverse_select(attention: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """PruneSID's `k` tokens of one image: attention [N] ([CLS] row summed over heads, patches), hidden [1 + N, Dv]
    -> long [k] indices into hidden ([CLS] = 0 first, then group by group in the official order)."""
    n = attention.shape[0]
    if not MIN_TOKENS <= k <= n:
        raise ValueError(f"prunesid: k={k} must lie in {MIN_TOKENS}..{n} ([CLS] and the image's patches)")
    groups = group_of(hidden, k // 4)
    count = min(k // 4, *hidden[1:].shape)
    unit = torch.nn.functional.normalize(hidden[1:].float(), dim=-1)
    sim = unit @ unit.T
    upper = torch.triu(torch.ones_like(sim, dtype=torch.bool), diagonal=1)
    threshold = float(k / 32 * sim[upper].mean())
    scores = attention.float()
    members = [(groups == g).nonzero()[:, 0] for g in range(count)]
    picks = [group_nms(sim, scores, m, threshold) for m in members]
    counts = quotas(torch.tensor([len(m) for m in members]), torch.tensor([len(p) for p in picks]), k)
    chosen = [torch.zeros(1, dtype=torch.long, device=scores.device)]
    for m, p, c in zip(members, picks, counts.tolist()):
        rest = m[~torch.isin(m, p)]
        rest = rest[torch.sort(scores[rest], descending=True, stable=True).indices]
        chosen.append(torch.cat([p, rest])[:c] + 1)
    return torch.cat(chosen)


class PruneSID(BeforeDecoder):
    """One selection before the first decoder layer from the tower's feature layer: groups, NMS and quotas, [CLS]
    kept."""

    name = "prunesid"
    cls_cues = True
    min_tokens = MIN_TOKENS
    writes_tokens = True

    def refuses(self, family):
        if family == "llava_next":
            return ("its official LLaVA-NeXT code keeps K tokens per crop (each crop's [CLS] among them) and places "
                    "the tiles' picks on the stitched grid without unpadding, a budget and a packing the model's "
                    "sequence does not hold")
        return None

    def select(self, state, cut):
        cues, k = state.cues(), state.kept_count(cut.index)
        hidden = cues.features  # [B, 1 + N, Dv]
        chosen = torch.stack([diverse_select(a, h, k) for a, h in zip(cues.cls_attention, hidden)])
        tokens = cues.project(hidden.gather(1, chosen[..., None].expand(-1, -1, hidden.shape[-1])))
        slots = torch.arange(k, device=state.visual_pos.device).expand(chosen.shape[0], -1)
        return Selection(slots, tokens=tokens, patches=(chosen[:, 1:] - 1).to(state.visual_pos.device))


PRUNER = PruneSID
