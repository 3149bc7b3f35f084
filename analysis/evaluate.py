"""Greedy question-answering accuracy of a LLaVA-style model on synthetic scene questions.

CLI (reproduces the model card's held-out figures)::

    python -m analysis.evaluate --model assets/tiny-llava --seeds 500000:500300 --per-scene 9 [--followup]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterable

import torch

from analysis.scenes import QTYPES, Question, Scene, heldout_items
from hap.runs.run import chat_prompt


@torch.no_grad()
def answer(model, processor, images: list, questions: list[str], max_new_tokens: int = 4,
           histories: list[tuple] | None = None) -> list[str]:
    """Greedy answers (decoded, special tokens skipped, stripped) for a batch of image/questions, each
    asked after its earlier ``(question, answer)`` turns in ``histories`` (default: none)."""
    histories = histories or [()] * len(questions)
    inputs = processor(images=images, text=[chat_prompt(processor, q, h) for q, h in zip(questions, histories)],
                       padding=True, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1]:].cpu()
    return [s.strip() for s in processor.batch_decode(new, skip_special_tokens=True)]


def first_turns(items: list[tuple[Scene, Question]]) -> list[tuple]:
    """A conversation's first turn for each item: the item before it about the same scene (question and
    its right answer), or for a scene's first item the background question; ``((question, answer),)``."""
    out = []
    for i, (scene, _) in enumerate(items):
        if i and items[i - 1][0].seed == scene.seed:
            out.append(((items[i - 1][1].text, items[i - 1][1].answer),))
        else:
            out.append((("is the background dark or light ?", scene.background),))
    return out


def evaluate(model, processor, items: Iterable[tuple[Scene, Question]],
             batch_size: int = 32, followup: bool = False) -> dict:
    """Exact-match accuracy of greedy one-word answers; with ``followup`` each question is the second
    turn of a conversation whose first turn is ``first_turns``.

    Returns ``{"color": acc, "shape": acc, "exist": acc, "overall": acc, "n": {qtype: count,
    "overall": count}}``; a question type with no items gets accuracy ``nan``.
    """
    was_training = model.training
    model.eval()
    correct = {t: 0 for t in QTYPES}
    count = {t: 0 for t in QTYPES}
    items = list(items)
    histories = first_turns(items) if followup else [()] * len(items)
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        preds = answer(model, processor, [s.image for s, _ in chunk], [q.text for _, q in chunk],
                       histories=histories[start:start + batch_size])
        for (_, q), pred in zip(chunk, preds):
            count[q.qtype] += 1
            correct[q.qtype] += int(pred == q.answer)
    model.train(was_training)
    result: dict = {t: correct[t] / count[t] if count[t] else float("nan") for t in QTYPES}
    total = sum(count.values())
    result["overall"] = sum(correct.values()) / total if total else float("nan")
    result["n"] = {**count, "overall": total}
    return result


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="assets/tiny-llava")
    parser.add_argument("--seeds", default="500000:500300", help="held-out seed range start:stop")
    parser.add_argument("--per-scene", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--followup", action="store_true",
                        help="ask each question as a conversation's second turn (first_turns)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, stop = (int(v) for v in args.seeds.split(":"))
    processor = AutoProcessor.from_pretrained(args.model)
    model = LlavaForConditionalGeneration.from_pretrained(args.model)
    result = evaluate(model, processor, heldout_items(range(start, stop), args.per_scene), followup=args.followup)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
