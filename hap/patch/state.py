"""The pruning state of one prefill (docs/method.md §9): which tokens are present, what was captured,
what each cut keeps.

Architecture-free and method-free: adapters (`hap.patch.*`) feed it tensors at each decoder layer and apply the
index lists it returns to hidden states, masks, positions and the cache. Positions below are
indices into the *current* (possibly already shortened) sequence unless said otherwise.

Layout of a sample's sequence, which cuts preserve: [prefix text][visual tokens][prompt rows][gap],
where the prompt rows are every text token after the last visual token (or only the last token) and
the gap is what follows the sample's last real token (right padding, found from the attention mask).
Cuts drop visual tokens only, so in a sequence of length T a sample's rows are the P positions
ending `gap + 1` before the end, whatever was cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import HAPConfig
from ..planning.budget import plan
from ..planning.flops import DecoderShape, Schedule
from ..pruners import pruner_for
from ..pruners.base import Cut, Pruner
from ..pruners.cues import VisionCues
from ..pruners.merge import key_bias, merge_dropped
from ..pruners.recycle import recycle
from ..runs.trace import CutTrace, Tracer
from ..scoring.heads import HeadStats, detect_sinks, head_stats


@dataclass
class PruneState:
    """Bookkeeping of one prefill over a batch; built by `PruneState.start`. A pruner reads it through
    `hap.pruners.base.State`."""

    config: HAPConfig
    pruner: Pruner  # the method: what it captures, where it cuts, how it selects, how positions continue
    schedule: Schedule | None
    num_visual: int
    row_valid: torch.Tensor  # bool [batch, P]
    row_gap: torch.Tensor  # long [batch] tokens after each sample's last prompt row (right padding)
    seq_index: torch.Tensor  # long [batch, T_cur] original position of each current token
    visual_pos: torch.Tensor  # long [batch, N_cur] current positions of the visual tokens
    kept_orig: torch.Tensor  # long [batch, N_cur] original visual index (0..N-1) of each
    attention_mask: torch.Tensor | None  # [batch, T0] the 2-D padding mask of the prompt, or None
    capture_layers: set[int]  # layers whose prompt rows are recomputed (on the tokens they run on)
    scoring_layers: set[int]  # the captured layers that score some cut
    lookahead_layers: set[int]  # layers also captured before their own cut, to score it (a cut before layer 0; pdrop)
    tracer: Tracer | None  # records the maps for the figures; None when not tracing
    prompt_len: int
    priority: torch.Tensor | None = None  # [batch, N] ranked above the scores at every cut, by original index
    question: torch.Tensor | None = None  # [M, E] the raw question's cue (`Pruner.embed_question`: CLIP embeddings)
    grids: tuple[tuple[int, int], ...] = ()  # the (rows, cols) of each view's token grid in token order, from the
    #                                     adapter where the pruner reads them (`Pruner.views`, downsample); () elsewhere
    vision: VisionCues | None = None  # the vision tower's cues of this prefill (`Pruner.needs_cls`)
    whole_pos: torch.Tensor | None = None  # long [batch, R] current positions of the image's tokens outside the
    #                                     visual ones (LLaVA-NeXT's newlines), for a pruner that selects over them too
    merged: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions [B, c], embeds [B, c, D]) to write into the
    #                                     hidden states after the cut: VisionZip's block, merge's kept ones
    sizes: torch.Tensor | None = None  # with a merge: [B, N_cur] original tokens each visual token stands for
    key_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # cut layer -> [B, T_group] log-size bias per key
    recycled: torch.Tensor | None = None  # bool [B, N_cur] the visual tokens that are recycled cluster means (their
    #                                     kept_orig is the cluster centre's); None for a pruner that does not recycle
    appended: torch.Tensor | None = None  # [B, c, D] recycled tokens of the cut just made, for the adapter to append
    memo: dict = field(default_factory=dict)  # the pruner's own values across the cuts of this prefill
    cuts: list[CutTrace] = field(default_factory=list)
    segment_index: dict[int, torch.Tensor] = field(default_factory=dict)  # cut layer -> seq_index after it
    scoring_seconds: float = 0.0  # time in the capture (timed by the adapter) and in the cuts
    # (layer, lookahead) -> (attn, head stats, sink tokens, logits or None) of a captured layer, until the cut it scores
    _maps: dict[tuple[int, bool], tuple[torch.Tensor, HeadStats, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict)
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)  # sequence length -> row_positions

    @classmethod
    def start(
        cls,
        config: HAPConfig,
        visual_mask: torch.Tensor,
        attention_mask: torch.Tensor | None,
        shape: DecoderShape,
        trace: bool,
        priority: torch.Tensor | None = None,
        tail: int = 0,
        lead: int = 0,
        image_mask: torch.Tensor | None = None,
        grids: tuple[tuple[int, int], ...] = (),
    ) -> "PruneState":
        """Plan one prefill. visual_mask bool [batch, T]; attention_mask [batch, T] (1 = token) or None;
        priority [batch, N] or None: an analysis hook, values that rank the visual tokens (by original
        index) before the method's scores at every cut (e.g. 1 on the patches that answer the question); with a
        batch-1 input, a priority of V > 1 rows fans the input out into V variants: the layers before the first cut
        run once (batch 1), the cut gives each variant its own kept tokens and later layers run the V as a batch
        (a prefill only: its cache mixes batch sizes; `hap.utility`);
        tail: tokens of the chat template after the question (e.g. " ASSISTANT:"), left out by rows="question";
        lead: tokens between the image and the question (a follow-up's earlier turns), left out by every rows choice;
        image_mask bool [batch, T]: every token of the image, the visual ones and those the pruner keeps whole
        (LLaVA-NeXT's newline tokens): the prompt rows start after its last one (default: `visual_mask`);
        grids: the (rows, cols) of each view's token grid in token order (every sample's), for a pruner that reads them
        (`Pruner.views`): they plan its count (`hap.planning.budget.plan`) and its cut pools them. ValueError where the batch
        exceeds the pruner's `max_batch`.

        The state keeps `config` with its model-dependent defaults resolved for `shape`."""
        config = config.resolved(shape.layers)
        if priority is not None and visual_mask.shape[0] == 1 < priority.shape[0]:  # variants of one input
            visual_mask = visual_mask.expand(priority.shape[0], -1)
            attention_mask = None if attention_mask is None else attention_mask.expand(priority.shape[0], -1)
        B, T = visual_mask.shape
        counts = visual_mask.sum(-1)
        if not bool((counts == counts[0]).all()):
            raise ValueError(f"every sample of a batch needs the same number of visual tokens; got {counts.tolist()}: "
                             "give images of different sizes to hap.run_batch (each its own budget)")
        N = int(counts[0])
        if N == 0:
            raise ValueError("the input holds no visual tokens: the prompt must contain exactly one image")
        if priority is not None and tuple(priority.shape) != (B, N):
            raise ValueError(f"priority must be [batch, visual] = [{B}, {N}]; got {list(priority.shape)}")
        device = visual_mask.device
        positions = torch.arange(T, device=device)
        visual_pos = positions.expand(B, T)[visual_mask].view(B, N)
        pruner = pruner_for(config)
        pruner.check_batch(B)
        schedule = plan(config, shape, N, T - N, grids)
        scoring, lookahead = _scoring_sets(pruner, schedule)
        image_end = visual_pos[:, -1] if image_mask is None else _last_image_token(image_mask, visual_pos[:, -1])
        row_valid, row_gap = _prompt_rows(pruner.rows, image_end, _last_tokens(attention_mask, T), T, tail, lead)
        return cls(
            config=config,
            pruner=pruner,
            schedule=schedule,
            num_visual=N,
            row_valid=row_valid,
            row_gap=row_gap,
            seq_index=positions.expand(B, T).clone(),
            visual_pos=visual_pos,
            kept_orig=torch.arange(N, device=device).expand(B, N).clone(),
            attention_mask=attention_mask,
            capture_layers=set(range(shape.layers)) if trace else set(scoring),
            scoring_layers=scoring,
            lookahead_layers=lookahead,
            tracer=Tracer(N, config.temperature) if trace else None,
            prompt_len=T,
            priority=None if priority is None else priority.float().to(device),
            sizes=None if pruner.merge == "none" else torch.ones(B, N, device=device),
            recycled=torch.zeros(B, N, dtype=torch.bool, device=device) if pruner.recycle else None,
            grids=grids,
            whole_pos=_whole_positions(image_mask, visual_mask) if pruner.whole_tokens else None,
        )

    # --- queries the adapter asks at each layer -------------------------------------------------
    def cut_index(self, layer: int) -> int | None:
        """Index of the cut entering `layer`, or None."""
        if self.schedule is None or layer not in self.schedule.cuts:
            return None
        return self.schedule.cuts.index(layer)

    def row_positions(self, seq_len: int) -> torch.Tensor:
        """long [batch, P] current positions of each sample's prompt rows in a sequence of `seq_len` tokens
        (clamped at 0 for the invalid rows of a short prompt); computed once per length."""
        if seq_len not in self._rows:
            P = self.row_valid.shape[1]
            ends = seq_len - 1 - self.row_gap  # [B]
            self._rows[seq_len] = (ends[:, None] - torch.arange(P - 1, -1, -1, device=ends.device)).clamp_min(0)
        return self._rows[seq_len]

    def decode_positions(self, cached: int, new: int) -> torch.Tensor:
        """long [1, new] positions of a decode step's tokens when the caller gives none: those the stock model
        would take from an unpruned cache. `cached` = tokens in layer 0's cache, which a cut before
        layer 0 shortened by the tokens it dropped."""
        dropped = self.prompt_len - self.segment_index[0].shape[1] if 0 in self.segment_index else 0
        start = cached + dropped
        return torch.arange(start, start + new, device=self.seq_index.device)[None]

    def decode_shift(self, layer: int) -> int:
        """Tokens taken off a decode step's positions in the group from cut `layer`: under a renumbering pruner
        (`Pruner.renumber`) the prompt tokens dropped up to that cut (net of recycled ones), so the step follows the
        group's renumbered prompt 0..T_group-1 (the official PyramidDrop lowers its decode positions so; VisionZip's
        decoder only sees the shorter sequence); 0 where kept tokens keep their original positions."""
        return self.prompt_len - self.segment_index[layer].shape[1] if self.pruner.renumber else 0

    def key_origins(self, layer: int, keys: int) -> torch.Tensor:
        """long [batch, keys] the unpruned position of each of the `keys` keys layer `layer` attends over: the
        prompt tokens its group kept (every prompt token before the first cut), then the tokens generated since."""
        cut = self.group_of(layer)
        prompt = self.seq_index.new_tensor(range(self.prompt_len))[None] if cut is None else self.segment_index[cut]
        new = torch.arange(self.prompt_len, self.prompt_len + keys - prompt.shape[1], device=prompt.device)
        return torch.cat([prompt, new.expand(prompt.shape[0], -1)], 1)

    def bias_at(self, layer: int) -> torch.Tensor | None:
        """float [batch, T_group] the proportional-attention bias per key of the group holding `layer` (its latest
        cut at or before `layer`; docs/method.md §10), or None where no merge happened."""
        return self.key_bias.get(self.group_of(layer))

    def group_of(self, layer: int) -> int | None:
        """The cut that opened the group holding `layer`: the latest cut made at or before it, or None before the
        first cut."""
        return max((c for c in self.segment_index if c <= layer), default=None)

    def key_valid(self) -> torch.Tensor | None:
        """bool [batch, T_cur] padding mask of the current sequence, or None without padding."""
        if self.attention_mask is None:
            return None
        return self.attention_mask.gather(1, self.seq_index).bool()

    # --- capture and cuts -------------------------------------------------------------------------
    def record(self, layer: int, rows: torch.Tensor, hidden: torch.Tensor, lookahead: bool = False,
               logits: torch.Tensor | None = None) -> None:
        """Store layer `layer`'s prompt rows.

        rows [batch, heads, P, T_cur] attention probabilities over every key; hidden [batch, T_cur, d]
        the layer's input hidden states (for the sink detector); logits [batch, heads, P, T_cur] the rows' scaled
        q.k before the softmax, for a pruner that reads them (`Pruner.logits`), else None. A lookahead capture
        (before the layer's own cut) only scores that cut; the layer's trace comes from its capture after the cut.
        """
        device = self.visual_pos.device  # the layer may sit on another device (a model split over GPUs)
        vp = self.visual_pos.to(rows.device)
        columns = vp[:, None, None, :].expand(*rows.shape[:3], -1)
        attn = rows.gather(3, columns).to(device)  # [B, H, P, N_cur]
        if logits is not None:
            logits = logits.gather(3, columns).to(device)  # [B, H, P, N_cur]
        vis_hidden = hidden.expand(vp.shape[0], -1, -1).gather(1, vp.to(hidden.device)[..., None].expand(
            -1, -1, hidden.shape[-1]))  # a fanned-out prefill's layers before its first cut run at batch 1
        c = self.config
        sink = detect_sinks(c.sink_detector, vis_hidden, attn, self.row_valid, c.sink_rho, c.consensus_share,
                            c.consensus_quorum, c.consensus_tokens)
        stats = head_stats(attn, self.row_valid, sink)
        if lookahead or layer in self.scoring_layers:
            self._maps[(layer, lookahead)] = (attn, stats, sink, logits)
        if self.tracer is not None and not lookahead:
            self.tracer.layer(layer, attn, stats, sink, self.row_valid, self.kept_orig)

    def cut(self, layer: int, visual_embeds: torch.Tensor | None = None, keys: torch.Tensor | None = None,
            normed: torch.Tensor | None = None, whole_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the cut entering `layer`; returns long [batch, T_new], the current positions kept. A pruner that
        builds its tokens (VisionZip, docs/method.md §7) leaves them in `merged` for the adapter to write into the
        kept visual slots; a merge (§10) folds the dropped tokens of `visual_embeds` [batch, N_cur, D] (the visual rows
        of the hidden states) into the kept ones, and merge="proportional" records the group's attention bias; a
        pruner may read `visual_embeds` too (`Pruner.embeds`), the previous layer's `keys` [batch, T, d] and
        `normed` output [batch, T, D] (`Pruner.layer_states`), and the rows `whole_embeds` [batch, R, D] of the image's
        tokens at `whole_pos` (`Pruner.whole_tokens`: it may drop those too). Where the rule's count depends on the
        data (per crop on LLaVA-NeXT, newlines dropped), the schedule takes the count the cut really kept (its
        visual tokens less the whole tokens it dropped: what the sequence holds), the budget's count in `planned`."""
        t0 = time.perf_counter()
        g = self.cut_index(layer)
        starts = [0] + self.schedule.cuts
        scored = self.pruner.scoring_layers((starts[g], layer))
        attn = paq = weights = sink = logits = None
        map_keys = [(l, l == layer) for l in scored]
        if scored:
            maps = [self._maps[key] for key in map_keys]
            attn = torch.stack([m[0] for m in maps], 1)  # [B, Lg, H, P, N_cur]
            paq = torch.stack([m[1].paq for m in maps], 1)  # [B, Lg, H]
            weights = self.pruner.head_weights(paq, torch.stack([m[1].visual_share for m in maps], 1), scored)
            sink = torch.stack([m[2] for m in maps]).any(0)  # [B, N_cur] a sink in any scoring layer
            if self.pruner.logits:
                logits = torch.stack([m[3] for m in maps], 1)  # [B, Lg, H, P, N_cur]
            if self.tracer is not None:
                self.tracer.cut(layer, attn, weights, self.row_valid, self.kept_orig)
        n_cur = self.visual_pos.shape[1]
        s = self.schedule
        budget = (s.planned or s.kept)[g]
        selection = self.pruner.select(self, Cut(g, budget, attn, weights, sink, visual_embeds, keys, normed,
                                                 whole_embeds, logits))
        chosen, scores = selection.chosen, selection.scores
        k = chosen.shape[1]
        B, T = self.seq_index.shape
        keep = torch.ones(B, T, dtype=torch.bool, device=self.seq_index.device)
        keep.scatter_(1, self.visual_pos, False)
        keep.scatter_(1, self.visual_pos.gather(1, chosen), True)
        dropped = 0
        if selection.whole is not None:  # the image's other tokens the rule keeps (DivPrune's newlines)
            whole = selection.whole.to(keep.device)
            keep.scatter_(1, self.whole_pos, whole)
            dropped = int((~whole[0]).sum())
        self._record_count(g, k, dropped)
        kept_positions = keep.nonzero()[:, 1].view(B, -1)  # rows keep the same count: equal budgets
        new_pos = keep.long().cumsum(1) - 1
        orig_before = self.kept_orig
        if self.whole_pos is not None:
            self.whole_pos = new_pos.gather(1, self.whole_pos[keep.gather(1, self.whole_pos)].view(B, -1))
        self.visual_pos = new_pos.gather(1, self.visual_pos.gather(1, chosen))
        self.kept_orig = self.kept_orig.gather(1, chosen)
        if selection.tokens is not None:  # the pruner's own tokens; slots before its patches (VisionZip's [CLS]) stay
            self.merged = (self.visual_pos, selection.tokens)  # in the sequence but are no patch: out of the maps
            lead = k - selection.patches.shape[1]
            self.visual_pos, self.kept_orig = self.visual_pos[:, lead:], selection.patches.to(self.kept_orig.device)
        elif self.sizes is not None:
            if k < n_cur:  # a cut that keeps every token merges nothing
                merged, self.sizes = merge_dropped(visual_embeds.to(self.visual_pos.device), self.sizes, chosen)
                self.merged = (self.visual_pos, merged)
            if self.pruner.merge == "proportional" and (k < n_cur or self.key_bias):  # this cut or one before merged
                self.key_bias[layer] = key_bias(self.sizes, self.visual_pos, kept_positions.shape[1])
        order = source = kept_positions
        if self.recycled is not None:
            self.recycled = self.recycled.gather(1, chosen)
        if self.pruner.recycles(g):
            order, source = self._recycle(visual_embeds, scores, chosen, kept_positions, T, orig_before)
        self.seq_index = self.seq_index.gather(1, source)
        self.segment_index[layer] = self.seq_index
        self.cuts.append(CutTrace(layer, scored, self.kept_orig.cpu(), None if paq is None else paq.cpu(),
                                  None if weights is None else weights.cpu(),
                                  None if self.recycled is None else self.recycled.cpu()))
        for key in map_keys:
            del self._maps[key]
        self.scoring_seconds += time.perf_counter() - t0
        return order

    def _recycle(self, visual_embeds: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
                 kept_positions: torch.Tensor, T: int, orig_before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recycle the cut's dropped tokens (`hap.pruners.recycle`) right after the kept visual tokens: updates the visual
        lists (`orig_before` long [B, N_prev]: the original indices before the cut, for the centres) and leaves the
        tokens in `appended`. Returns (order, source), long [B, T']: the new sequence as indices into the T current
        tokens, T + j for the j-th recycled one; and the same with each recycled token read as the last kept visual
        token (its original position, for the padding mask)."""
        recycled, centres = recycle(visual_embeds, scores.to(visual_embeds.device), chosen.to(visual_embeds.device))
        c = recycled.shape[1]
        if c == 0:
            return kept_positions, kept_positions
        device = kept_positions.device
        B, n = kept_positions.shape
        start = self.visual_pos[:, -1:] + 1  # [B, 1] right after the last kept visual token
        idx = torch.arange(n + c, device=device).expand(B, -1)
        inside = (idx >= start) & (idx < start + c)
        source = kept_positions.gather(1, torch.where(idx < start, idx, idx - c).clamp(0, n - 1))
        source = torch.where(inside, kept_positions.gather(1, start - 1), source)
        order = torch.where(inside, T + idx - start, source)
        self.visual_pos = torch.cat([self.visual_pos, start + torch.arange(c, device=device)], 1)
        self.kept_orig = torch.cat([self.kept_orig, orig_before.gather(1, centres.to(device))], 1)
        self.recycled = torch.cat([self.recycled, torch.ones(B, c, dtype=torch.bool, device=device)], 1)
        self.appended = recycled
        return order, source

    def _record_count(self, cut_index: int, kept: int, dropped: int) -> None:
        """The schedule's count of cut `cut_index` set to what it really kept, `kept` visual tokens less the `dropped`
        tokens of the image beyond them (`whole_pos`), where that differs from its plan (the plan's count moves to
        `planned`; `Pruner.realised` gives the counts known before the data)."""
        s = self.schedule
        if kept - dropped != s.kept[cut_index]:
            s.planned = s.planned or list(s.kept)
            s.kept[cut_index] = kept - dropped
            newlines = f" and dropped {dropped} of the image's newline tokens" if dropped else ""
            s.notes.append(f"method={self.config.method!r} kept {kept} visual tokens{newlines} at cut {cut_index} "
                           f"where the budget plans {s.planned[cut_index]} (its rule's count on this image): the "
                           f"accounting counts {kept - dropped}")

    def kept_count(self, cut_index: int) -> int:
        """Visual tokens cut `cut_index` keeps: the schedule's count, at most those present."""
        return min(self.schedule.kept[cut_index], self.visual_pos.shape[1])

    def current_priority(self) -> torch.Tensor | None:
        """[batch, N_cur] the priority (`start`) of the visual tokens present, or None."""
        return None if self.priority is None else self.priority.gather(1, self.kept_orig)

    def cues(self) -> VisionCues:
        """This prefill's vision cues, their tensors on the pruner's device."""
        cues = self.vision
        if cues is None or (cues.places is None and cues.cls_attention.shape != self.visual_pos.shape):
            raise ValueError("the vision tower's [CLS] attention of this prefill is missing: pass pixel_values")
        return cues.to(self.visual_pos.device)

    def decode_attention_mask(self, layer: int, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """2-D mask for a decode step in the group starting at cut `layer`.

        attention_mask [batch, T0 + t] as generate passes it (None without padding) ->
        [batch, T_group + t]: the columns of the kept prompt tokens, then the generated ones.
        """
        if attention_mask is None:
            return None
        index = self.segment_index[layer]
        return torch.cat([attention_mask.gather(1, index), attention_mask[:, self.prompt_len :]], 1)


def _last_image_token(image_mask: torch.Tensor, last_visual: torch.Tensor) -> torch.Tensor:
    """long [batch] position of each sample's last image token (`image_mask` bool [batch, T]), at least its last
    visual token `last_visual` [batch]."""
    if image_mask.shape[0] < last_visual.shape[0]:  # variants of one input
        image_mask = image_mask.expand(last_visual.shape[0], -1)
    T = image_mask.shape[1]
    last = T - 1 - image_mask.flip(1).long().argmax(1)
    return torch.maximum(last.to(last_visual.device), last_visual)


def _whole_positions(image_mask: torch.Tensor | None, visual_mask: torch.Tensor) -> torch.Tensor | None:
    """long [batch, R] positions of the image tokens `image_mask` holds beyond `visual_mask` (bool [batch, T] both;
    LLaVA-NeXT's newlines), None where there are none; ValueError where the samples hold unequal counts."""
    if image_mask is None:
        return None
    whole = image_mask.expand_as(visual_mask) & ~visual_mask
    counts = whole.sum(-1)
    if int(counts.max()) == 0:
        return None
    if not bool((counts == counts[0]).all()):
        raise ValueError(f"the samples hold {counts.tolist()} newline tokens: a pruner that selects over them needs "
                         "equal counts (images of one tiling); run them one at a time")
    return whole.nonzero()[:, 1].view(visual_mask.shape[0], -1)


def _last_tokens(attention_mask: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """long [batch] position of each sample's last real token from the 2-D mask [batch, T], or None
    without a mask (the last position)."""
    if attention_mask is None:
        return None
    return T - 1 - attention_mask.bool().flip(1).long().argmax(1)


def _prompt_rows(rows: str, last_visual: torch.Tensor, last_token: torch.Tensor | None, T: int,
                 tail: int = 0, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [batch, P] valid rows, long [batch] gap) of each sample: the P positions ending at its last real token
    (`last_token` long [batch]; None: T - 1), valid after its last visual token (`last_visual` long [batch])
    and its `lead` tokens (a follow-up's earlier turns: only the last question's rows score) for rows "prompt",
    the last token alone for "last", and for "question" the prompt rows without the chat template's `tail`
    tokens (docs/method.md §10); the gap is the count of tokens after the last row."""
    B, device = last_visual.shape[0], last_visual.device
    last_token = torch.full_like(last_visual, T - 1) if last_token is None else last_token.to(device)
    if rows == "question":
        last_token = last_token - tail
    gap = T - 1 - last_token
    counts = last_token - last_visual - lead  # [B] prompt rows of each sample
    if int(counts.min()) < 1:
        raise ValueError("no prompt token follows the image: put the image before the question")
    if rows == "last":
        return torch.ones(B, 1, dtype=torch.bool, device=device), gap
    P = int(counts.max())
    return torch.arange(P - 1, -1, -1, device=device)[None, :] < counts[:, None], gap


def _scoring_sets(pruner: Pruner, schedule: Schedule | None) -> tuple[set[int], set[int]]:
    """(layers whose maps score a cut after they ran, layers captured before their own cut to score it)."""
    scoring, lookahead = set(), set()
    if schedule is not None:
        starts = [0] + schedule.cuts
        for g, cut in enumerate(schedule.cuts):
            segment = (starts[g], cut)
            (lookahead if pruner.looks_ahead(segment) else scoring).update(pruner.scoring_layers(segment))
    return scoring, lookahead
