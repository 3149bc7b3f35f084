"""Causal truth: which heads and which visual tokens the answer depends on (docs/method.md §11).

PAQ says how a head's attention *looks*; these functions ask whether the answer *depends* on the head, by
intervening on the stock (unpruned) model:

* `head_importance(..., mode="ablation")`: for every query head, the drop in log p(answer token) when the
  head's output (its slice of the attention output before `o_proj`) is zeroed at every prefill position;
  exact, one forward per head, batched (the decoder's input is repeated, the vision tower runs once per batch).
* `head_importance(..., mode="attribution")`: the first-order estimate d log p / d g of a gate g = 1 on each
  head's output (attribution patching): one forward and one backward, whatever the number of heads.
* `token_importance`: `|(x_v - mean_u x_u) . d log p / d x_v|` for each visual embedding x_v entering the
  decoder: the first-order change of log p when the token is replaced by the average visual token (gradient x
  input against a mean baseline), chosen on validation scenes (docs/method.md §11); it comes with the
  attribution's backward.

The answer token is the unpruned model's greedy first answer token; positive head importance = the head helps
it. The hooks (a pre-hook on each layer's `o_proj` multiplying per-head slices by gates, a pre-hook on the
decoder taking its input embeddings) are on the one instance and always removed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from .inputs import DEFAULT_LIMITS, InputLimits, load_image
from .patch import attention_outputs, decoder_of
from .run import build_inputs

MODES = ("ablation", "attribution")
ABLATION_BATCH = 16  # ablated copies per forward


@dataclass
class Causal:
    """One input's causal analysis.

    head_importance: [layers, heads], log p(answer) of the stock model minus that with the head zeroed
    (`mode` "ablation": exact; "attribution": first-order); token_importance: [visual] in grid order."""

    mode: str
    answer_token: int
    answer_text: str
    log_prob: float  # log p(answer token) of the stock model
    head_importance: torch.Tensor
    token_importance: torch.Tensor
    seconds: float


def prepare(model, processor, image, prompt: str, limits: InputLimits = DEFAULT_LIMITS) -> dict:
    """The processor inputs of one image and prompt (chat template, checked image and prompt), on the model's
    device; ValueError on bad input or a model still patched by `hap.patch` (its prefill would prune)."""
    if hasattr(model, "_hap"):
        raise ValueError("causal analysis needs the stock model: call hap.unpatch(model) first")
    inputs, _, _ = build_inputs(processor, load_image(image, limits), prompt, limits)
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return inputs


def head_importance(model, processor, image, prompt: str, mode: str = "ablation") -> torch.Tensor:
    """`[layers, heads]` float CPU: drop in log p(the unpruned greedy first answer token) when each head's output
    is zeroed at every prefill position (`mode`: "ablation" exact, "attribution" first-order)."""
    inputs = prepare(model, processor, image, prompt)
    if mode == "ablation":
        return ablation(model, inputs)[2]
    check_mode(mode)
    return gradients(model, inputs)[2]


def token_importance(model, processor, image, prompt: str) -> torch.Tensor:
    """`[visual]` float CPU, in the original grid order: |first-order change| of log p(the unpruned greedy first
    answer token) when each visual token's embedding entering the decoder is replaced by the mean visual one."""
    return gradients(model, prepare(model, processor, image, prompt))[3]


def analyze(model, processor, image, prompt: str, mode: str = "attribution",
            limits: InputLimits = DEFAULT_LIMITS) -> Causal:
    """Head importance (`mode`) and token importance of one input, sharing the gradient pass."""
    check_mode(mode)
    t0 = time.perf_counter()
    inputs = prepare(model, processor, image, prompt, limits)
    answer, log_prob, heads, tokens = gradients(model, inputs)
    if mode == "ablation":
        answer, log_prob, heads = ablation(model, inputs)
    text = processor.decode([answer], skip_special_tokens=False)
    return Causal(mode, answer, text, log_prob, heads, tokens, time.perf_counter() - t0)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}")


def head_layout(model) -> tuple[int, int]:
    """(layers, query heads) of the decoder."""
    tc = model.config.text_config
    return tc.num_hidden_layers, tc.num_attention_heads


def ablation_gates(layers: int, heads: int) -> torch.Tensor:
    """`[1 + layers * heads, layers, heads]`: all ones (the stock model), then one row per head with it zeroed."""
    gates = torch.ones(1 + layers * heads, layers * heads)
    gates[1:].fill_diagonal_(0.0)
    return gates.view(-1, layers, heads)


@torch.no_grad()
def ablation(model, inputs: dict, batch_size: int = ABLATION_BATCH) -> tuple[int, float, torch.Tensor]:
    """(answer token, its log p, exact importance `[layers, heads]`) of batch-1 `inputs`: every head zeroed in
    turn, `batch_size` copies of the decoder per forward (the first forward's first copy is the stock model)."""
    L, H = head_layout(model)
    logps = [answer_log_probs(model, inputs, gates) for gates in ablation_gates(L, H).split(batch_size)]
    logp = torch.cat(logps)  # [1 + L * H, vocab]
    answer = int(logp[0].argmax())
    return answer, float(logp[0, answer]), (logp[0, answer] - logp[1:, answer]).view(L, H)


def answer_log_probs(model, inputs: dict, gates: torch.Tensor) -> torch.Tensor:
    """`[batch, vocab]` log-probabilities of the next token after the prompt, one row per gate row `gates
    [batch, layers, heads]` multiplying each head's output (batch-1 `inputs`, repeated at the decoder)."""
    with gated_heads(model, gates), decoder_input(model, lambda x: x.expand(gates.shape[0], -1, -1)):
        logits = model(**inputs, logits_to_keep=1).logits[:, -1]
    return logits.float().log_softmax(-1).cpu()


def gradients(model, inputs: dict) -> tuple[int, float, torch.Tensor, torch.Tensor]:
    """(answer token, its log p, attribution `[layers, heads]`, token importance `[visual]`) of batch-1 `inputs`
    from one forward and one backward: d log p / d gate of each head's output, and |gradient x (input - mean
    visual input)| of each visual embedding entering the decoder."""
    L, H = head_layout(model)
    device = next(model.parameters()).device
    gates = torch.ones(1, L, H, device=device, requires_grad=True)
    taken: list[torch.Tensor] = []

    def leaf(x: torch.Tensor) -> torch.Tensor:
        taken.append(x.detach().requires_grad_(True))
        return taken[0]

    with torch.enable_grad(), gated_heads(model, gates), decoder_input(model, leaf):
        logp = model(**inputs, logits_to_keep=1).logits[0, -1].float().log_softmax(-1)
        answer = int(logp.argmax())
        d_gates, d_embeds = torch.autograd.grad(logp[answer], [gates, taken[0]])
    visual = inputs["input_ids"][0] == model.config.image_token_id
    x = taken[0][0, visual].detach().float()
    tokens = (d_embeds[0, visual].float() * (x - x.mean(0))).sum(-1).abs()
    return answer, float(logp[answer].detach()), d_gates[0].float().cpu(), tokens.cpu()


@contextmanager
def gated_heads(model, gates: torch.Tensor) -> Iterator[None]:
    """Within the block, each head's output (its `o_proj` input slice) is multiplied by `gates [batch|1, layers,
    heads]` at every position."""
    outputs = attention_outputs(model)
    if gates.shape[1:] != (len(outputs), head_layout(model)[1]):
        raise ValueError(f"gates {tuple(gates.shape)} do not match [batch, {len(outputs)} layers, heads]")
    handles = [o.register_forward_pre_hook(partial(_gate, gates, i)) for i, o in enumerate(outputs)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _gate(gates: torch.Tensor, layer: int, module, args: tuple) -> tuple:
    x = args[0]  # [B, T, heads * head_dim]
    B, T, D = x.shape
    g = gates[:, layer].to(x)  # [B|1, heads]
    return ((x.view(B, T, g.shape[-1], -1) * g[:, None, :, None]).view(B, T, D), *args[1:])


@contextmanager
def decoder_input(model, transform: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, the decoder's input embeddings `[1, T, D]` become `transform(x)` `[B, T, D]`; a batch
    B > 1 repeats the attention mask and the position ids (batch dim second to last: `[B, T]` or M-RoPE's
    `[k, B, T]`) to match."""
    handle = decoder_of(model).register_forward_pre_hook(partial(_decoder_pre_hook, transform), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _decoder_pre_hook(transform, module, args, kwargs) -> tuple[tuple, dict]:
    x = kwargs["inputs_embeds"]
    if x.shape[0] != 1:
        raise ValueError(f"causal analysis takes one input at a time, not a batch of {x.shape[0]}")
    kwargs["inputs_embeds"] = y = transform(x)
    B = y.shape[0]
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if B > 1 and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        kwargs["attention_mask"] = mask.expand(B, -1)
    if B > 1 and positions is not None:
        shape = list(positions.shape)
        shape[-2] = B
        kwargs["position_ids"] = positions.expand(*shape)
    return args, kwargs
