"""`hap.run`: one image + prompt through the patched model -> `Result`, everything the app draws."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch
from PIL import Image

from .config import HAPConfig
from .inputs import DEFAULT_LIMITS, InputLimits, clean_conversation, load_image
from .patch import apply, layout, remove
from .patch.decoder import decoder_shape
from .patch.planted import PLANTS
from .trace import Outcome, Result, to_result


def chat_messages(question: str, history: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The conversation as chat messages: the image slot opens the first user turn, then each earlier
    ``(question, answer)`` pair of ``history`` as a user and an assistant turn, then ``question``."""
    turns = [*history, (question, None)]
    messages: list[dict] = []
    for i, (q, a) in enumerate(turns):
        content = ([{"type": "image"}] if i == 0 else []) + [{"type": "text", "text": q}]
        messages.append({"role": "user", "content": content})
        if a is not None:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return messages


def chat_prompt(processor, question: str, history: Sequence[tuple[str, str]] = ()) -> str:
    """The processor's chat prompt over the conversation (``chat_messages``), ending with the assistant
    prefix; with no ``history`` it is the single-turn prompt: one image slot, the question."""
    return processor.apply_chat_template(chat_messages(question, history), add_generation_prompt=True)


def template_tail(processor) -> int:
    """Tokens the chat template puts after the question (e.g. " ASSISTANT:"): the common suffix of two
    prompts whose questions end differently (rows="question" leaves them out, docs/method.md §10)."""
    a, b = (processor.tokenizer(chat_prompt(processor, q)).input_ids for q in ("is it red ?", "what shape"))
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def question_lead(processor, history: Sequence[tuple[str, str]] = ()) -> int:
    """Tokens between the image and the new question: 0 on a first turn (its prompt rows start right after the
    image); after `history`, the earlier turns and the new turn's opening, which the prompt rows leave out. Found
    as the common prefix of two prompts whose questions start differently, less the tokens up to the image."""
    if not history:
        return 0
    tok = processor.tokenizer
    a, b = (tok(chat_prompt(processor, q, history)).input_ids for q in ("is it red ?", "what shape"))
    start = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    image = tok.convert_tokens_to_ids(processor.image_token)
    return start - 1 - max(i for i in range(start) if a[i] == image)


def build_inputs(processor, image: Image.Image, prompt: str, limits: InputLimits,
                 history: Sequence[tuple[str, str]] = ()) -> tuple[dict, str, list[str]]:
    """Chat-template the cleaned conversation (`history`'s turns, then the prompt) with one image slot in the first
    turn and run the processor; `history` is checked by `hap.inputs.check_history`."""
    prompt, history, notes = conversation(processor, prompt, history, limits)
    return *encode(processor, image, prompt, history), notes


def encode(processor, image: Image.Image, prompt: str, history: Sequence[tuple[str, str]]) -> tuple[dict, str]:
    """(processor inputs, prompt text) of an already cleaned conversation."""
    text = chat_prompt(processor, prompt, history)
    return processor(images=image, text=text, return_tensors="pt"), text


def conversation(processor, prompt: str, history, limits: InputLimits) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(prompt, history, notes) cleaned of the processor's special tokens (`hap.inputs.clean_conversation`)."""
    tok = processor.tokenizer
    specials = {t for t in (*tok.all_special_tokens, getattr(processor, "image_token", None)) if t}
    return clean_conversation(prompt, history, specials, limits)


def run(
    model,
    processor,
    image,
    prompt: str,
    config: HAPConfig | None = None,
    max_new_tokens: int = 32,
    trace: bool = True,
    limits: InputLimits = DEFAULT_LIMITS,
    history: Sequence[tuple[str, str]] = (),
) -> Result:
    """Run the full HAP pipeline on one image and prompt; greedy decoding on the pruned cache.

    `history`: earlier `(question, answer)` turns about the same image (a list of `[question, answer]` pairs of
    strings); the prompt is the chat template over the whole conversation, and the pruner's rows come from the
    new question's turn only (`question_lead`).

    Bad input raises ValueError naming the problem; running out of memory raises MemoryError
    after the memory is freed, so the next call can succeed.
    """
    config = config or HAPConfig()
    config.validate()
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= 1024:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer in [1, 1024]")
    try:
        return _run(model, processor, image, prompt, config, max_new_tokens, trace, limits, history)
    except (torch.OutOfMemoryError, MemoryError) as err:
        free_memory()
        device = next(model.parameters()).device
        raise MemoryError(
            f"out of memory on {device.type} while answering ({err.__class__.__name__}); memory was freed. "
            "Try a smaller image, fewer new tokens or a smaller model"
        ) from err


def check_context(model, tokens: int, max_new_tokens: int, history: bool = False) -> None:
    """ValueError when a prompt of `tokens` tokens and `max_new_tokens` exceed the model's positions."""
    limit = getattr(model.config.text_config, "max_position_embeddings", None)
    if limit is not None and tokens + max_new_tokens > limit:
        raise ValueError(
            f"prompt too long: {tokens} tokens + max_new_tokens={max_new_tokens} exceed the model's {limit} "
            "positions; shorten the prompt" + (" or the conversation" if history else "")
        )


def _run(model, processor, image, prompt: str, config: HAPConfig, max_new_tokens: int, trace: bool,
         limits: InputLimits, history: Sequence[tuple[str, str]]) -> Result:
    t0 = time.perf_counter()
    prompt, history, notes = conversation(processor, prompt, history, limits)
    picture = load_image(image, limits)
    inputs, text = encode(processor, picture, prompt, history)
    device = next(model.parameters()).device
    inputs = inputs.to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    T = inputs["input_ids"].shape[1]
    check_context(model, T, max_new_tokens, bool(history))
    patch = apply(model, config, trace=trace, tail=template_tail(processor), lead=question_lead(processor, history))
    try:
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
        generate_s = time.perf_counter() - t1
    finally:
        remove(model)
    answer = processor.decode(out[0, T:], skip_special_tokens=True).strip()
    where = layout(model, inputs, picture.size)
    N, grid = where.num_visual, where.views[0].grid
    shape, st = decoder_shape(model), patch.state
    facts = Outcome(config.resolved(shape.layers), shape, model.config.text_config.num_attention_heads, N, T,
                st.schedule if st else None, st.cuts if st else [], st.tracer if st else None, st.curve if st else None)
    result = to_result(facts, answer, text, grid, notes)
    result.history = [list(turn) for turn in history]
    result.layout = where.to_dict()
    lab = PLANTS.get(model)
    result.plant = None if lab is None else lab.report(result.head_class)
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
