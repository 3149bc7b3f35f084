"""A conversation about one image on the page: its turns, each with its kept tokens and the page's outputs of
its run, so that picking a turn shows it in every view.

`/analyze` takes the earlier turns as `history` (`[question, answer]` pairs; `hap.run` builds the chat prompt
over them). The page keeps its own turns in a `gr.State`; a history that is not this page's conversation (an
API caller's, or a new conversation) starts the turns afresh, the given ones marked as not run here. A follow-up
of this page's conversation must ask about its image with its model (each turn run here records both), so that
"since turn k" compares kept tokens of one image and one model; after either changed it is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .edit import kept_changes


@dataclass
class Turn:
    """One question and the chosen method's answer; `kept` per group and `outputs` (by output name) of its run,
    both empty for a turn given as history and not run on this page."""

    question: str
    answer: str
    kept: list[list[int]] = field(default_factory=list)
    num_visual: int = 0
    outputs: dict = field(default_factory=dict)
    image: str = ""  # the image it was run on (`app.pipeline.image_key` of its pixels), "" when not run here
    model: str = ""  # the model that answered it, "" when not run here


def continued(turns: Sequence[Turn] | None, history: Sequence[tuple[str, str]], image: str, model: str) -> list[Turn]:
    """The page's stored turns when `history` is exactly their questions and answers, else `history` as turns not
    run here (a new conversation, or an API caller's own history). ValueError when the stored turns were run on
    another image (`image`: the new turn's key) or by another model than `model`."""
    stored = list(turns or [])
    if not history or [(t.question, t.answer) for t in stored] != [tuple(pair) for pair in history]:
        return [Turn(q, a) for q, a in history]
    for i, turn in enumerate(stored):
        changed = [what for what, same in (("image", turn.image == image), ("model", turn.model == model))
                   if turn.outputs and not same]
        if changed:
            raise ValueError(f"the {' and the '.join(changed)} changed since {label(i)} of this conversation: a "
                             "follow-up asks about the conversation's own image with its model, and kept tokens are "
                             f"compared only within one. Press Run (new conversation) to ask about this "
                             f"{' with this '.join(changed)}.")
    return stored


def label(index: int) -> str:
    return f"turn {index + 1}"


def pick(turns: Sequence[Turn], choice: str) -> Turn:
    """The turn labelled `choice`; ValueError when it has no stored run."""
    labels = [label(i) for i in range(len(turns))]
    if choice not in labels:
        raise ValueError(f"no {choice!r} in this conversation ({', '.join(labels) or 'no turns yet'})")
    turn = turns[labels.index(choice)]
    if not turn.outputs:
        raise ValueError(f"{choice} was given as history, not run on this page: nothing to show")
    return turn


def kept_text(turn: Turn, previous: tuple[int, Turn] | None) -> str:
    """The turn's kept tokens per group, and how they changed since the `previous` (index, turn) run here."""
    if not turn.kept:
        return "(given as history, not run here)"
    text = "kept tokens: " + ", ".join(f"group {g} {len(k)}/{turn.num_visual}" for g, k in enumerate(turn.kept))
    if previous is not None:
        index, before = previous
        changes = [f"group {g} +{len(gained)} −{len(lost)}"
                   for g, (_, lost, gained) in enumerate(kept_changes(before.kept, turn.kept))]
        text += f"; since {label(index)}: " + ", ".join(changes)
    return text


def messages(turns: Sequence[Turn]) -> list[dict]:
    """The conversation as chatbot messages: each question, then its answer with its kept tokens."""
    out, previous = [], None
    for i, turn in enumerate(turns):
        out.append({"role": "user", "content": f"{label(i)}: {turn.question}"})
        out.append({"role": "assistant", "content": f"**{turn.answer}**\n\n{kept_text(turn, previous)}"})
        previous = (i, turn) if turn.kept else previous
    return out


def rows_note(earlier: int, rows: str) -> str:
    """Markdown line for the explanation: which prompt rows scored a follow-up's cuts."""
    if not earlier:
        return ""
    which = {"last": "the last prompt token (after this turn's question)",
             "prompt": "this turn's prompt rows (its question and the template's tail)",
             "question": "this turn's question rows"}[rows]
    return (f"\n- Follow-up after {earlier} earlier turn{'s' if earlier > 1 else ''}: the prompt is the chat template "
            f"over the whole conversation (the image in the first turn); the cuts were scored by {which}, never by "
            "the earlier turns' tokens.")


def history(turns: Sequence[Turn]) -> list[list[str]]:
    """The turns as the `history` of the next follow-up."""
    return [[t.question, t.answer] for t in turns]
