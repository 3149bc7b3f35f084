"""Recycling of dropped visual tokens into cluster means, as SparseVLM's and AutoPrune's official code does after
each drop (docs/method.md §7; `notes/autoprune-sparsevlm.md`, "Recycling").

Of the n visual tokens a cut drops, the top `int(0.3 n) + 1` by the cut's own score are clustered by DPC-kNN
(density peaks over the k = c nearest neighbours) into `c = int(m / 10) + 1` groups (m the candidates), and each
group becomes one token: the plain mean of its members' hidden states (the layer's output, i.e. the states entering
the next layer). The c tokens go right after the kept visual tokens, in the order the centres were picked (highest
density x parent distance first), and count as visual tokens from then on.

The official code adds 1e-6 x uniform noise to the densities to break ties; it is left out here (deterministic).
In the official fp16 runs that noise is below the resolution of the densities, so ties stand there as here (e.g. with
k = 2 a mutually nearest pair has equal densities, and both may become centres).

Pure tensor functions on one sample's tokens: the batch loops in the pruner, whose batches recycle equal counts.
"""

from __future__ import annotations

import torch

RECYCLE_SHARE = 0.3  # of the dropped tokens, the top share by score that is clustered
CLUSTER_SIZE = 10  # candidates per recycled token


def candidate_count(dropped: int) -> int:
    """Dropped tokens clustered after a drop of `dropped` (> 0): `int(0.3 dropped) + 1`."""
    return int(dropped * RECYCLE_SHARE) + 1


def cluster_count(dropped: int) -> int:
    """Recycled tokens a drop of `dropped` visual tokens adds: 0 when nothing is dropped, else
    `int(m / 10) + 1` for the m = `candidate_count(dropped)` candidates."""
    return 0 if dropped <= 0 else candidate_count(dropped) // CLUSTER_SIZE + 1


def dpc_knn(x: torch.Tensor, clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN clustering of `x [n, C]` into `clusters` groups (`cluster_and_merge` of the official utils.py).

    Distances d_ij = ||x_i - x_j|| / sqrt(C); density rho_i = exp(-mean of d^2 over the `clusters` nearest tokens,
    itself included); parent distance delta_i = the distance to the nearest denser token (the largest distance of
    the matrix for the densest); the centres are the top `clusters` tokens by rho x delta, in that order; every
    token joins its nearest centre, a centre itself.
    Returns (centres long [clusters] indices into x, in pick order; assign long [n] each token's cluster 0..c-1).
    """
    x = x.float()
    n, C = x.shape
    dist = torch.cdist(x, x) / C ** 0.5  # [n, n]
    nearest = dist.topk(clusters, dim=-1, largest=False).values
    density = (-(nearest ** 2).mean(-1)).exp()  # [n]
    denser = density[None, :] > density[:, None]  # [i, j]: j denser than i
    parent = torch.where(denser, dist, dist.max()).min(-1).values
    centres = (parent * density).topk(clusters).indices  # [c]
    assign = dist[centres].argmin(0)  # [n]
    assign[centres] = torch.arange(clusters, device=x.device)
    return centres, assign


def cluster_means(x: torch.Tensor, assign: torch.Tensor, clusters: int) -> torch.Tensor:
    """Each cluster's mean: `x [n, C]`, `assign` long [n] -> `[clusters, C]` in x's dtype (the official code divides the
    sum by the count + 1e-6)."""
    sums = torch.zeros(clusters, x.shape[1], device=x.device).index_add_(0, assign, x.float())
    counts = torch.zeros(clusters, device=x.device).index_add_(0, assign, torch.ones_like(assign, dtype=torch.float))
    return (sums / (counts[:, None] + 1e-6)).to(x.dtype)


def recycle(hidden: torch.Tensor, scores: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recycled tokens of one cut over a batch.

    hidden [batch, V, D] the visual tokens' states entering the next layer; scores [batch, V] the cut's scores;
    kept long [batch, k] the kept tokens (every sample keeps k). Returns (tokens [batch, c, D]: the cluster means,
    c = `cluster_count(V - k)`; centres long [batch, c]: each cluster's centre as an index into the V tokens).
    """
    B, V, _ = hidden.shape
    dropped = V - kept.shape[1]
    c = cluster_count(dropped)
    if c == 0:
        return hidden[:, :0], kept[:, :0]
    mask = torch.ones(B, V, dtype=torch.bool, device=hidden.device)
    mask.scatter_(1, kept.to(hidden.device), False)
    tokens, centres = [], []
    for b in range(B):
        pruned = mask[b].nonzero()[:, 0]  # [dropped] ascending
        top = pruned[scores[b].to(hidden.device)[pruned].topk(candidate_count(dropped)).indices]
        centre, assign = dpc_knn(hidden[b, top], c)
        tokens.append(cluster_means(hidden[b, top], assign, c))
        centres.append(top[centre])
    return torch.stack(tokens), torch.stack(centres)
