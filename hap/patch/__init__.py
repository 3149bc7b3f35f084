"""Model adapters: one file per architecture, each patching a model *instance* (never a class).

`apply(model, config)` picks the adapter from the model's class; `remove(model)` undoes it.
`decoder_of(model)` and `attention_outputs(model)` say where an intervention (hap.causal) hooks in.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from ..config import HAPConfig
from ..layout import Layout
from ..pruners import pruner_for
from ..scoring import importance
from . import gemma3, idefics3, internvl, llava, llava_next, qwen2_vl, qwen3_vl

ADAPTERS = {
    "LlavaForConditionalGeneration": llava,
    "LlavaNextForConditionalGeneration": llava_next,
    "LlavaOnevisionForConditionalGeneration": llava_next,
    "Qwen2VLForConditionalGeneration": qwen2_vl,
    "Qwen2_5_VLForConditionalGeneration": qwen2_vl,
    "InternVLForConditionalGeneration": internvl,
    "Idefics3ForConditionalGeneration": idefics3,
    "SmolVLMForConditionalGeneration": idefics3,
    "Qwen3VLForConditionalGeneration": qwen3_vl,
    "Gemma3ForConditionalGeneration": gemma3,
}


def adapter_for(model):
    name = type(model).__name__
    if name not in ADAPTERS:
        raise ValueError(
            f"HAP has no adapter for {name}; "
            f"supported: {', '.join(ADAPTERS)}"
        )
    return ADAPTERS[name]


def family_of(model) -> str:
    """The adapter module's name of `model` ("llava", "llava_next", "qwen2_vl", ...): the family a pruner's
    `refuses` and `resizes_image` are asked about."""
    return adapter_for(model).__name__.rsplit(".", 1)[-1]


def resizes_image(model, config: HAPConfig) -> bool:
    """Whether `config`'s method shrinks the image itself on `model` before the processor (`Pruner.resizes_image`:
    downsample on dynamic resolution; `hap.runs.run.for_config`)."""
    return pruner_for(config).resizes_image(family_of(model))


def decoder_of(model) -> torch.nn.Module:
    """The text decoder of a supported model (its forward takes `inputs_embeds`, `attention_mask`, `position_ids`)."""
    return adapter_for(model).decoder_of(model)


def attention_outputs(model) -> list[torch.nn.Module]:
    """Each decoder layer's attention output projection, whose input holds the query heads' outputs side by side
    (`[batch, T, heads * head_dim]`, head h in columns `[h * head_dim, (h + 1) * head_dim)`)."""
    return adapter_for(model).attention_outputs(model)


def visual_tokens(model, inputs) -> torch.Tensor:
    """bool [batch, T] the visual tokens of `inputs` (the processor's output) the pruner ranks: the image token's
    ids, less those an adapter keeps out (LLaVA-NeXT's newline tokens)."""
    adapter, ids = adapter_for(model), inputs["input_ids"]
    if hasattr(adapter, "token_masks"):
        return adapter.token_masks(model, ids, inputs)[0]
    return ids == model.config.image_token_id


def repeat_decoder_kwargs(model, kwargs: dict, batch: int) -> None:
    """The decoder kwargs of a batch-1 input whose embeddings were repeated `batch` times (`hap.causal`), beyond the
    mask and the positions: the adapter's per-sample inputs repeated alike, in place (Qwen3-VL's DeepStack)."""
    adapter = adapter_for(model)
    if hasattr(adapter, "repeat_decoder_kwargs"):
        adapter.repeat_decoder_kwargs(kwargs, batch)


def layout(model, inputs, image_size: tuple[int, int] | None = None, processor=None) -> Layout:
    """Where each visual token of the first sample of `inputs` (the output of `processor`) lies on its image of
    `image_size` = (width, height) pixels (`hap.layout`): the adapter's layout (which may read the processor's
    settings: LLaVA-1.5's centre crop), else its `visual_grid` over the whole image."""
    adapter = adapter_for(model)
    if hasattr(adapter, "layout"):
        return adapter.layout(model, inputs, image_size, processor)
    N = int(visual_tokens(model, inputs)[0].sum())
    return Layout.grid(*adapter.visual_grid(model, inputs, N), image_size)


def apply(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
          tail: int | None = None, lead: int = 0, question: str | None = None, resized: bool = False):
    """Patch `model` in place; a plain `model.generate(**inputs)` then prunes. Returns the patch state.

    `priority [batch, visual]` (analysis only, e.g. an oracle): at every cut the visual tokens are ranked by
    it first (by original visual index, row-major), by the method's scores among equal priorities; with a batch-1
    input, V > 1 rows run V variants of it, sharing the layers before the first cut (a prefill only, `hap.utility`).
    `tail`: tokens of the chat template after the question (`hap.runs.run.template_tail(processor)`), needed by
    rows="question". `lead`: tokens between the image and the question (`hap.runs.run.question_lead(processor, history)`),
    the earlier turns of a follow-up, which no prompt row is taken from. `question`: the raw question (no chat
    template), for a pruner that reads it (`cdpruner`; one question for every prompt of a batch). A method the model's family does not take is refused first,
    naming the method, the model class and the reason. A method that resizes the image on this family
    (`Pruner.resizes_image`: downsample on dynamic resolution) runs only on inputs `hap.run` resized for it
    (`resized=True`), with no cut: the decoder runs every token of the smaller image."""
    adapter = adapter_for(model)
    why = pruner_for(config).refuses(family_of(model))
    if why is not None:
        raise ValueError(f"method={config.method!r} does not run on {type(model).__name__}: {why}")
    config = with_importance(model, config)
    if resizes_image(model, config):
        if not resized:
            raise ValueError(f"method={config.method!r} on {type(model).__name__} resizes the image before the "
                             "processor: run it through hap.run / hap.run_together, not a patch alone")
        config = replace(config, method="none")
    patch = adapter.apply_patch(model, config, trace=trace, priority=priority, tail=tail, lead=lead)
    patch.ask(question)
    return patch


def with_importance(model, config: HAPConfig) -> HAPConfig:
    """`config` with its `head_importance` file found where its pruner weights heads statically (`static_heads`:
    HAWK, head_weight="static"): the knob's file, else the model folder's (`hap.scoring.importance.FILE`).
    ValueError naming the command that measures one where there is none, or where the file's shape is not this
    model's [layers, heads]."""
    if not pruner_for(config).static_heads:
        return config
    name = getattr(model, "name_or_path", "") or type(model).__name__
    path = config.head_importance or importance.model_file(getattr(model, "name_or_path", None))
    if path is None:
        user = f"method={config.method!r}" + (" with head_weight='static'" if config.head_weight == "static" else "")
        raise ValueError(importance.missing(user, name))
    tc = model.config.text_config
    importance.check_shape(importance.read(path), path, tc.num_hidden_layers, tc.num_attention_heads)
    return replace(config, head_importance=path)


def remove(model) -> None:
    """Undo `apply`; the model behaves exactly as the stock one again."""
    adapter_for(model).remove_patch(model)


def refusal(model, config: HAPConfig) -> str | None:
    """Why `model` does not take `config` (its adapter's message: visionzip without a [CLS] token, pdrop's
    renumbered positions on M-RoPE, ...), or None when it does (a method that resizes the image: as `hap.run` runs
    it); the model is left unpatched."""
    try:
        apply(model, config, tail=0, resized=True)  # the template's tail of rows="question": a caller's input
    except ValueError as err:
        return str(err)
    remove(model)
    return None


@contextmanager
def patched(model, config: HAPConfig, trace: bool = False, priority: torch.Tensor | None = None,
            tail: int | None = None, lead: int = 0, question: str | None = None):
    """`with hap.patched(model, config) as p:` patches for the block and always unpatches (`priority`, `tail`,
    `lead`, `question`: see `apply`)."""
    state = apply(model, config, trace=trace, priority=priority, tail=tail, lead=lead, question=question)
    try:
        yield state
    finally:
        remove(model)
