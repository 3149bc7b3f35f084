"""`hap.run`: one image + prompt through the patched model -> `Result`, everything the app draws."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from PIL import Image

from .budget import FLOPS_CONVENTION
from .config import HAPConfig
from .heads import HeadStats, classify
from .inputs import DEFAULT_LIMITS, InputLimits, clean_prompt, load_image
from .patch import adapter_for, apply, remove
from .patch.decoder import decoder_shape


@dataclass
class Group:
    """One group of decoder layers and the visual tokens it runs on."""

    index: int
    layers: tuple[int, int]  # decoder-layer range [start, end)
    scored_by: list[int]  # layers whose attention chose its tokens (layer 0 itself for a cut before it)
    kept: list[int]  # kept visual indices into the original 0..N-1 (row-major grid) order
    paq: list[list[float]]  # [scored_by][heads] the PAQ that weighted this cut (for a cut before layer 0:
    #                         layer 0 over all tokens, unlike `Result.paq[0]`, taken on the tokens it kept)
    weights: list[list[float]]  # [scored_by][heads] the fusion weights the method used (uniform for baselines)


@dataclass
class Maps:
    """Token maps on the original visual grid, `[..., visual]`, NaN where a token was already pruned.

    Every map is the selection score s_v = ||M[:, v]||_2 over the prompt rows of some attention M.
    """

    head: torch.Tensor  # [layers, heads, visual] per head, before fusion (NaN rows: layer not captured)
    head_attention: torch.Tensor  # [layers, heads, visual] mean prompt-row attention over the image, sums to 1
    layer: torch.Tensor  # [layers, visual] head fusion with softmax(PAQ / T) within the layer
    layer_uniform: torch.Tensor  # [layers, visual] plain head average
    group: torch.Tensor  # [groups, visual] layer fusion over the layers that scored each group
    group_uniform: torch.Tensor  # [groups, visual] uniform-average counterpart


@dataclass
class Result:
    answer: str
    method: str
    config: dict
    prompt_text: str  # the full chat prompt given to the processor
    num_layers: int
    num_heads: int
    num_visual: int
    text_tokens: int
    visual_grid: tuple[int, int]  # (rows, cols) of the visual tokens over the image
    groups: list[Group]
    visual_per_layer: list[int]  # [layers] visual tokens present in each decoder layer
    retained_tokens: float  # average over all decoder layers of the visual tokens present
    retain: float  # retained_tokens / num_visual (achieved, after rounding)
    target_retain: float | None
    flops_ratio: float  # achieved prefill FLOPs / unpruned, FLOPS_CONVENTION
    target_flops_ratio: float | None
    paq: torch.Tensor  # [layers, heads], NaN where not scored
    sink_share: torch.Tensor  # [layers, heads]
    dispersion: torch.Tensor  # [layers, heads]
    visual_share: torch.Tensor  # [layers, heads]
    head_class: list[list[str]]  # [layers][heads] "sink"/"dispersed"/"optimal", "" where not scored
    sink_tokens: list[int]  # [layers] visual tokens flagged as sinks (-1 where not scored)
    maps: Maps
    timings: dict[str, float]
    notes: list[str] = field(default_factory=list)
    flops_convention: str = FLOPS_CONVENTION

    def kept_mask(self, group: int) -> torch.Tensor:
        """bool [visual] of the tokens group `group` runs on."""
        mask = torch.zeros(self.num_visual, dtype=torch.bool)
        mask[self.groups[group].kept] = True
        return mask

    def to_json(self) -> dict:
        """Plain JSON types; tensors become nested lists with NaN as null."""

        def plain(x):
            if isinstance(x, torch.Tensor):
                return plain(x.tolist())
            if isinstance(x, float):
                return None if math.isnan(x) else x
            if isinstance(x, (list, tuple)):
                return [plain(v) for v in x]
            if isinstance(x, dict):
                return {k: plain(v) for k, v in x.items()}
            return x

        return plain(asdict(self))


def chat_prompt(processor, question: str) -> str:
    """The processor's single-turn chat prompt: one image slot, then the question, then the assistant prefix."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def build_inputs(processor, image: Image.Image, prompt: str, limits: InputLimits) -> tuple[dict, str, list[str]]:
    """Chat-template the cleaned prompt with one image slot and run the processor."""
    tok = processor.tokenizer
    specials = {t for t in (*tok.all_special_tokens, getattr(processor, "image_token", None)) if t}
    prompt, notes = clean_prompt(prompt, specials, limits)
    text = chat_prompt(processor, prompt)
    return processor(images=image, text=text, return_tensors="pt"), text, notes


def run(
    model,
    processor,
    image,
    prompt: str,
    config: HAPConfig | None = None,
    max_new_tokens: int = 32,
    trace: bool = True,
    limits: InputLimits = DEFAULT_LIMITS,
) -> Result:
    """Run the full HAP pipeline on one image and prompt; greedy decoding on the pruned cache.

    Bad input raises ValueError naming the problem; running out of memory raises MemoryError
    after the memory is freed, so the next call can succeed.
    """
    config = config or HAPConfig()
    config.validate()
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= 1024:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer in [1, 1024]")
    try:
        return _run(model, processor, image, prompt, config, max_new_tokens, trace, limits)
    except (torch.OutOfMemoryError, MemoryError) as err:
        free_memory()
        device = next(model.parameters()).device
        raise MemoryError(
            f"out of memory on {device.type} while answering ({err.__class__.__name__}); memory was freed. "
            "Try a smaller image, fewer new tokens or a smaller model"
        ) from err


def _run(model, processor, image, prompt: str, config: HAPConfig, max_new_tokens: int, trace: bool,
         limits: InputLimits) -> Result:
    t0 = time.perf_counter()
    inputs, text, notes = build_inputs(processor, load_image(image, limits), prompt, limits)
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    T = inputs["input_ids"].shape[1]
    limit = getattr(model.config.text_config, "max_position_embeddings", None)
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(
            f"prompt too long: {T} tokens + max_new_tokens={max_new_tokens} exceed the model's {limit} positions; "
            "shorten the prompt"
        )
    patch = apply(model, config, trace=trace)
    try:
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
        generate_s = time.perf_counter() - t1
    finally:
        remove(model)
    answer = processor.decode(out[0, T:], skip_special_tokens=True).strip()
    N = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    grid = adapter_for(model).visual_grid(model, inputs, N)
    result = _result(model, config, patch, answer, text, T, N, grid, notes)
    result.timings = {
        "prepare_s": t1 - t0,
        "prefill_s": patch.prefill_seconds,
        "decode_s": generate_s - patch.prefill_seconds,
        "generate_s": generate_s,
        "scoring_s": patch.state.scoring_seconds if patch.state else 0.0,
    }
    return result


def free_memory() -> None:
    """Release what a failed run left behind (Python garbage, cached GPU blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _result(
    model, config: HAPConfig, patch, answer: str, text: str, T: int, N: int, grid: tuple[int, int], notes: list[str]
) -> Result:
    st = patch.state
    shape = decoder_shape(model)
    L = shape.layers
    config = config.resolved(L)
    H = model.config.text_config.num_attention_heads
    nan_lh = torch.full((L, H), math.nan)
    stats = {k: nan_lh.clone() for k in ("paq", "sink_share", "dispersion", "visual_share")}
    head_maps = torch.full((L, H, N), math.nan)
    head_attention = torch.full((L, H, N), math.nan)
    layer_maps, layer_uniform = torch.full((L, N), math.nan), torch.full((L, N), math.nan)
    sink_counts = [-1] * L
    for l, tr in (st.layers if st else {}).items():
        for k in stats:
            stats[k][l] = getattr(tr.stats, k)[0]
        head_maps[l], layer_maps[l], layer_uniform[l] = tr.head_maps[0], tr.fused_map[0], tr.uniform_map[0]
        head_attention[l] = tr.head_attention[0]
        sink_counts[l] = int(tr.sink_count[0])
    classes = [[""] * H for _ in range(L)]
    if st and st.layers:
        scored = sorted(st.layers)
        per_layer = classify(
            HeadStats(*(stats[k][scored] for k in ("sink_share", "dispersion", "visual_share", "paq"))),
            config.tau_sink,
            config.tau_disp,
        )
        for l, row in zip(scored, per_layer):
            classes[l] = row
    schedule = st.schedule if st else None
    groups, group_maps, group_uniform = [], [], []
    if schedule is not None:
        for g, ((start, end), cut) in enumerate(zip(schedule.ranges, st.cuts)):
            paq = [] if cut.paq is None else cut.paq[0].tolist()
            weights = [] if cut.weights is None else cut.weights[0].tolist()
            groups.append(Group(g, (start, end), cut.scored_layers, cut.kept[0].tolist(), paq, weights))
            nan_n = torch.full((N,), math.nan)
            group_maps.append(cut.fused_map[0] if cut.fused_map is not None else nan_n)
            group_uniform.append(cut.uniform_map[0] if cut.uniform_map is not None else nan_n)
        visual_per_layer = schedule.visual_per_layer
        flops = schedule.flops_ratio(T - N, shape)
        notes = notes + schedule.notes
    else:
        visual_per_layer, flops = [N] * L, 1.0
    retained = sum(visual_per_layer) / L
    return Result(
        answer=answer,
        method=config.method,
        config=config.to_dict(),
        prompt_text=text,
        num_layers=L,
        num_heads=H,
        num_visual=N,
        text_tokens=T - N,
        visual_grid=grid,
        groups=groups,
        visual_per_layer=visual_per_layer,
        retained_tokens=retained,
        retain=retained / N,
        target_retain=config.retain,
        flops_ratio=flops,
        target_flops_ratio=config.flops_ratio,
        paq=stats["paq"],
        sink_share=stats["sink_share"],
        dispersion=stats["dispersion"],
        visual_share=stats["visual_share"],
        head_class=classes,
        sink_tokens=sink_counts,
        maps=Maps(
            head=head_maps,
            head_attention=head_attention,
            layer=layer_maps,
            layer_uniform=layer_uniform,
            group=torch.stack(group_maps) if group_maps else torch.empty(0, N),
            group_uniform=torch.stack(group_uniform) if group_uniform else torch.empty(0, N),
        ),
        timings={},
        notes=notes,
    )
