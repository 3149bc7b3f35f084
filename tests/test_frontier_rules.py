"""The five frontier rules (hap/pruners/{divprune,dart,vispruner,cdpruner,downsample}.py) against independent
references written literally from /work/shared/notes/frontier-pruners.md: plain Python loops over lists, in float64,
as the official code reads (not the project's code path)."""

from __future__ import annotations

import math

import pytest
import torch

from hap.hub import ModelLoadError, load_clip
from hap.pruners import cdpruner, dart, divprune, downsample, vispruner

torch.set_num_threads(1)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def cosine(a: list[float], b: list[float]) -> float:
    return dot(a, b) / math.sqrt(dot(a, a) * dot(b, b))


def first_max(scores: list[float]) -> int:
    """argmax, the lowest index on ties (torch.argmax's rule)."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


# DivPrune ----------------------------------------------------------------------------------------------------------

def ref_divprune(tokens: torch.Tensor, k: int) -> list[int]:
    """The official loop: picked tokens stay in the running (a pick can repeat)."""
    f = tokens.double().tolist()
    n = len(f)
    d = [[1 - cosine(f[i], f[j]) for j in range(n)] for i in range(n)]
    picks: list[int] = []
    for step in range(k):
        if step == 0:
            scores = [sorted(d[i][j] for i in range(n))[1] for j in range(n)]
        else:
            scores = [min(d[s][j] for s in picks) for j in range(n)]
        picks.append(first_max(scores))
    return sorted(picks)


@pytest.mark.parametrize("seed", range(5))
def test_divprune_matches_reference(seed):
    tokens = randn(40, 6, seed=seed) + 0.5
    for k in (1, 7, 20):
        assert divprune.select(tokens, k).tolist() == ref_divprune(tokens, k)


def test_divprune_ties_and_duplicates():
    eye = torch.eye(4)
    tokens = torch.stack([eye[0], eye[1], eye[2], eye[0], eye[1], eye[3]])  # 3, 4 duplicate 0, 1
    # first pick: 2 (its nearest other token is farthest, lowest index among 2 and 5); then 0, 1 (ties), then 5
    for k in range(1, 5):
        assert divprune.select(tokens, k).tolist() == ref_divprune(tokens, k)
    assert divprune.select(tokens, 4).tolist() == [0, 1, 2, 5]
    # beyond the distinct directions the official loop repeats pick 0; here the duplicates fill in, no repeats
    assert ref_divprune(tokens, 6) == [0, 0, 0, 1, 2, 5]
    assert divprune.select(tokens, 6).tolist() == [0, 1, 2, 3, 4, 5]


def test_divprune_count_and_bounds():
    assert [divprune.count(r, 576) for r in (1 / 9, 2 / 9, 1 / 3, 0.098)] == [64, 128, 192, 56]
    assert divprune.select(randn(5, 3, seed=0), 0).tolist() == []
    with pytest.raises(ValueError, match="k=6"):
        divprune.select(randn(5, 3, seed=0), 6)
    with pytest.raises(ValueError, match="ratio"):
        divprune.count(1.5, 10)


# DART --------------------------------------------------------------------------------------------------------------

def ref_dart(keys: torch.Tensor, normed: torch.Tensor, start: int, length: int, t: int, pivots: int = 4,
             order=lambda image, text: list(set(image + text))) -> list[int]:
    """The official `get_retained_image_token` on one image spanning [start, start + length), text after it."""
    l1 = [sum(abs(v) for v in row) for row in keys.double().tolist()]
    h = normed.double().tolist()
    image = sorted(range(start, start + length), key=lambda i: (-l1[i], i))[:pivots]
    text = sorted(range(start + length, len(l1)), key=lambda i: (-l1[i], i))[:pivots]
    valid = set(range(start, start + length)) - set(image)
    kept = set(image)
    for pivot in order(image, text):
        pool = sorted(valid)
        sims = [cosine(h[pivot], h[v]) for v in pool]
        lowest = [pool[i] for i in sorted(range(len(pool)), key=lambda i: (sims[i], pool[i]))[:t]]
        kept.update(lowest)
        valid.difference_update(lowest)
    return sorted(i - start for i in kept)


def dart_case(seed: int, start: int = 3, length: int = 60, after: int = 9):
    total = start + length + after
    keys, normed = randn(total, 8, seed=seed), randn(total, 6, seed=seed + 100)
    return keys, normed, torch.arange(start, start + length), torch.arange(start + length, total)


@pytest.mark.parametrize("seed", range(4))
def test_dart_matches_reference(seed):
    keys, normed, visual, after = dart_case(seed)
    for t in (1, 3, 6):
        kept = dart.select(keys, normed, visual, after, t)
        assert kept.tolist() == ref_dart(keys, normed, 3, 60, t)
        assert len(kept) == dart.kept_count(60, t) == 4 + 8 * t


def test_dart_pivot_order_is_the_official_set_order():
    """Positions past 32 make the set's order differ from sorted and from descending L1; on some seeds the other
    orders keep other tokens, so a wrong order could not pass."""
    differs = 0
    for seed in range(12):
        keys, normed, visual, after = dart_case(seed, start=5, length=40, after=12)
        image = dart.top_l1(keys, visual, 4)
        text = dart.top_l1(keys, after, 4)
        order = dart.pivot_order(image, text)
        assert order == list(set(image + text))
        kept = dart.select(keys, normed, visual, after, 3).tolist()
        assert kept == ref_dart(keys, normed, 5, 40, 3)
        others = (ref_dart(keys, normed, 5, 40, 3, order=lambda i, t: sorted(i + t)),
                  ref_dart(keys, normed, 5, 40, 3, order=lambda i, t: i + t))
        differs += order not in (sorted(image + text), image + text) and all(kept != o for o in others)
    assert differs >= 3


def test_dart_counts_and_edges():
    assert [dart.per_pivot(m) for m in (64, 128, 192)] == [8, 16, 24]
    assert [dart.kept_count(576, dart.per_pivot(m)) for m in (64, 128, 192)] == [68, 132, 196]
    assert dart.per_pivot(320, n=2880) == 40 and dart.per_pivot(320, n=100) == 12  # LLaVA-1.6: min(320, N - 4) / 8
    assert dart.per_pivot_ratio(1000, 0.778) == 27  # Qwen2-VL: int(N (1 - r) / 8)
    keys, normed, visual, after = dart_case(0, length=30)
    # pool exhaustion: 8 pivots x 5 > 26 pool tokens -> every visual token kept
    kept = dart.select(keys, normed, visual, after, 5).tolist()
    assert kept == list(range(30)) == ref_dart(keys, normed, 3, 30, 5)
    assert dart.kept_count(30, 5) == 30
    # two tokens after the image: two text pivots
    kept = dart.select(keys, normed, visual, after[:2], 2)
    assert len(kept) == dart.kept_count(30, 2, after=2) == 4 + 6 * 2
    with pytest.raises(ValueError, match="after_image"):
        dart.select(keys, normed, visual, visual[-3:], 2)


# VisPruner ---------------------------------------------------------------------------------------------------------

def ref_vispruner(attention: torch.Tensor, features: torch.Tensor, k: int, ratio: float = 0.5) -> list[int]:
    """The official loop; an odd residual list keeps every surviving A item (the evident intent)."""
    att = attention.double().tolist()
    unit = [[v / math.sqrt(dot(row, row)) for v in row] for row in features.double().tolist()]
    important = int(k * ratio)
    diverse = k - important
    order = sorted(range(len(att)), key=lambda i: (-att[i], i))
    residual = order[important:]
    while diverse > 0 and len(residual) > diverse:
        r = min(8, len(residual) - diverse)
        a, b = residual[0::2], residual[1::2]
        score = [max(dot(unit[x], unit[y]) for y in b) for x in a]
        ranked = sorted(range(len(a)), key=lambda i: (-score[i], i))
        residual = [a[i] for i in ranked[r:]] + b
    return sorted(order[:important] + (residual if diverse > 0 else []))


@pytest.mark.parametrize("seed", range(4))
def test_vispruner_matches_reference(seed):
    n = 41 + seed
    attention = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    features = randn(n, 6, seed=seed)
    for k, ratio in ((12, 0.5), (13, 0.5), (9, 0.75), (3, 0.5), (20, 0.0), (7, 1.0)):
        kept = vispruner.select(attention, features, k, ratio)
        assert kept.tolist() == ref_vispruner(attention, features, k, ratio)
        assert len(kept) == k


def test_vispruner_odd_residual_and_ties():
    # N=41, k=12: 6 important, residual of 35 (odd) shrinks 35 -> 27 -> 19 -> 11 -> 6; ties in attention
    attention = torch.randint(0, 4, (41,), generator=torch.Generator().manual_seed(1)).float()
    features = randn(41, 5, seed=1)
    kept = vispruner.select(attention, features, 12)
    assert kept.tolist() == ref_vispruner(attention, features, 12)
    top = torch.sort(attention, descending=True, stable=True).indices[:6]
    assert set(top.tolist()) <= set(kept.tolist())  # the important half: highest attention, lowest index on ties
    with pytest.raises(ValueError, match="k=42"):
        vispruner.select(attention, features, 42)


# CDPruner ----------------------------------------------------------------------------------------------------------

def ref_relevance(crops: list[torch.Tensor], text: torch.Tensor) -> list[list[float]]:
    t = text.double().tolist()
    raw = [[-sum(cosine(e, row) for row in t) / len(t) for e in crop.double().tolist()] for crop in crops]
    lo, hi = min(min(r) for r in raw), max(max(r) for r in raw)
    return [[(v - lo + 1e-6) / (hi - lo) for v in r] for r in raw]


def ref_cdpruner(tokens: torch.Tensor, relevance: list[float], k: int) -> list[int]:
    """The official fast greedy MAP of the DPP on diag(r) S diag(r)."""
    f = tokens.double().tolist()
    n = len(f)
    L = [[relevance[i] * cosine(f[i], f[j]) * relevance[j] for j in range(n)] for i in range(n)]
    d2 = [L[i][i] for i in range(n)]
    cs: list[list[float]] = []
    picks = []
    for _ in range(k):
        j = first_max(d2)
        e = [(L[j][m] - sum(c[j] * c[m] for c in cs)) / math.sqrt(d2[j]) for m in range(n)]
        cs.append(e)
        d2 = [d2[m] - e[m] ** 2 for m in range(n)]
        d2[j] = -math.inf
        picks.append(j)
    return sorted(picks)


@pytest.mark.parametrize("seed", range(4))
def test_cdpruner_matches_reference(seed):
    crops = [randn(30, 5, seed=seed), randn(30, 5, seed=seed + 50) + 0.3]
    text = randn(2, 5, seed=seed + 7)
    joint = cdpruner.relevance(torch.stack(crops), text)
    want = ref_relevance(crops, text)
    assert torch.allclose(joint.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert float(joint.min()) == pytest.approx(min(min(r) for r in want), rel=1e-3)  # the +1e-6, not 0
    tokens = randn(30, 12, seed=seed + 3)
    for crop in range(2):
        for k in (1, 6, 12):
            assert cdpruner.select(tokens, joint[crop], k).tolist() == ref_cdpruner(tokens, want[crop], k)


def test_cdpruner_beyond_rank_is_refused():
    tokens, r = randn(20, 4, seed=0), torch.rand(20, generator=torch.Generator().manual_seed(0)) + 0.1
    assert len(cdpruner.select(tokens, r, 4)) == 4 == cdpruner.rank_limit(20, 4)
    with pytest.raises(ValueError, match=r"k=5 .*at most 4"):
        cdpruner.select(tokens, r, 5)
    two = torch.stack([tokens[i % 2] * (1 + i) for i in range(20)])  # two directions: numerical rank 2
    assert len(cdpruner.select(two, r, 2)) == 2
    with pytest.raises(ValueError, match=r"k=3 .*only 2"):
        cdpruner.select(two, r, 3)


def test_text_rows():
    assert cdpruner.text_rows([5, 6, 7]).tolist() == [[5, 6, 7] + [0] * 74]
    rows = cdpruner.text_rows(list(range(1, 79)))
    assert rows.shape == (2, 77) and rows[1, :1].tolist() == [78] and rows[1, 1:].abs().sum() == 0
    assert cdpruner.text_rows(list(range(1, 78))).shape == (1, 77)


# downsample --------------------------------------------------------------------------------------------------------

def ref_pool(grid: torch.Tensor, rows: int, cols: int) -> tuple[list[list[float]], list[int]]:
    """Adaptive average pooling written out: window [floor(i h / rows), ceil((i + 1) h / rows)) per axis."""
    h, w, _ = grid.shape
    g = grid.double().tolist()
    pooled, first = [], []
    for i in range(rows):
        r0, r1 = (i * h) // rows, -(-((i + 1) * h) // rows)
        for j in range(cols):
            c0, c1 = (j * w) // cols, -(-((j + 1) * w) // cols)
            cells = [g[y][x] for y in range(r0, r1) for x in range(c0, c1)]
            pooled.append([sum(v) / len(cells) for v in zip(*cells)])
            first.append(r0 * w + c0)
    return pooled, first


def ref_grid(h: int, w: int, k: int) -> tuple[int, int]:
    """Every admissible (rows, cols): within one row below k, inside the grid; the closest aspect, then the most
    tokens, then the most rows."""
    if k >= h * w:
        return h, w
    fits = [(r, c) for r in range(1, h + 1) for c in range(1, w + 1) if k - c < r * c <= k]
    return min(fits, key=lambda rc: (abs(math.log(rc[0] / rc[1]) - math.log(h / w)), -rc[0] * rc[1], -rc[0]))


def test_downsample_counts_and_windows():
    for h, w in ((24, 24), (7, 13), (16, 9), (3, 40), (1, 5)):
        for k in (1, 2, 5, 17, 36, 64, 100, 575, 10_000):
            rows, cols = downsample.grid(h, w, k)
            assert (rows, cols) == ref_grid(h, w, k)
            assert rows * cols == h * w if k >= h * w else k - cols < rows * cols <= k
    for h, w, k in ((24, 24, 64), (7, 13, 20), (9, 16, 30), (5, 5, 25)):
        grid = randn(h, w, 3, seed=h + w)
        pooled, first = downsample.pool(grid, k)
        want, want_first = ref_pool(grid, *downsample.grid(h, w, k))
        assert first.tolist() == want_first
        assert torch.allclose(pooled.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert downsample.pool(torch.zeros(24, 24, 2), 64)[1][:9].tolist() == [0, 3, 6, 9, 12, 15, 18, 21, 72]


def test_downsample_resized_size_matches_the_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from PIL import Image

    proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, merge_size=2)
    for (height, width), budget in (((480, 640), 100), ((300, 1000), 64), ((1000, 500), 37), ((224, 224), 16)):
        size = downsample.resized_size(height, width, budget, 14, 2, 56 * 56, 28 * 28 * 1280)
        grid = proc(images=Image.new("RGB", size[::-1]), return_tensors="pt")["image_grid_thw"][0]
        tokens, cols = int(grid.prod()) // 4, int(grid[2]) // 2
        assert budget - cols < tokens <= budget
    assert downsample.resized_size(224, 224, 10_000, 14, 2, 56 * 56, 28 * 28 * 1280) == (224, 224)
    with pytest.raises(ValueError, match="budget=1"):
        downsample.resized_size(480, 640, 1, 14, 2, 56 * 56 * 4, 28 * 28 * 1280)


# CLIP loading and the question's embeddings ------------------------------------------------------------------------

WORDS = ["<pad>", "<|startoftext|>", "<|endoftext|>", "<unk>", "what", "colour", "is", "the", "cube", "left", "of",
         "red", "sphere", "?"]


def clip_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=8, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        projection_dim=8)
    folder = tmp_path_factory.mktemp("clip")
    CLIPModel(config).save_pretrained(folder)
    clip_tokenizer().save_pretrained(folder)
    return folder


def test_load_clip_and_question_embeddings(clip_folder):
    model, tokenizer = load_clip(str(clip_folder), device="cpu")
    question = "what colour is the cube left of the red sphere ?"  # 11 words + BOS/EOS = 13 ids: 2 rows of 8
    embeds = cdpruner.question_embeddings(model, tokenizer, question)
    assert embeds.shape == (2, 8)
    ids = tokenizer(question)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 13
    padded = ids + [0] * 3
    for row in range(2):
        chunk = torch.tensor([padded[row * 8:(row + 1) * 8]])
        mask = torch.tensor([[1] * 8 if row == 0 else [1] * 5 + [0] * 3])
        with torch.no_grad():
            want = model.get_text_features(input_ids=chunk, attention_mask=mask)
        want = getattr(want, "pooler_output", want)
        assert torch.allclose(embeds[row], want[0], atol=1e-6)


def test_load_clip_errors(clip_folder, tmp_path):
    from transformers import CLIPVisionModel

    with pytest.raises(ModelLoadError, match="no such folder"):
        load_clip(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="hub id.*unknown or unreachable"):
        load_clip("no-such/clip-model")
    vision = tmp_path / "vision"
    model, _ = load_clip(str(clip_folder), device="cpu")
    CLIPVisionModel(model.config.vision_config).save_pretrained(vision)
    with pytest.raises(ModelLoadError, match="not a CLIP model"):
        load_clip(str(vision))
