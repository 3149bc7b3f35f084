"""VisionZip-style selection: budget split, dominant tokens by [CLS] attention, contextual merging."""
import pytest
import torch

from hap.visionzip import contextual_tokens, dominant_tokens, split_budget


def test_split_budget():
    assert split_budget(64) == (54, 10)
    assert split_budget(8) == (7, 1)
    assert split_budget(1) == (1, 0)
    assert split_budget(2) == (1, 1)
    with pytest.raises(ValueError, match="at least one token"):
        split_budget(0)


def test_dominant_tokens_are_the_most_attended_ascending():
    attn = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05], [0.4, 0.0, 0.3, 0.0, 0.3]])
    assert dominant_tokens(attn, 2).tolist() == [[1, 3], [0, 2]]  # ties broken by position


def test_contextual_merge_groups_similar_keys():
    # 6 patches, dominant = {0}; the rest form two key clusters: {1, 2, 3} along x, {4, 5} along y
    keys = torch.tensor([[[1.0, 1.0], [1, 0], [1, 0.1], [1, -0.1], [0, 1], [0.1, 1]]])
    embeds = torch.arange(6, dtype=torch.float32).view(1, 6, 1).repeat(1, 1, 3)
    targets, merged = contextual_tokens(keys, embeds, torch.tensor([[0]]), 2)
    assert targets.tolist() == [[1, 5]]  # evenly spaced over the remaining patches [1..5]
    # target 1 gathers {1, 2, 3} (mean 2), target 5 gathers {4, 5} (mean 4.5)
    torch.testing.assert_close(merged[0, :, 0], torch.tensor([2.0, 4.5]))
    assert merged.shape == (1, 2, 3)


def test_contextual_merge_conserves_every_remaining_patch():
    torch.manual_seed(0)
    keys, embeds = torch.randn(3, 20, 8), torch.randn(3, 20, 5)
    dominant = dominant_tokens(torch.rand(3, 20), 6)
    targets, merged = contextual_tokens(keys, embeds, dominant, 4)
    assert targets.shape == (3, 4) and merged.shape == (3, 4, 5)
    for b in range(3):
        assert not set(targets[b].tolist()) & set(dominant[b].tolist())
    # no contextual tokens: nothing merged
    t0, m0 = contextual_tokens(keys, embeds, dominant, 0)
    assert t0.shape == (3, 0) and m0.shape == (3, 0, 5)
    with pytest.raises(ValueError, match="non-dominant"):
        contextual_tokens(keys, embeds, dominant, 15)
