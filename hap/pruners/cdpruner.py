"""CDPruner's selection rule (NeurIPS 2025, conditional diversity; official Theia-4869/CDPruner, `llava_arch.py`
`encode_images`, `clip_encoder.py` `forward`), docs/method.md §7.

Before the decoder, once per image (LLaVA-NeXT: once per crop, the relevance normalised over all crops jointly):
- similarity S[i, j]: cosine of the projected visual tokens i and j, in float32;
- relevance r_i: with e_i = CLIP's visual projection of the tower's post-layernorm of feature-layer patch i and one
  CLIP text embedding t_m per 77-id row of the question, r_i = mean over m of **minus** cos(e_i, t_m) (the sign is
  the official one), then r = (r - min r + 1e-6) / (max r - min r);
- kernel L = diag(r) S diag(r); the kept tokens are the greedy MAP of the DPP on L (the fast Cholesky-style
  update): d2 = diag(L); k times: j = argmax d2 (lowest index on ties), e = (L[j] - sum_s c_s[j] c_s) / sqrt(d2_j),
  d2 -= e^2, d2_j = -inf. Kept: the k picks in raster order.

Past the kernel's numerical rank (at most min(N, projector width)), the official loop divides by sqrt(~0) and yields
NaN or arbitrary repeated picks. Here that is refused: `select` raises a ValueError naming the count and the limit
as soon as the pick it would take is numerically spanned by the earlier ones (its residual below `RANK_TOL` of its
own kernel diagonal, or not positive); callers can check `rank_limit` before any work with the model.

The pruner (`CDPruner`) runs the rule on the shared executor, on the projected tokens and the tower's CLIP cues.
"""

from __future__ import annotations

import torch

from .base import BeforeDecoder, Selection
from .vispruner import per_crop

ROW = 77  # CLIP's text context: the question is cut into rows of this many ids
RANK_TOL = 1e-4  # a pick whose residual d2 is below this share of its own L[j, j] is numerically spanned


def rank_limit(n: int, width: int) -> int:
    """The most tokens the DPP can pick of `n` projected tokens `width` wide (the kernel's rank bound)."""
    return min(n, width)


def relevance(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """Relevance of each visual token to the question, min-max normalised.

    image_embeds [..., N, E] (CLIP image embeddings of the patches; a stack [crops, N, E] is normalised jointly over
    every token of every crop, as LLaVA-NeXT's crops are), text_embeds [M, E] (one per 77-id row of the question)
    -> [..., N] in float32: the mean over rows of minus the cosine, mapped by (r - min + 1e-6) / (max - min).
    """
    image = image_embeds.float() / image_embeds.float().norm(dim=-1, keepdim=True)
    text = text_embeds.float() / text_embeds.float().norm(dim=-1, keepdim=True)
    r = (-(image @ text.T)).mean(dim=-1)
    return (r - r.min() + 1e-6) / (r.max() - r.min())


def kernel(tokens: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """L = diag(r) S diag(r) in float32, S the cosine similarities of `tokens [N, D]` (normalised in their own
    dtype, then cast, as the official code does) -> [N, N]."""
    unit = (tokens / tokens.norm(dim=-1, keepdim=True)).float()
    r = relevance.float()
    return r[:, None] * (unit @ unit.T) * r[None, :]


def select(tokens: torch.Tensor, relevance: torch.Tensor, k: int) -> torch.Tensor:
    """CDPruner's `k` kept tokens of one image (or crop).

    tokens [N, D] (the projected visual tokens), relevance [N] (`relevance` of the same tokens) -> long [k],
    ascending. ValueError when k exceeds the kernel's numerical rank (see the module docstring).
    """
    n, width = tokens.shape
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must lie in 0..{n} (the image's visual tokens)")
    if k > rank_limit(n, width):
        raise ValueError(f"cdpruner: k={k} exceeds the kernel's rank: at most {rank_limit(n, width)} tokens "
                         f"(N={n} tokens of width {width})")
    L = kernel(tokens, relevance)
    diag = L.diagonal().clone()
    d2 = diag.clone()
    c = L.new_zeros(k, n)
    picks = torch.empty(k, dtype=torch.long, device=tokens.device)
    for i in range(k):
        j = int(d2.argmax())
        if not d2[j] > RANK_TOL * diag[j]:
            raise ValueError(f"cdpruner: k={k} exceeds the kernel's numerical rank: only {i} of the {n} tokens are "
                             f"independent (width {width}); use a budget of at most {i}")
        picks[i] = j
        e = (L[j] - c[:i, j] @ c[:i]) / d2[j].sqrt()
        c[i] = e
        d2 -= e.square()
        d2[j] = -torch.inf
    return picks.sort().values


def text_rows(ids: list[int], row: int = ROW) -> torch.Tensor:
    """The question's CLIP ids (BOS and EOS included), zero-padded to a multiple of `row` and cut into rows ->
    long [rows, row]; the official ceil(len / row) rows (at least one)."""
    rows = max(1, -(-len(ids) // row))
    padded = torch.zeros(rows * row, dtype=torch.long)
    padded[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    return padded.view(rows, row)


@torch.no_grad()
def question_embeddings(model, tokenizer, question: str) -> torch.Tensor:
    """One CLIP text embedding per row of the raw question (no chat template, no answer-format suffix) -> [M, E].

    `model`: a CLIP model with `text_model` and `text_projection` (`hap.hub.load_clip`); `tokenizer`: its
    tokenizer. The question is tokenised with BOS/EOS and no truncation, zero-padded to a multiple of the text
    tower's context (77), the attention mask zero on the padding; each row goes through the text tower and the
    text projection (its pooled output, as CLIPTextModelWithProjection's `text_embeds`).
    """
    ids = tokenizer(question, truncation=False)["input_ids"]
    row = model.config.text_config.max_position_embeddings
    device = model.text_projection.weight.device
    input_ids = text_rows(ids, row).to(device)
    mask = text_rows([1] * len(ids), row).to(device)
    pooled = model.text_model(input_ids=input_ids, attention_mask=mask).pooler_output
    return model.text_projection(pooled)


class CDPruner(BeforeDecoder):
    """One selection before the first decoder layer over the projected visual tokens, conditioned on the raw
    question: the relevance of CLIP's projection of the tower's own feature-layer patches (`VisionCues.image_embeds`,
    the `clip_model` knob's checkpoint) to the question's CLIP text embeddings (`State.question`, `embed_question`)."""

    name = "cdpruner"
    cls_cues = True
    crops = True
    clip = True
    embeds = True

    def embed_question(self, clip, question):
        """The question's CLIP text embeddings, one per 77-id row (`question_embeddings`)."""
        return question_embeddings(*clip, question)

    def select(self, state, cut):
        cues, k = state.cues(), state.kept_count(cut.index)
        if state.question is None:
            raise ValueError("method='cdpruner' needs the raw question: hap.patched(model, config, question=...) "
                             "(hap.run passes the prompt)")
        text = state.question.to(cues.image_embeds.device)
        if cues.places is not None:  # LLaVA-NeXT: per crop, the relevance normalised over all crops of the image
            def pick(crops, t):
                tokens = cues.project(cues.features[crops, 1:])  # [crops, n, D] each crop's projected patches
                r = relevance(cues.image_embeds[crops], text).to(tokens.device)
                return torch.stack([select(x, rel, t) for x, rel in zip(tokens, r)])

            chosen = per_crop(cues.places, k, pick)
        else:
            chosen = torch.stack([select(tokens, relevance(image, text).to(tokens.device), k)
                                  for tokens, image in zip(cut.embeds, cues.image_embeds)])
        return Selection(chosen.to(state.visual_pos.device))


PRUNER = CDPruner
