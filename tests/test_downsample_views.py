"""`downsample` per view on the tiled and block families (hap/pruners/downsample.py, docs/method.md §7): LLaVA-NeXT,
LLaVA-OneVision, InternVL, SmolVLM / Idefics3 and Gemma 3 run through `hap.run` on tiny random models. The view
geometry, the budget's split, the pooled grids, the windows' first patches, the slots and the pooled vectors are
written here from the rule in the docs, not through the code under test: each view's grid is read off the stock
prompt (LLaVA-NeXT's newline tokens found by their learned vector) and the expected layer-0 input is built from the
stock run's."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import hap
from hap.planning.flops import prefill_flops
from hap.patch.decoder import decoder_of, decoder_shape
from tiny_zoo import llava_next, llava_onevision, picture
from tiny_zoo_more import idefics3, internvl
from tiny_zoo_recent import gemma3

QUESTION = "what is in the image ?"
RETAIN = 0.3
CASES = {  # family -> (builder, (height, width) of an image giving several views)
    "llava-next": (llava_next, (112, 168)),
    "llava-onevision": (llava_onevision, (336, 280)),
    "internvl": (internvl, (112, 336)),
    "smolvlm": (lambda: idefics3(smolvlm=True), (128, 96)),
    "gemma3": (lambda: pan_and_scan(*gemma3()), (100, 300)),  # the whole image and 3 crops: 4 blocks of 4 x 4
}


def pan_and_scan(model, processor):
    """Gemma 3 with the processor's pan-and-scan on (crops of at least 56 px: the tiny model's images are small)."""
    processor.images_kwargs = {**processor.images_kwargs, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 56}
    return model, processor


def shares(budget: int, sizes: list[int]) -> list[int]:
    """The documented split: floor(b n_v / N) each, the rest one by one by largest remainder, ties to the earlier."""
    total = sum(sizes)
    exact = [Fraction(budget * n, total) for n in sizes]
    out = [math.floor(e) for e in exact]
    for v in sorted(range(len(sizes)), key=lambda v: (out[v] - exact[v], v))[:budget - sum(out)]:
        out[v] += 1
    return out


def pooled_grid(h: int, w: int, k: int) -> tuple[int, int]:
    """The documented grid rule by brute force: rows x cols <= k, short of it by less than a row, closest aspect."""
    if k >= h * w:
        return h, w
    fits = [(r, c) for r in range(1, h + 1) for c in range(1, w + 1) if k - c < r * c <= k]
    return min(fits, key=lambda rc: (abs(math.log(rc[0] / rc[1]) - math.log(h / w)), -rc[0] * rc[1], -rc[0]))


def geometry(model, ids: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(the sequence positions of the pruner's visual tokens, each view's (rows, cols) in token order) of the stock
    prompt `ids` [T] whose layer-0 input is `embeds` [T, D]."""
    image = (ids == model.config.image_token_id).nonzero()[:, 0]
    name = type(model).__name__
    if name.startswith("Llava"):
        side = model.config.vision_config.image_size // model.config.vision_config.patch_size
        newline = (embeds[image] == model.model.image_newline.to(embeds)).all(-1)
        rows = int(newline.sum())
        cols = (len(image) - side * side - rows) // rows
        assert newline.nonzero()[:, 0].tolist() == [side * side + r * (cols + 1) + cols for r in range(rows)]
        return image[~newline], [(side, side), (rows, cols)]
    side = {"InternVLForConditionalGeneration": 4, "SmolVLMForConditionalGeneration": 4,
            "Gemma3ForConditionalGeneration": 4}[name]
    return image, [(side, side)] * (len(image) // side ** 2)


def layer0_inputs(model, processor, image, config) -> tuple[hap.Result, torch.Tensor, torch.Tensor]:
    """(the result, the prompt ids [T], the hidden states [T', D] entering decoder layer 0 in the prefill)."""
    seen = {}

    def ids_hook(module, args, kwargs):
        seen.setdefault("ids", kwargs.get("input_ids", args[0] if args else None))

    def layer_hook(module, args, kwargs, output):
        seen.setdefault("hidden", args[0] if args else kwargs["hidden_states"])

    handles = [model.model.register_forward_pre_hook(ids_hook, with_kwargs=True),
               decoder_of(model).layers[0].register_forward_hook(layer_hook, with_kwargs=True)]
    try:
        result = hap.run(model, processor, image, QUESTION, config, max_new_tokens=1)
    finally:
        for h in handles:
            h.remove()
    return result, seen["ids"][0], seen["hidden"][0]


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    build, size = CASES[request.param]
    model, processor = build()
    image = picture(size)
    stock, ids, embeds = layer0_inputs(model, processor, image, hap.HAPConfig(method="none"))
    pruned, pruned_ids, entering = layer0_inputs(model, processor, image, hap.HAPConfig(method="downsample",
                                                                                        retain=RETAIN))
    assert torch.equal(ids, pruned_ids)
    return model, ids, embeds, pruned, entering


def expected(model, ids, embeds):
    """(kept visual indices, pooled count, budget, rows per view, the layer-0 input [T', D]) by the documented rule."""
    visual, views = geometry(model, ids, embeds)
    N = len(visual)
    budget = math.floor(RETAIN * N + 1e-9)
    assert len(views) > 1 and sum(h * w for h, w in views) == N
    kept, slots, vectors, cols_of = [], [], [], []
    start = 0
    for (h, w), k in zip(views, shares(budget, [h * w for h, w in views])):
        if k:
            r, c = pooled_grid(h, w, k)
            grid = embeds[visual[start:start + h * w]].view(h, w, -1).permute(2, 0, 1).float()
            vectors.append(F.adaptive_avg_pool2d(grid, (r, c)).flatten(1).T)
            kept += [start + (i * h // r) * w + j * w // c for i in range(r) for j in range(c)]
            slots += [start + i * w + j for i in range(r) for j in range(c)]
            cols_of.append(c)
        start += h * w
    keep = torch.ones(len(ids), dtype=torch.bool)  # the text, markers and newlines, and each pooled token's slot
    keep[visual] = False
    keep[visual[slots]] = True
    sequence = embeds.clone()
    sequence[visual[slots]] = torch.cat(vectors).to(embeds)
    return kept, budget, cols_of, sequence[keep], N


def test_each_view_is_pooled_to_its_share_and_reported_at_its_windows_first_patches(case):
    model, ids, embeds, result, entering = case
    kept, budget, cols, sequence, N = expected(model, ids, embeds)
    assert result.num_visual == N
    assert result.groups[0].kept == kept
    assert budget - sum(cols) < len(kept) <= budget  # within one pooled row per view of the budget
    assert entering.shape == sequence.shape
    torch.testing.assert_close(entering, sequence, rtol=1e-5, atol=1e-5)


def test_retain_and_flops_are_the_pooled_count(case):
    model, ids, embeds, result, entering = case
    count, N, L = len(result.groups[0].kept), result.num_visual, result.num_layers
    shape = decoder_shape(model)
    assert result.visual_per_layer == [count] * L
    assert result.retain == pytest.approx(count / N)
    assert result.flops_ratio == pytest.approx(prefill_flops([count] * L, result.text_tokens, shape)
                                               / prefill_flops([N] * L, result.text_tokens, shape))


def test_the_split_and_the_pooled_views_follow_the_rule_on_random_geometries():
    """`pool_views` against the rule written here, on random view grids and budgets, down to budgets below the number
    of views (a view whose share is 0 keeps no token)."""
    from hap.pruners.downsample import pool_views

    rng = torch.Generator().manual_seed(0)
    for _ in range(60):
        views = [tuple(torch.randint(1, 7, (2,), generator=rng).tolist()) for _ in range(int(torch.randint(1, 5, (1,),
                                                                                                   generator=rng)))]
        N = sum(h * w for h, w in views)
        budget = int(torch.randint(1, N + 2, (1,), generator=rng))
        tokens = torch.randn(N, 3, generator=rng)
        pooled, first, slots = pool_views(tokens, tuple(views), budget)
        want_pooled, want_first, want_slots, start = [], [], [], 0
        for (h, w), k in zip(views, shares(min(budget, N), [h * w for h, w in views])):
            if k:
                r, c = pooled_grid(h, w, k)
                grid = tokens[start:start + h * w].view(h, w, 3)
                want_pooled += [grid[i * h // r:-(-(i + 1) * h // r), j * w // c:-(-(j + 1) * w // c)].mean((0, 1))
                                for i in range(r) for j in range(c)]
                want_first += [start + (i * h // r) * w + j * w // c for i in range(r) for j in range(c)]
                want_slots += [start + i * w + j for i in range(r) for j in range(c)]
            start += h * w
        assert first.tolist() == want_first and slots.tolist() == want_slots
        torch.testing.assert_close(pooled, torch.stack(want_pooled))
        assert 0 < len(want_first) <= min(budget, N)
