"""Causal truth: which heads and which visual tokens the answer depends on (docs/method.md §11).

PAQ says how a head's attention *looks*; these functions ask whether the answer *depends* on the head, by
intervening on the stock (unpruned) model:

* `head_importance(..., mode="ablation")`: for every query head, the drop in log p(answer token) when the
  head's output (its slice of the attention output before `o_proj`) is zeroed at every prefill position;
  exact, one forward per head, batched (the decoder's input is repeated, the vision tower runs once per batch).
* `head_importance(..., mode="attribution")`: the first-order estimate d log p / d g of a gate g = 1 on each
  head's output (attribution patching): one forward and one backward, whatever the number of heads.
* `static_head_importance`: the same drop, clipped at 0 and averaged over calibration items, each layer's row
  normalised to sum 1: a model's static head importance (HAWK's offline head ablation, `hap.scoring.importance`);
  the heads of one layer in a batch, the layers below it run once per item (their output is the same for every
  head above them).
* `token_importance`: `|(x_v - mean_u x_u) . d log p / d x_v|` for each visual embedding x_v entering the
  decoder: the first-order change of log p when the token is replaced by the average visual token (gradient x
  input against a mean baseline), chosen on validation scenes (docs/method.md §11, `analysis.token_methods`,
  which compares it with the other scores of `TOKEN_SCORES`); it comes with the attribution's backward.

The answer token is the unpruned model's greedy first answer token; positive head importance = the head helps
it. The hooks (a pre-hook on each layer's `o_proj` multiplying per-head slices by gates, a pre-hook on the
decoder taking its input embeddings) are on the one instance and always removed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .patch import attention_outputs, decoder_of, repeat_decoder_kwargs, visual_tokens
from .runs.inputs import DEFAULT_LIMITS, InputLimits, load_image
from .runs.run import build_inputs
from .scoring.importance import row_normalised

MODES = ("ablation", "attribution")
SETTINGS = ("auto", *MODES, "off")  # what a caller asks for; "auto" = `default_mode`
ABLATION_BATCH = 16  # ablated copies per forward
ABLATION_BUDGET = 2e9  # heads x parameters up to which "auto" runs exact ablation (the shipped model: ~1.5e8)
MAX_SCALE_BITS = 24  # the largest gradient scale, 2^24 (`gradient_scale`)


def gradient_x_delta(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """|(x_v - mean_u x_u) . grad_v|: the first-order change of log p when each token is replaced by the mean
    visual token (`x, grad [visual, D]` -> `[visual]`)."""
    return (grad * (x - x.mean(0))).sum(-1).abs()


def gradient_x_input(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """|x_v . grad_v|: the same against a zero token (`[visual, D]` -> `[visual]`)."""
    return (grad * x).sum(-1).abs()


def signed_gradient_x_input(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """x_v . grad_v, signed: tokens whose removal would lower log p first (`[visual, D]` -> `[visual]`)."""
    return (grad * x).sum(-1)


def gradient_norm(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """||grad_v||: sensitivity, whatever the token carries (`[visual, D]` -> `[visual]`)."""
    return grad.norm(dim=-1)


# Token scores from the visual embeddings x and the gradient of log p(answer) on them (one backward each).
TOKEN_SCORES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gradient_x_delta": gradient_x_delta,
    "gradient_x_input": gradient_x_input,
    "signed_gradient_x_input": signed_gradient_x_input,
    "gradient_norm": gradient_norm,
}
TOKEN_SCORE = "gradient_x_delta"  # the one chosen on validation scenes (docs/method.md §11)


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


def prepare(model, processor, image, prompt: str, limits: InputLimits = DEFAULT_LIMITS,
            history: Sequence[tuple[str, str]] = ()) -> dict:
    """The processor inputs of one image and prompt (chat template over `history`'s turns then the prompt, checked
    image and prompt), on the model's device; ValueError on bad input or a model still patched by `hap.patch`
    (its prefill would prune)."""
    if hasattr(model, "_hap"):
        raise ValueError("causal analysis needs the stock model: call hap.unpatch(model) first")
    inputs, _, _ = build_inputs(processor, load_image(image, limits), prompt, limits, history)
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


def static_head_importance(model, processor, images: Sequence, prompts: Sequence[str],
                           batch_size: int = ABLATION_BATCH, progress: Callable[[int, int], None] | None = None
                           ) -> np.ndarray:
    """A model's static head importance, `[layers, heads]` float64: for each calibration item (`images[i]`,
    `prompts[i]`), a = the unpruned model's greedy next token and, per head (l, h), drop = max(0, log p(a) - log p(a)
    with the head's output zeroed); the mean drop over the items, each layer's row divided by its sum (a row of zeros
    stays zeros). Exact ablation: per item one stock forward, then per layer its heads in batches of `batch_size`
    copies, the layers below it skipped (their output, the same for every head above them, is taken from the stock
    forward). `progress(done, total)` is called after each item. ValueError on unequal or empty lists."""
    if len(images) != len(prompts) or not images:
        raise ValueError(f"static_head_importance needs as many prompts as images, at least one; got {len(images)} "
                         f"images and {len(prompts)} prompts")
    L, H = head_layout(model)
    drops = torch.zeros(L, H, dtype=torch.float64)
    for i, (image, prompt) in enumerate(zip(images, prompts)):
        drops += item_drops(model, prepare(model, processor, image, prompt), batch_size).clamp_min(0)
        if progress is not None:
            progress(i + 1, len(images))
    return row_normalised(drops / len(images)).numpy()


@torch.no_grad()
def item_drops(model, inputs: dict, batch_size: int = ABLATION_BATCH) -> torch.Tensor:
    """`[layers, heads]` float64: log p(a) - log p(a with head (l, h) zeroed) for batch-1 `inputs`, a the stock
    model's greedy next token; the layers below l skipped (`skipped_below`)."""
    L, H = head_layout(model)
    layers = decoder_of(model).layers
    device = next(model.parameters()).device
    entering: list[torch.Tensor] = []
    handles = [layer.register_forward_pre_hook(partial(_keep_input, entering), with_kwargs=True) for layer in layers]
    try:
        stock = answer_log_probs(model, inputs, torch.ones(1, L, H, device=device))[0]
    finally:
        for handle in handles:
            handle.remove()
    answer = int(stock.argmax())
    drops = torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        gates = ablation_gates(L, H)[1 + layer * H:1 + (layer + 1) * H].to(device)  # [H, L, H] each head of `layer` zeroed
        with skipped_below(model, layer, entering[layer]):
            logp = torch.cat([answer_log_probs(model, inputs, g) for g in gates.split(batch_size)])
        drops[layer] = (stock[answer] - logp[:, answer]).double()
    return drops


def _keep_input(store: list, module, args, kwargs) -> None:
    store.append((args[0] if args else kwargs["hidden_states"]).detach())


@contextmanager
def skipped_below(model, layer: int, hidden: torch.Tensor) -> Iterator[None]:
    """Within the block, decoder layers below `layer` pass their input through untouched and layer `layer` takes
    `hidden` [1, T, D] (repeated to the batch) as its input: the stock model's states entering it, so the layers
    below run once, not once per ablated head above them. What the decoder adds between layers (Qwen3-VL's DeepStack)
    is overwritten by `hidden` at `layer`, which holds it already."""
    layers = decoder_of(model).layers

    def enter(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        states = hidden.expand(x.shape[0], -1, -1).to(x)
        return ((states, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": states})

    for below in layers[:layer]:
        below.forward = _pass_through
    handle = layers[layer].register_forward_pre_hook(enter, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        for below in layers[:layer]:
            del below.forward


def _pass_through(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states


def token_importance(model, processor, image, prompt: str, score: str = TOKEN_SCORE) -> torch.Tensor:
    """`[visual]` float CPU, in the original grid order: |first-order change| of log p(the unpruned greedy first
    answer token) when each visual token's embedding entering the decoder is replaced by the mean visual one
    (`score`: another of `TOKEN_SCORES`, for comparison)."""
    return gradients(model, prepare(model, processor, image, prompt), score)[3]


def analyze(model, processor, image, prompt: str, mode: str = "attribution", limits: InputLimits = DEFAULT_LIMITS,
            history: Sequence[tuple[str, str]] = ()) -> Causal:
    """Head importance (`mode`) and token importance of one input (`history`: earlier turns, see `prepare`),
    sharing the gradient pass."""
    check_mode(mode)
    t0 = time.perf_counter()
    inputs = prepare(model, processor, image, prompt, limits, history)
    answer, log_prob, heads, tokens = gradients(model, inputs)
    if mode == "ablation":  # the same answer token as the token importance, taken once
        _, log_prob, heads = ablation(model, inputs, answer=answer)
    text = processor.decode([answer], skip_special_tokens=False)
    return Causal(mode, answer, text, log_prob, heads, tokens, time.perf_counter() - t0)


def ablation_cost(model) -> int:
    """Query heads x parameters: what exact ablation costs on `model` (one forward of every parameter per head)."""
    L, H = head_layout(model)
    return L * H * sum(p.numel() for p in model.parameters())


def default_mode(model) -> str:
    """"ablation" where one forward per head is cheap (`ablation_cost` <= ABLATION_BUDGET: the shipped model,
    under 2 s on a CPU), else "attribution" (one forward and one backward whatever the number of heads)."""
    return "ablation" if ablation_cost(model) <= ABLATION_BUDGET else "attribution"


def resolve_setting(model, setting: str) -> str | None:
    """The mode a setting of SETTINGS runs on `model` ("auto": `default_mode`), None for "off"; ValueError for
    "ablation" above ABLATION_BUDGET (a request must not start one forward per head of a large model)."""
    if setting not in SETTINGS:
        raise ValueError(f"causal={setting!r}: choose one of {', '.join(SETTINGS)}")
    if setting == "ablation" and default_mode(model) != "ablation":
        L, H = head_layout(model)
        raise ValueError(f"causal='ablation' runs one forward per head, {L} x {H} heads of a model this size "
                         f"(heads x parameters {ablation_cost(model):.3g} > ABLATION_BUDGET {ABLATION_BUDGET:.3g}); "
                         "use causal='attribution' (one forward and one backward, first-order), which 'auto' picks "
                         "here")
    return None if setting == "off" else default_mode(model) if setting == "auto" else setting


def spearman(x, y) -> float:
    """Spearman rank correlation of two equal-length arrays (average ranks for ties)."""

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(np.asarray(x, float)), ranks(np.asarray(y, float))
    return float(np.corrcoef(rx, ry)[0, 1])


def paq_spearman(paq, importance) -> float | None:
    """Spearman(PAQ, head importance) over the scored heads (PAQ finite), both `[layers, heads]`; None when fewer
    than two heads were scored or either side is constant."""
    paq, importance = np.asarray(paq, float).ravel(), np.asarray(importance, float).ravel()
    scored = np.isfinite(paq) & np.isfinite(importance)
    if scored.sum() < 2 or np.ptp(paq[scored]) == 0 or np.ptp(importance[scored]) == 0:
        return None
    return spearman(paq[scored], importance[scored])


def token_precision(tokens, answering) -> float:
    """Precision at |answering|: the share of answering patches (bool `answering [visual]`, at least one) among
    the |answering| tokens of highest importance (`tokens [visual]`; ties: the lower index first)."""
    answering = np.asarray(answering, dtype=bool)
    top = np.argsort(-np.asarray(tokens, float), kind="stable")[: int(answering.sum())]
    return float(answering[top].mean())


def kept_importance(tokens, kept: list) -> list[float | None]:
    """Per group: the share of the total positive token importance (`tokens [visual]`) that the group's kept
    original visual indices hold; None when no token has positive importance."""
    positive = np.clip(np.asarray(tokens, float), 0, None)
    total = positive.sum()
    return [float(positive[np.asarray(k, dtype=int)].sum() / total) if total > 0 else None for k in kept]


def to_json(c: Causal, paq, kept: list) -> dict:
    """The `causal` entry of the `/analyze` and CLI JSON: mode, answer token, head importance [layers][heads],
    Spearman with PAQ `[layers, heads]` (NaN where not scored), token importance [visual], each group's kept share
    (`kept`: per group, the kept original visual indices), the answer's text, log p and the seconds taken."""
    return {
        "mode": c.mode,
        "answer_token": c.answer_token,
        "answer_text": c.answer_text,
        "log_prob": c.log_prob,
        "head_importance": c.head_importance.tolist(),
        "paq_spearman": paq_spearman(paq, c.head_importance),
        "token_importance": c.token_importance.tolist(),
        "kept_importance": kept_importance(c.token_importance, kept),
        "seconds": c.seconds,
    }


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
def ablation(model, inputs: dict, batch_size: int = ABLATION_BATCH,
             answer: int | None = None) -> tuple[int, float, torch.Tensor]:
    """(answer token, its log p, exact importance `[layers, heads]`) of batch-1 `inputs`: every head zeroed in
    turn, `batch_size` copies of the decoder per forward (the first forward's first copy is the stock model), no KV
    cache kept. `answer`: the token to explain (None: the stock model's greedy one in this pass)."""
    L, H = head_layout(model)
    logps = [answer_log_probs(model, inputs, gates) for gates in ablation_gates(L, H).split(batch_size)]
    logp = torch.cat(logps)  # [1 + L * H, vocab]
    answer = int(logp[0].argmax()) if answer is None else answer
    return answer, float(logp[0, answer]), (logp[0, answer] - logp[1:, answer]).view(L, H)


def answer_log_probs(model, inputs: dict, gates: torch.Tensor) -> torch.Tensor:
    """`[batch, vocab]` log-probabilities of the next token after the prompt, one row per gate row `gates
    [batch, layers, heads]` multiplying each head's output (batch-1 `inputs`, repeated at the decoder; no cache)."""
    with gated_heads(model, gates), decoder_input(model, lambda x: x.expand(gates.shape[0], -1, -1)):
        logits = model(**inputs, logits_to_keep=1, use_cache=False).logits[:, -1]
    return logits.float().log_softmax(-1).cpu()


def gradients(model, inputs: dict, score: str = TOKEN_SCORE) -> tuple[int, float, torch.Tensor, torch.Tensor]:
    """(answer token, its log p, attribution `[layers, heads]`, token importance `[visual]`) of batch-1 `inputs`
    from one forward and one backward: d log p / d gate of each head's output, and `TOKEN_SCORES[score]` (by
    default |gradient x (input - mean visual input)|) of the visual embeddings entering the decoder. In a half-precision
    model log p, each gate's product and gradient and the token scores are float32, and the backward pass runs
    scaled by `gradient_scale` (docs/method.md §13)."""
    if score not in TOKEN_SCORES:
        raise ValueError(f"score={score!r}: choose one of {', '.join(TOKEN_SCORES)}")
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
        scale = gradient_scale(float(logp[answer].detach()))
        d_gates, d_embeds = torch.autograd.grad(logp[answer] * scale, [gates, taken[0]])
    visual = visual_tokens(model, inputs)[0]
    tokens = TOKEN_SCORES[score](taken[0][0, visual].detach().float(), d_embeds[0, visual].float() / scale)
    return answer, float(logp[answer].detach()), (d_gates[0].float() / scale).cpu(), tokens.cpu()


def gradient_scale(log_p: float) -> float:
    """The power of two that brings 1 - p, the largest |d log p / d logit| of a confident answer, to about 1
    (at most 2^MAX_SCALE_BITS): backpropagated that much larger, a float16 model's gradients stay clear of
    underflow (p = 0.99999 gives logit gradients of 1e-5 and token gradients below float16's smallest number);
    dividing by a power of two after is exact, in every dtype."""
    tail = max(-math.expm1(log_p), 2.0**-MAX_SCALE_BITS)
    return 2.0 ** min(MAX_SCALE_BITS, max(0, round(-math.log2(tail))))


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
    g = gates[:, layer].float()  # [B|1, heads]
    gated = x.float().view(B, T, g.shape[-1], -1) * g[:, None, :, None]  # in float32, so is d/d gate's sum over T
    return (gated.view(B, T, D).to(x.dtype), *args[1:])


@contextmanager
def decoder_input(model, transform: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, the decoder's input embeddings `[1, T, D]` become `transform(x)` `[B, T, D]`; a batch
    B > 1 repeats the attention mask and the position ids (batch dim second to last: `[B, T]` or M-RoPE's
    `[k, B, T]`) to match, and whatever else the adapter says holds per-sample rows (`repeat_decoder_kwargs`)."""
    handle = decoder_of(model).register_forward_pre_hook(partial(_decoder_pre_hook, model, transform),
                                                          with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _decoder_pre_hook(model, transform, module, args, kwargs) -> tuple[tuple, dict]:
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
    if B > 1:
        repeat_decoder_kwargs(model, kwargs, B)
    return args, kwargs
