"""`hap.run`: one image + prompt through the patched model -> `Result`, everything the app draws."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from PIL import Image

from ..config import HAPConfig
from ..options import ProcessorOptions
from ..patch import adapter_for, apply, batch, hooks, layout, remove, resizes_image, visual_tokens
from ..patch.decoder import decoder_shape
from ..patch.prefix import sharing_layers
from ..patch.processors import processor_options
from ..planning.budget import plan
from ..planning.flops import Schedule
from ..pruners import pruner_for
from .inputs import DEFAULT_LIMITS, InputLimits, clean_conversation, load_image
from .trace import CutTrace, Outcome, Result, to_result


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
    turn and run the processor; `history` is checked by `hap.runs.inputs.check_history`."""
    prompt, history, notes = conversation(processor, prompt, history, limits)
    return *encode(processor, image, prompt, history), notes


def encode(processor, image: Image.Image, prompt: str, history: Sequence[tuple[str, str]]) -> tuple[dict, str]:
    """(processor inputs, prompt text) of an already cleaned conversation."""
    text = chat_prompt(processor, prompt, history)
    return processor(images=image, text=text, return_tensors="pt"), text


def conversation(processor, prompt: str, history, limits: InputLimits) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(prompt, history, notes) cleaned of the processor's special tokens (`hap.runs.inputs.clean_conversation`)."""
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
    options: ProcessorOptions | dict | None = None,
) -> Result:
    """Run the full HAP pipeline on one image and prompt; greedy decoding on the pruned cache.

    `history`: earlier `(question, answer)` turns about the same image (a list of `[question, answer]` pairs of
    strings); the prompt is the chat template over the whole conversation, and the pruner's rows come from the
    new question's turn only (`question_lead`).

    `options`: the processor options (`hap.options.ProcessorOptions`, or a dict by name: pan-and-scan, max tiles,
    min / max pixels, ...) of this run, None for the checkpoint's own; an option the model's family does not take is
    refused by name.

    Bad input raises ValueError naming the problem; running out of memory raises MemoryError
    after the memory is freed, so the next call can succeed.
    """
    config = config or HAPConfig()
    config.validate()
    _check_new_tokens(max_new_tokens)
    try:
        with processor_options(model, processor, options):
            p = prepare(model, processor, image, prompt, max_new_tokens, limits, history)
            return alone(model, processor, for_config(model, processor, p, config), config, trace, max_new_tokens)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(model, err) from err


def check_context(model, tokens: int, max_new_tokens: int, history: bool = False) -> None:
    """ValueError when a prompt of `tokens` tokens and `max_new_tokens` exceed the model's positions."""
    limit = getattr(model.config.text_config, "max_position_embeddings", None)
    if limit is not None and tokens + max_new_tokens > limit:
        raise ValueError(
            f"prompt too long: {tokens} tokens + max_new_tokens={max_new_tokens} exceed the model's {limit} "
            "positions; shorten the prompt" + (" or the conversation" if history else "")
        )


@dataclass
class Resized:
    """How a run whose method resizes the image (`Pruner.resizes_image`: downsample on dynamic resolution) stands to
    the original image's unpruned run, which its counts, FLOPs and maps are reported against (`outcome`)."""

    original: dict  # the processor's output on the original image (its layout is the one drawn)
    num_visual: int  # N: the original image's visual tokens
    prompt_len: int  # T: the original image's prompt tokens
    planned: int  # the budget's count of the N (`hap.planning.budget.plan`)
    kept: list[int]  # [N'] per visual token of the resized image (raster order), the original one under its top-left
    #                  corner (`Pruner.resized_kept`)

    def outcome(self, facts: Outcome) -> Outcome:
        """`facts` of the run on the resized image as a run on the original one: one cut before layer 0 keeping the
        N' tokens (at their original indices `kept`) of the N, the traced maps on the original grid."""
        kept, n = torch.tensor(self.kept)[None], len(self.kept)
        schedule = Schedule(self.num_visual, facts.shape.layers, [0], [n], facts.config.retain,
                            planned=[] if n == self.planned else [self.planned])
        return replace(facts, num_visual=self.num_visual, prompt_len=self.prompt_len, schedule=schedule,
                       cuts=[CutTrace(0, [], kept)],
                       tracer=None if facts.tracer is None else facts.tracer.regrid(kept, self.num_visual))


@dataclass
class Prepared:
    """One request's inputs, cleaned and encoded once for every run of it."""

    inputs: dict  # the processor's output on the model's device, pixels in the model's dtype
    text: str  # the chat prompt
    picture: Image.Image  # the loaded image
    history: list[tuple[str, str]]  # the cleaned earlier turns
    notes: list[str]  # what the cleaning changed
    tail: int  # `template_tail`
    lead: int  # `question_lead`
    prepare_s: float  # seconds to clean, load and encode
    question: str = ""  # the cleaned question, no chat template (what `cdpruner` reads)
    resized: Resized | None = None  # `inputs` are of the image resized for the method (`for_config`); None: as given

    @property
    def prompt_len(self) -> int:
        return self.inputs["input_ids"].shape[1]


def prepare(model, processor, image, prompt: str, max_new_tokens: int, limits: InputLimits,
            history: Sequence[tuple[str, str]]) -> Prepared:
    """Clean the conversation, load the image, run the processor and check the context length."""
    t0 = time.perf_counter()
    prompt, history, notes = conversation(processor, prompt, history, limits)
    picture = load_image(image, limits)
    inputs, text = encode(processor, picture, prompt, history)
    inputs = on_device(model, inputs)
    check_context(model, inputs["input_ids"].shape[1], max_new_tokens, bool(history))
    return Prepared(inputs, text, picture, history, notes, template_tail(processor), question_lead(processor, history),
                    time.perf_counter() - t0, prompt)


def on_device(model, inputs: dict) -> dict:
    """The processor's output on the model's device, the pixels in the model's dtype."""
    inputs = inputs.to(next(model.parameters()).device)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return inputs


def for_config(model, processor, p: Prepared, config: HAPConfig) -> Prepared:
    """`p` as `config` runs it: `p` itself, except for a method that resizes the image on this model
    (`Pruner.resizes_image`: downsample on dynamic resolution), whose processor is given the image resized so that it
    emits the budget's count of visual tokens (`hap.planning.budget.plan`'s count on the original image, within one token
    row: `Pruner.image_size` at the processor's settings in effect, `image_settings` of the adapter). The decoder
    then runs every token of the smaller image; each is reported at the original token under its top-left corner
    (`Resized`). Needs the processor options of the run in effect; ValueError where the processor's pixel bounds
    (min_pixels) do not let the image shrink to the budget."""
    if p.resized is not None or not resizes_image(model, config):
        return p
    adapter, pruner = adapter_for(model), pruner_for(config)
    t0 = time.perf_counter()
    N = int(visual_tokens(model, p.inputs)[0].sum())
    schedule = plan(config, decoder_shape(model), N, p.prompt_len - N)
    k = (schedule.planned or schedule.kept)[0]  # the budget's count (not the square-grid rule's, `realised`)
    width, height = p.picture.size
    size = pruner.image_size(height, width, k, adapter.image_settings(processor))
    picture = p.picture if size == (height, width) else p.picture.resize(size[::-1], Image.Resampling.BICUBIC)
    inputs = on_device(model, encode(processor, picture, p.question, p.history)[0])
    n = int(visual_tokens(model, inputs)[0].sum())
    kept = pruner.resized_kept(adapter.visual_grid(model, p.inputs, N), adapter.visual_grid(model, inputs, n))
    notes = [] if picture is p.picture else [
        f"method={config.method!r} resized the image from {width}x{height} to {size[1]}x{size[0]} px: the processor "
        f"emits {n} of its {N} visual tokens (the budget plans {k})"]
    return replace(p, inputs=inputs, notes=[*p.notes, *notes], resized=Resized(p.inputs, N, p.prompt_len, k, kept),
                   prepare_s=p.prepare_s + time.perf_counter() - t0)




def generate(model, p: Prepared, config: HAPConfig, trace: bool, max_new_tokens: int, **kwargs):
    """(the patch, `generate`'s output, its seconds): greedy decoding of `p` on the model patched with `config`."""
    patch = apply(model, config, trace=trace, tail=p.tail, lead=p.lead, question=p.question,
                  resized=p.resized is not None)
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**p.inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, **kwargs)
        return patch, out, time.perf_counter() - t0
    finally:
        remove(model)


def alone(model, processor, p: Prepared, config: HAPConfig, trace: bool, max_new_tokens: int) -> Result:
    """One run of `p`, prefilled and decoded on its own."""
    patch, out, generate_s = generate(model, p, config, trace, max_new_tokens)
    timings = {"prefill_s": patch.prefill_seconds, "decode_s": generate_s - patch.prefill_seconds,
               "generate_s": generate_s, "decode_batch": 1}
    return finish(model, processor, p, config, patch, out[0, p.prompt_len:], timings)


def finish(model, processor, p: Prepared, config: HAPConfig, patch, answer: torch.Tensor, timings: dict) -> Result:
    """The `Result` of one run: `answer` long [new] its generated tokens, `timings` its seconds after `prepare`."""
    where = layout(model, p.inputs if p.resized is None else p.resized.original, p.picture.size, processor)
    shape, st = decoder_shape(model), patch.state
    N, grid = where.num_visual, where.views[0].grid
    facts = Outcome(config.resolved(shape.layers), shape, model.config.text_config.num_attention_heads, N,
                    p.prompt_len, st.schedule if st else None, st.cuts if st else [], st.tracer if st else None,
                    st.pruner.curve(st) if st else None)
    if p.resized is not None:
        facts = p.resized.outcome(facts)
    result = to_result(facts, processor.decode(answer, skip_special_tokens=True).strip(), p.text, grid, p.notes)
    result.history = [list(turn) for turn in p.history]
    result.layout = where.to_dict()
    for plugin in hooks.attached(model):  # the head lab's plan, where one is planted
        plugin.annotate(result)
    result.timings = {"prepare_s": p.prepare_s, **timings, "scoring_s": st.scoring_seconds if st else 0.0}
    return result


def run_together(model, processor, image, prompt: str, runs: Sequence[tuple[HAPConfig, bool]],
                 max_new_tokens: int = 32, limits: InputLimits = DEFAULT_LIMITS,
                 history: Sequence[tuple[str, str]] = (),
                 options: ProcessorOptions | dict | None = None, replay: int | None = None) -> list[Result]:
    """`run` of each `(config, trace)` of `runs` on one image and prompt (`options`: see `run`), prepared once and,
    where the model allows
    (`hap.patch.batch.refusal`), their answers decoded as one batch after each run's own prefill: the same answers
    as `run` one by one. Each result's timings give its own prefill and the batch's decode (`decode_batch`: runs
    decoded together; 1 where each decoded alone).

    `replay`: the index of a run whose prefill is replayed traced right after it (`traced_replay`): its result, the
    maps and the answer of that run, is appended after the others'; the run itself is timed as it runs alone."""
    for config, _ in runs:
        config.validate()
    _check_new_tokens(max_new_tokens)
    try:
        with processor_options(model, processor, options):
            p = prepare(model, processor, image, prompt, max_new_tokens, limits, history)
            return _together(model, processor, [(for_config(model, processor, p, config), config, trace)
                                                for config, trace in runs], max_new_tokens, replay)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(model, err) from err


def run_prepared(model, processor, jobs: Sequence[tuple[Prepared, HAPConfig, bool]],
                 max_new_tokens: int = 32) -> list[Result]:
    """`run` of each `(prepared input, config, trace)` job, the inputs already prepared (`prepare`, then `for_config`
    for its config, under the run's processor options): each prefilled alone, the answers decoded as one batch where
    the model allows, as `run_together` does; for a caller that needed the prepared input first (`hap.runs.keeps`)."""
    for _, config, _ in jobs:
        config.validate()
    _check_new_tokens(max_new_tokens)
    try:
        return _together(model, processor, list(jobs), max_new_tokens)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(model, err) from err


def run_batch(model, processor, images: Sequence, prompts: Sequence[str], config: HAPConfig | None = None,
              max_new_tokens: int = 32, trace: bool = False, limits: InputLimits = DEFAULT_LIMITS,
              options: ProcessorOptions | dict | None = None) -> list[Result]:
    """`run` of `config` on each `(image, prompt)` pair of a batch (`options`: see `run`), images of any sizes: each
    sample is prefilled
    alone, so its budget and retained share count its own visual tokens (a tiled or dynamic-resolution image gives
    its own count), and the answers are decoded as one batch where the model allows (`hap.patch.batch.refusal`):
    the results of `run` one by one."""
    config = config or HAPConfig()
    config.validate()
    _check_new_tokens(max_new_tokens)
    if isinstance(prompts, str) or len(images) != len(prompts) or not prompts:
        raise ValueError(f"run_batch takes one prompt per image: got {len(images)} images and "
                         f"{'a string' if isinstance(prompts, str) else len(prompts)} prompts")
    try:
        with processor_options(model, processor, options):
            jobs = [(for_config(model, processor, prepare(model, processor, image, prompt, max_new_tokens, limits, ()),
                                config), config, trace) for image, prompt in zip(images, prompts)]
            return _together(model, processor, jobs, max_new_tokens)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(model, err) from err


def prefill(model, p: Prepared, config: HAPConfig, trace: bool = False, **kwargs):
    """(the run's `batch.Prefilled`, `generate`'s output: its first token `sequences` [1, T + 1], its seconds): the
    prefill of one run alone, its cache kept for a batched continuation (`batch.decode`); `kwargs` go to `generate`
    (e.g. `output_logits=True`)."""
    patch, out, seconds = generate(model, p, config, trace, 1, return_dict_in_generate=True, **kwargs)
    deltas = getattr(model.model, "rope_deltas", None)
    return batch.Prefilled(patch, out.cache, out.sequences, None if deltas is None else deltas.clone()), out, seconds


@dataclass
class Together:
    """Runs prefilled alone, their answers continued as one batch (`prefill_then_decode`)."""

    runs: list  # [B] each run's `batch.Prefilled`
    outputs: list  # [B] each prefill's `generate` output
    seconds: list[float]  # [B] each prefill's seconds
    tokens: torch.Tensor  # long [B, n] each run's generated tokens, its first one included (up to max_new_tokens)
    logits: tuple  # the continued steps' logits [B, vocab] each, where the decode was asked for them
    decode_s: float  # the batched continuation's seconds
    replayed: tuple | None = None  # the traced replay's (`batch.Prefilled`, seconds), where one was asked for


def prefill_then_decode(model, jobs: Sequence[tuple[Prepared, HAPConfig, bool]], max_new_tokens: int,
                        prefill_kwargs: dict | None = None, on_prefill: Callable[[int], None] | None = None,
                        replay: int | None = None, **decode_kwargs) -> Together:
    """Prefill each `(prepared input, config, trace)` job alone (`prefill`, with `prefill_kwargs`; `on_prefill(i)`
    called before job i's; job `replay`'s prefill replayed traced right after it, `traced_replay`), then continue the
    answers as one batch (`batch.decode`, with `decode_kwargs`) up to `max_new_tokens` in all, unless every answer
    ended at its first token or only one token is asked for. The model must allow a batch (`batch.refusal`)."""
    runs, outputs, seconds, replayed = [], [], [], None
    for i, (p, config, trace) in enumerate(jobs):
        if on_prefill is not None:
            on_prefill(i)
        if i == replay:
            (done, out, generate_s), replayed = traced_replay(model, p, config, **(prefill_kwargs or {}))
        else:
            done, out, generate_s = prefill(model, p, config, trace, **(prefill_kwargs or {}))
        runs.append(done)
        outputs.append(out)
        seconds.append(generate_s)
    tokens, logits, ends = torch.cat([done.first[:, -1:] for done in runs]), (), set(eos_ids(model))
    t0 = time.perf_counter()
    if max_new_tokens > 1 and not all(int(token) in ends for token in tokens[:, 0]):
        with torch.inference_mode():
            out = batch.decode(model, runs, max_new_tokens - 1, return_dict_in_generate=True, **decode_kwargs)
        tokens, logits = out.sequences[:, max(done.prompt_len for done in runs):], out.logits or ()
    return Together(runs, outputs, seconds, tokens, logits, time.perf_counter() - t0, replayed)


def traced_replay(model, p: Prepared, config: HAPConfig, **kwargs) -> tuple[tuple, tuple]:
    """(`prefill`'s answer for `config` untraced, (the `batch.Prefilled` of the same prefill replayed traced, its
    seconds)): the run timed as it runs alone, then again with the maps recorded for the figures, every decoder layer's
    projections and feed-forward blocks read from the first prefill where their input is the same
    (`hap.patch.prefix.sharing_layers`: the same numbers; the attention, the capture and the tracing run again). The
    replay is not decoded: its answer is the run's."""
    with sharing_layers(model):
        first = prefill(model, p, config, False, **kwargs)
        replayed, _, seconds = prefill(model, p, config, True, **kwargs)
    return first, (replayed, seconds)


def _together(model, processor, jobs: list[tuple[Prepared, HAPConfig, bool]], max_new_tokens: int,
              replay: int | None = None) -> list[Result]:
    """The results of `(prepared input, config, trace)` jobs: each prefilled alone, the answers decoded as one batch
    where the model allows, else each alone; with `replay`, that job's traced replay appended (`run_together`)."""
    if len(jobs) < 2 or max_new_tokens < 2 or batch.refusal(model) is not None:
        results, traced = [], []
        for i, (p, config, trace) in enumerate(jobs):
            with sharing_layers(model) if i == replay else nullcontext():  # decode steps are never shared
                results.append(alone(model, processor, p, config, trace, max_new_tokens))
                if i == replay:
                    traced.append(replace(alone(model, processor, p, config, True, 1), answer=results[i].answer))
        return results + traced
    done = prefill_then_decode(model, jobs, max_new_tokens, replay=replay)
    ends, results, answers = set(eos_ids(model)), [], []
    for i, ((p, config, _), run, seconds) in enumerate(zip(jobs, done.runs, done.seconds)):
        tokens = done.tokens[i].tolist()
        stop = next((j + 1 for j, t in enumerate(tokens) if t in ends), len(tokens))  # where this run's answer ended
        answers.append(done.tokens[i, :stop])
        timings = {"prefill_s": run.patch.prefill_seconds, "generate_s": seconds + done.decode_s,
                   "decode_s": seconds - run.patch.prefill_seconds + done.decode_s, "decode_batch": len(jobs)}
        results.append(finish(model, processor, p, config, run.patch, answers[i], timings))
    if done.replayed is not None:
        (run, seconds), (p, config, _) = done.replayed, jobs[replay]
        timings = {"prefill_s": run.patch.prefill_seconds, "generate_s": seconds,
                   "decode_s": seconds - run.patch.prefill_seconds, "decode_batch": 0}
        results.append(finish(model, processor, p, config, run.patch, answers[replay], timings))
    return results


def eos_ids(model) -> list[int]:
    """The token ids that end an answer (the generation config's `eos_token_id`, one or a list)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _check_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= 1024:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer in [1, 1024]")


def _out_of_memory(model, err: BaseException) -> MemoryError:
    """A MemoryError saying what ran out, after freeing the memory."""
    free_memory()
    device = next(model.parameters()).device
    return MemoryError(
        f"out of memory on {device.type} while answering ({err.__class__.__name__}); memory was freed. "
        "Try a smaller image, fewer new tokens or a smaller model"
    )


def free_memory() -> None:
    """Release what a failed run left behind (Python garbage, cached GPU blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
