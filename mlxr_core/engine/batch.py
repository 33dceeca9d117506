"""Continuous batching for one model: requests join at token boundaries, leave when done.

A request is first prefilled on its own, one chunk per engine step so a long prompt never stalls
the running streams; then its caches join the batch (each layer's
:meth:`~mlxr_core.model.cache.LayerCache.to_batch`: attention rows right-aligned, recurrent states
stacked), and every step decodes one token for all rows in one forward pass. Requests that arrive
together, with whole prompts within a step's budget, are prefilled together: one forward pass over
their prompts right-aligned in a batch cache (where the model's caches are plain attention caches:
a recurrent state or a packed cache would take in the padding), which then joins the batch as it
is; 32 short prompts take one pass instead of 32. The step is double-buffered:
the graph of step n+1 is queued (``mx.async_eval``) before the tokens of step n are read back.
A failure that belongs to one request (its prefill, its sampler, its detokenizing) ends that request
alone; the scheduler fails the whole batch only for a failure of the batch's own forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxr_core.config.schema import SpeculationConfig
from mlxr_core.engine.decoding import (
    DraftStats,
    SamplerContext,
    make_sampler,
    to_token_logprob,
    top_logprobs,
)
from mlxr_core.engine.detokenizer import StreamingDetokenizer
from mlxr_core.engine.images import PromptImages
from mlxr_core.engine.prefix_cache import MIN_REUSE, adapter_key
from mlxr_core.engine.request import (
    Delta,
    Failed,
    Finished,
    Outbox,
    RequestHandle,
    TokenLogprob,
    Tokens,
    Usage,
)
from mlxr_core.engine.speculation import (
    PREDICTION_METHOD,
    Drafter,
    DraftsTogether,
    ReadsHidden,
    draft_inputs,
    drafter_hidden,
    next_k,
    verify_rows,
)
from mlxr_core.engine.stops import StopMatcher
from mlxr_core.errors import MlxrError
from mlxr_core.model.cache import (
    BatchLayerCache,
    attending_layer,
    batch_mask,
    plain_attention,
    position_bytes,
    prefill_together,
    reserve_bytes,
    rolls_back,
)
from mlxr_core.model.layers import CausalLM
from mlxr_core.model.vision import logits_with_images

if TYPE_CHECKING:
    from mlxr_core.config.schema import EngineConfig
    from mlxr_core.engine.prefix_cache import PrefixCache
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.registry import Registry

log = logging.getLogger(__name__)


class Sequence:
    """One request's decoding state inside a :class:`BatchRunner`."""

    def __init__(self, handle: RequestHandle, model: LoadedModel, samplers: Registry, kv_bytes: int):
        self.handle = handle
        self.model = model
        params = handle.request.params
        self.prompt = handle.request.prompt_ids
        self.max_tokens = params.max_tokens or 0
        context = SamplerContext(self.prompt, model.tokenizer, model.tokenizer.vocab_size)
        self.sampler = make_sampler(params, samplers, context)
        self.detokenizer = StreamingDetokenizer(model.tokenizer, handle.request.keep_special)
        self.stops = StopMatcher(params.stop)
        #: Without stop strings the engine needs no text: the consumer detokenizes (:class:`Tokens`).
        self.text_on_consumer = not params.stop
        images, vision = handle.request.images, model.vision
        self.images = PromptImages(self.prompt, images, vision.tokens) if images and vision else None
        # Benchmarks generate a fixed number of tokens whatever the model says.
        self.eos = frozenset() if params.extra.get("ignore_eos") else model.tokenizer.eos_token_ids
        self.kv_bytes = kv_bytes  # reserved for prompt + max_tokens
        self.cache: list[Any] | None = None  # own cache while prefilling
        #: The slot of its LoRA adapter in the model's AdapterSet (0: none), set when it joins.
        self.adapter_slot = 0
        #: Its adapter's scale (``GenerationRequest.adapter_scale``).
        self.adapter_scale = handle.request.adapter_scale
        self.prefilled = 0
        #: Prompt tokens the prefix cache gave, and that this request stored in it (the usage).
        self.cached = self.written = 0
        self.generated = 0
        #: Prefilled on its own, not with others (:meth:`BatchRunner._prefill_together` failed).
        self.alone = False
        self.started = time.perf_counter()
        self.first_token_at = 0.0
        #: Tokens emitted so far (what a drafter continues, after the prompt).
        self.output: list[int] = []
        #: This request's drafter inside the batch (:mod:`mlxr_core.engine.speculation`), the
        #: method it counts under, and the draft length it proposes next.
        self.drafter: Drafter | None = None
        self.method = ""
        self.draft_k = 0
        #: Draft tokens verified for this request, and of those the ones accepted.
        self.drafted = self.accepted_drafts = 0

    @property
    def pending_prompt(self) -> int:
        """Prompt tokens still to prefill (the last one is fed by the first decode step)."""
        return len(self.prompt) - 1 - self.prefilled

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> str | None:
        """Emit ``token``; return the finish reason when the request is done."""
        self.generated += 1
        self.output.append(token)
        if not self.first_token_at:
            self.first_token_at = time.perf_counter()
        if token in self.eos:
            return "stop"
        logprobs = (logprob,) if logprob is not None else ()
        if self.text_on_consumer:
            self.handle._emit(Tokens((token,), logprobs, self.detokenizer))
        else:
            text, hit = self.stops.feed(self.detokenizer.add(token))
            self.handle._emit(Delta(text, (token,), logprobs))
            if hit:
                return "stop"
        if self.generated >= self.max_tokens:
            return "length"
        return None

    def emit(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """:meth:`accept` ``token``, ending the request where that ends it (finished, or failed
        with its own error); False when it ended."""
        try:
            reason = self.accept(token, logprob)
        except Exception as exc:
            fail_sequence(self, exc)
            return False
        if reason is not None:
            self.finish(reason)
            return False
        return True

    def finish(self, reason: str) -> None:
        if reason != "cancelled" and self.text_on_consumer:
            self.handle._emit(Tokens((), (), self.detokenizer, flush=True))
        elif reason != "cancelled" and not self.stops.hit:
            tail, hit = self.stops.feed(self.detokenizer.flush())
            if not hit:
                tail += self.stops.flush()
            if tail:
                self.handle._emit(Delta(tail))
        now = time.perf_counter()
        predicted = (self.accepted_drafts, self.drafted - self.accepted_drafts) if self.method == PREDICTION_METHOD else (0, 0)
        self.handle._emit(
            Finished(
                reason=reason,
                usage=Usage(len(self.prompt), self.generated, self.cached, self.written, *predicted),
                ttft_s=(self.first_token_at or now) - self.started,
                total_s=now - self.started,
                stop_sequence=self.stops.matched,
                first_token_at=self.first_token_at or now,
                finished_at=now,
            )
        )


class BatchRunner:
    """Schedules one model's requests: chunked prefill, then batched decode."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        samplers: Registry,
        prefix_cache: PrefixCache | None,
        outbox: Outbox | None = None,
    ):
        self.model = model
        #: The scheduler's: a decode step's tokens are handed over once the next step is queued.
        self.outbox = outbox if outbox is not None else Outbox()
        self.config = config
        self.samplers = samplers
        self.prefix_cache = prefix_cache
        self.kv_bytes_per_token = kv_bytes_per_token(model)
        self.prefilling: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        if model.adapters is not None:  # a decode step's rows are the running ones, in order
            model.adapters.batch_slots = lambda: [seq.adapter_slot for seq in self.running]
            model.adapters.batch_scales = lambda: [seq.adapter_scale for seq in self.running]
            model.adapters.busy_slots = lambda: {seq.adapter_slot for seq in (*self.prefilling, *self.running)}
        self.caches: list[BatchLayerCache] | None = None
        self.tokens: mx.array | None = None  # [B]: each row's next input (and, unless fresh, output)
        self.fresh: list[bool] = []  # row's token is its last prompt token, not a generated one
        #: Per row, what its rotary position adds to its cache position (M-RoPE after images).
        self.shifts: list[int] = []
        #: Requests whose prompts were prefilled together with others' (:meth:`_prefill_together`).
        self.prompts_together = 0
        self._plain: bool | None = None
        #: Per row that asked, its token in ``tokens``'s logprobs: the step's arrays and its row in them.
        self.logprobs: list[tuple[StepLogprobs, int] | None] = []
        #: Drafting inside the batch: the model's settings, and per method the draft tokens verified.
        self.speculation = model.speculative or SpeculationConfig()
        self.draft_stats: dict[str, DraftStats] = {}

    # -- accounting -------------------------------------------------------------------------

    def reserve_bytes(self, handle: RequestHandle) -> int:
        params = handle.request.params
        tokens = len(handle.request.prompt_ids) + (params.max_tokens or 0)
        if self.model.speculative is not None or handle.request.prediction:
            # A verification writes every row's longest draft and its input before the rejected
            # part is forgotten.
            tokens += self.speculation.max_k + 1
        drafter = tokens * self.model.drafter_bytes_per_token if self.model.speculative is not None else 0
        return sequence_bytes(self.model, tokens, self.kv_bytes_per_token) + drafter

    @property
    def reserved_bytes(self) -> int:
        return sum(seq.kv_bytes for seq in (*self.prefilling, *self.running))

    @property
    def kv_bytes(self) -> int:
        """Bytes the running batch's caches hold now."""
        held = sum(cache.nbytes for cache in self.caches) if self.caches else 0
        for seq in self.prefilling:
            held += sum(cache.nbytes for cache in seq.cache or [])
        return held

    @property
    def busy(self) -> bool:
        return bool(self.prefilling or self.running)

    @property
    def size(self) -> int:
        return len(self.prefilling) + len(self.running)

    def add(self, handle: RequestHandle, seq: Sequence | None = None) -> None:
        if seq is None:
            seq = Sequence(handle, self.model, self.samplers, self.reserve_bytes(handle))
        adapter, adapters = handle.request.adapter, self.model.adapters
        if adapter is not None:
            slot = adapters.slot(adapter) if adapters is not None else None
            if slot is None:
                raise MlxrError(f"adapter {adapter!r} of model {self.model.name} is not resident")
            seq.adapter_slot = slot
        self.prefilling.append(seq)

    # -- one engine step --------------------------------------------------------------------

    def step(self) -> None:
        """Advance every request by one unit of work: one prefill chunk and/or one decode token."""
        self._drop_cancelled_prefills()
        if self.prefilling:
            self.outbox.deliver()  # the last step's tokens do not wait for this step's prefill
        # Several short prompts may share one step's prefill budget; a long one takes it all.
        budget = self.config.prefill_chunk
        while self.prefilling and budget > 0:
            used = self._prefill_together(budget)
            if used:
                budget -= used
                continue
            seq = self.prefilling[0]
            try:
                with self._adapter_rows([seq]):
                    budget -= self._prefill_chunk(seq, budget)
            except Exception as exc:
                if seq not in self.prefilling:
                    raise  # it failed joining the batch: the batch's state is in doubt
                # Only this request's own prefill failed: the batch is untouched.
                self.prefilling.remove(seq)
                fail_sequence(seq, exc)
                continue
            if self.prefilling and self.prefilling[0] is seq:
                break  # still prefilling, or waiting for a free row
        if self.running or self.tokens is not None:
            self._decode()

    def fail_all(self, error: MlxrError) -> None:
        """End every request of this runner with ``error`` and forget the batch."""
        for seq in (*self.prefilling, *self.running):
            seq.handle._emit(Failed(error))
        self.prefilling.clear()
        self.running, self.fresh, self.logprobs, self.shifts = [], [], [], []
        self.caches, self.tokens = None, None

    def _drop_cancelled_prefills(self) -> None:
        for seq in [s for s in self.prefilling if s.handle.cancelled]:
            self.prefilling.remove(seq)
            seq.finish("cancelled")

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill up to ``budget`` of ``seq``'s prompt tokens; join the batch when done.
        Returns the tokens used."""
        if seq.cache is None:
            seq.cache = self._start_cache(seq)
        room = max(1, self.config.max_batch_tokens - len(self.running))
        chunk = max(0, min(budget, room, seq.pending_prompt))
        if chunk > 0:
            start, stop = seq.prefilled, seq.prefilled + chunk
            images = seq.images
            if images is not None:  # an image is prefilled whole, in the chunk that reaches it
                stop = images.chunk_end(start, stop)
            ids = mx.array(seq.prompt[start:stop], dtype=mx.int32)[None]
            pixels = images.within(start, stop) if images is not None else []
            rotary = images.positions if images is not None else None
            if (pixels or rotary is not None) and self.model.vision is not None:
                vision = self.model.vision
                encoded = vision.encode(pixels) if pixels else None
                positions = mx.array(rotary[:, None, start:stop]) if rotary is not None else None
                logits_with_images(self.model.model, ids, encoded, vision.tokens, seq.cache, start, positions)
            elif isinstance(seq.drafter, ReadsHidden) and isinstance(self.model.model, CausalLM):
                # The drafter reads the prompt's hidden states (no LM head over the prompt either).
                final, layers = self.model.model.forward_hidden(ids, seq.cache, layers=seq.drafter.hidden_layers)
                hidden = drafter_hidden(seq.drafter, final, layers)
                seq.drafter.observe(start, hidden[0], seq.prompt[start + 1 : stop + 1])
            else:
                self.model.model(ids, cache=seq.cache)
            mx.eval([array for cache in seq.cache for array in cache.state])
            chunk = stop - start
            seq.prefilled += chunk
        if seq.pending_prompt == 0 and len(self.running) < self.config.max_batch_size:
            self.prefilling.popleft()
            prefix = self.prefix_cache
            if prefix is not None and seq.prefilled and prefix.store(self._cache_key(seq)[: seq.prefilled], seq.cache):
                seq.written = seq.prefilled - seq.cached
            self._join(seq)
        return max(chunk, 1)

    def _prefill_together(self, budget: int) -> int:
        """Prefill the whole prompts of the first waiting requests in one forward pass, when two
        or more can (:meth:`_together`), and join them to the batch; the tokens it took of
        ``budget`` (padding included), 0 when it did nothing. Should the pass fail, the requests
        go back to be prefilled one by one (the cause may be the batching: memory for the padded
        pass, a backend refusing its mask), and fail there if they fail alone."""
        group = self._together(budget)
        if len(group) < 2:
            return 0
        lengths = [seq.pending_prompt for seq in group]
        layers = len(group[0].cache or ())
        try:
            with self._adapter_rows(group):
                caches = prefill_together(
                    self.model.model, [seq.prompt[:length] for seq, length in zip(group, lengths, strict=True)], layers
                )
        except Exception:
            log.warning("prefilling %d prompts together failed; prefilling them one by one", len(group), exc_info=True)
            for seq in group:
                seq.alone = True
            return len(group) * max(lengths)
        for seq in group:
            self.prefilling.remove(seq)
        prefix = self.prefix_cache
        for row, (seq, length) in enumerate(zip(group, lengths, strict=True)):
            seq.prefilled = length
            if prefix is not None and length >= MIN_REUSE:
                try:
                    if prefix.store(self._cache_key(seq)[:length], [cache.extract(row) for cache in caches]):
                        seq.written = length
                except Exception:  # the request goes on; only later reuse is lost
                    log.exception("request %s: its prompt could not be stored in the prefix cache", seq.handle.id)
        try:
            self._append_rows(group, caches)
        except BaseException as exc:  # the batch's state is in doubt: the scheduler fails it all
            for seq in group:
                if seq not in self.running:
                    fail_sequence(seq, exc)
            raise
        self.prompts_together += len(group)
        return len(group) * max(lengths)

    def _together(self, budget: int) -> list[Sequence]:
        """The waiting requests, from the first on, whose whole prompts one forward pass can
        prefill: text only, nothing reused from the prefix cache, plain attention caches, within
        ``budget`` and the batch's free rows (padding counted), as many as the largest power of
        two that fits. A prompt that begins as an earlier one of the group does (a shared system
        prompt, long enough to be stored) ends the group: prefilled after the group's prompts are
        in the prefix cache, it reuses what they share."""
        if self.model.vision is not None or not self._plain_caches():
            return []
        room = min(budget, self.config.max_batch_tokens - len(self.running))
        free = self.config.max_batch_size - len(self.running)
        group: list[Sequence] = []
        heads: set[tuple[int, ...]] = set()
        longest = 0
        for seq in self.prefilling:
            if len(group) >= free or seq.images is not None or seq.alone or seq.prefilled:
                break
            pending = seq.pending_prompt  # nothing reused yet
            if pending < 1 or (len(group) + 1) * max(longest, pending) > room:
                break
            head = tuple(seq.prompt[:MIN_REUSE])
            if self.prefix_cache is not None and pending >= MIN_REUSE and head in heads:
                break
            if seq.cache is None:
                try:
                    seq.cache = self._start_cache(seq)
                except Exception:  # looked up again when prefilled alone, where a failure is its own
                    seq.alone = True
                    break
                if seq.prefilled:  # a prefix-cache hit: prefilled alone from it
                    break
            longest = max(longest, pending)
            heads.add(head)
            group.append(seq)
        # A power of two (the rest form the next group): a backend that builds its kernels per
        # input shape (MLX's CUDA attention through cuDNN) then meets few batch sizes.
        return group[: 1 << (len(group).bit_length() - 1)] if group else group

    def _plain_caches(self) -> bool:
        """Whether the model's caches are all plain attention caches (decided once)."""
        if self._plain is None:
            self._plain = plain_attention(self.model.make_cache())
        return self._plain

    def _start_cache(self, seq: Sequence) -> list[Any]:
        if self.prefix_cache is not None:
            reused, caches = self.prefix_cache.lookup(
                self._cache_key(seq), limit=len(seq.prompt) - 1, make_cache=self.model.make_cache
            )
            if caches is not None and not (seq.images is not None and seq.images.inside(reused)):
                seq.prefilled = seq.cached = reused
                return caches
        return self.model.make_cache()

    @staticmethod
    def _cache_key(seq: Sequence) -> Any:
        """The prompt as the prefix cache keys it: images by their content hash, and under its
        LoRA adapter's mark (another adapter's keys and values differ from the first layer on)."""
        key = seq.prompt if seq.images is None else seq.images.cache_key(seq.prompt)
        request = seq.handle.request
        if request.adapter is None:
            return key
        # Another scale of the adapter is another model: its keys and values differ too.
        scale = request.adapter_scale
        return adapter_key(key, request.adapter if scale == 1.0 else f"{request.adapter}*{scale!r}")

    def _adapter_rows(self, seqs: list[Sequence]) -> AbstractContextManager[None]:
        """While a forward pass over ``seqs`` (its rows, in order) is built: their adapters."""
        adapters = self.model.adapters
        if adapters is None:
            return nullcontext()
        return adapters.rows([seq.adapter_slot for seq in seqs], [seq.adapter_scale for seq in seqs])

    def _join(self, seq: Sequence) -> None:
        self._append_rows([seq], [cache.to_batch() for cache in seq.cache or self.model.make_cache()])

    def _append_rows(self, seqs: list[Sequence], rows: list[Any]) -> None:
        """Add ``seqs``, prefilled in the batch caches ``rows`` (one per layer, a row each), to
        the running batch; each decodes its prompt's last token first."""
        last = mx.array([seq.prompt[-1] for seq in seqs], dtype=mx.int32)
        if self.caches is None or self.tokens is None:
            self.caches, self.tokens = rows, last
        else:
            for batch, row in zip(self.caches, rows, strict=True):
                batch.extend(row)
            self.tokens = mx.concatenate([self.tokens, last])
        for seq in seqs:
            seq.cache = None
            self.running.append(seq)
            self.fresh.append(True)
            self.logprobs.append(None)
            self.shifts.append(seq.images.shift if seq.images is not None else 0)

    @contextlib.contextmanager
    def _expert_failures(self, failed: dict[int, BaseException]) -> Iterator[None]:
        """Rows whose streamed experts could not be read in this step join ``failed`` (the
        others go on); see :meth:`mlxr_core.model.experts.store.ExpertStore.row_failures`."""
        experts = self.model.experts
        if experts is None:
            yield
            return
        with experts.row_failures() as lost:
            yield
        for row, error in lost.items():
            failed.setdefault(row, error)

    def _decode(self) -> None:
        assert self.caches is not None and self.tokens is not None
        if self._speculating():
            self._speculate()
            return
        tokens, caches = self.tokens, self.caches
        values: list[int] | None = None
        # Rows whose own sampler or stream failed this step: they leave the batch with their error,
        # the other rows go on (a failure the batch as a whole caused still fails the batch).
        failed: dict[int, BaseException] = {}
        if any(seq.sampler.stateful for seq in self.running):
            # Stateful processors (penalties, grammars) must see token n before processing the
            # logits of token n+1: read the tokens back first, giving up the overlap this step.
            self.outbox.deliver()  # the last step's tokens do not wait for this read
            values = tokens.tolist()  # type: ignore[assignment]
            assert values is not None
            failed.update(self._tell_samplers(values))
        mask = batch_mask(caches)
        shift = mx.array(self.shifts) if any(self.shifts) else None
        with self._expert_failures(failed):
            logits = self.model.decode(tokens, caches, mask, shift)
        following = self._sample(logits, failed)
        following_logprobs, step_logprobs = self._logprobs(logits, following)
        mx.async_eval(following, *(step_logprobs.arrays if step_logprobs is not None else ()))
        self.outbox.deliver()  # the last step's tokens, handed over while the device computes this one

        if values is None:
            values = tokens.tolist()  # type: ignore[assignment]
            assert values is not None
        keep = [
            row
            for row, (seq, token) in enumerate(zip(self.running, values, strict=True))
            if self._emit(row, seq, token, failed)
        ]
        self._keep_rows(keep, following, following_logprobs)

    def _tell_samplers(self, values: list[int]) -> dict[int, BaseException]:
        """Tell each row's stateful processors (penalties, grammars) its pending token, but a
        fresh row's (its prompt's last); the rows whose processors raised, with their errors."""
        failed: dict[int, BaseException] = {}
        for row, (seq, token) in enumerate(zip(self.running, values, strict=True)):
            if not self.fresh[row]:
                try:
                    seq.sampler.accept(token)
                except Exception as exc:
                    failed[row] = exc
        return failed

    def _emit(self, row: int, seq: Sequence, token: int, failed: dict[int, BaseException]) -> bool:
        """Hand row ``row``'s pending ``token`` to its request (unless it is its prompt's last);
        False when the request ended (cancelled, failed or finished)."""
        if seq.handle.cancelled:
            seq.finish("cancelled")
            return False
        if row in failed:
            fail_sequence(seq, failed[row])
            return False
        if self.fresh[row]:
            self.fresh[row] = False
            return True
        asked = self.logprobs[row]
        logprob = None
        if asked is not None:
            step_logprobs, index = asked
            logprob = to_token_logprob(token, step_logprobs.row(index, seq.sampler.logprobs or 0))
        return seq.emit(token, logprob)

    def _keep_rows(
        self, keep: list[int], tokens: mx.array, logprobs: list[tuple[StepLogprobs, int] | None]
    ) -> None:
        """Go on with the rows ``keep`` only, their next inputs ``tokens`` (one per row before
        the cut) and their logprobs."""
        if len(keep) == len(self.running):
            self.tokens, self.logprobs = tokens, logprobs
            return
        if not keep:
            self.running, self.fresh, self.caches, self.tokens = [], [], None, None
            self.logprobs, self.shifts = [], []
            return
        self.running = [self.running[i] for i in keep]
        self.fresh = [self.fresh[i] for i in keep]
        self.shifts = [self.shifts[i] for i in keep]
        self.logprobs = [logprobs[i] for i in keep]
        for cache in self.caches or ():
            cache.filter(keep)
        self.tokens = tokens[mx.array(keep)]

    # -- drafting inside the batch (see mlxr_core.engine.speculation) ---------------------------

    def _speculating(self) -> bool:
        """Whether this step verifies drafts: some row drafts, the batch is small enough for
        verifying to pay (``max_batch``), and every cache can forget a row's rejected tokens
        alone (not a recurrent state, so a hybrid model's rows draft nothing)."""
        if len(self.running) > self.speculation.max_batch or self.model.vision is not None:
            return False
        if not any(seq.drafter is not None and seq.draft_k > 0 for seq in self.running):
            return False
        return self.caches is not None and not any(self.shifts) and rolls_back(self.caches)

    def _drafts(self) -> list[tuple[list[int], mx.array | None]]:
        """Each row's draft for this step: at most its ``draft_k``, the tokens it may still emit
        less one (the target's own token follows), and cut at the first token its grammar does
        not allow; with the logits it was drawn from (None: deterministic). Rows whose drafters
        propose together (:class:`DraftsTogether`) do, one call per kind."""
        rows = [(row, seq, min(seq.draft_k, seq.max_tokens - seq.generated - 1)) for row, seq in enumerate(self.running)]
        rows = [(row, seq, room) for row, seq, room in rows if seq.drafter is not None and room > 0]
        drafted: dict[int, list[int]] = {}
        together: dict[type[DraftsTogether], list[tuple[int, Sequence, int]]] = {}
        for row, seq, room in rows:
            if isinstance(seq.drafter, DraftsTogether):
                together.setdefault(type(seq.drafter), []).append((row, seq, room))
            else:
                drafted[row] = list(seq.drafter.propose([*seq.prompt, *seq.output], room))  # type: ignore[union-attr]
        for kind, group in together.items():
            histories = [[*seq.prompt, *seq.output] for _, seq, _ in group]
            drafters: list[Any] = [seq.drafter for _, seq, _ in group]
            drafts = kind.propose_rows(drafters, histories, [room for *_, room in group])
            drafted.update((row, list(draft)) for (row, _, _), draft in zip(group, drafts, strict=True))
        proposals: list[tuple[list[int], mx.array | None]] = [([], None)] * len(self.running)
        for row, seq, room in rows:
            draft = drafted[row][:room]
            if draft:
                draft = draft[: seq.sampler.valid_prefix(draft)]
            drawn = getattr(seq.drafter, "draft_logits", None)
            proposals[row] = (draft, None if drawn is None or not draft else drawn[: len(draft)])
        return proposals

    def _speculate(self) -> None:
        """One step that verifies every row's draft (rows without one get one token, as a plain
        step gives): the pending tokens are read back and emitted first, so drafts continue them."""
        assert self.caches is not None and self.tokens is not None
        self.outbox.deliver()
        values: list[int] = self.tokens.tolist()  # type: ignore[assignment]
        failed = self._tell_samplers(values)
        keep = [row for row, (seq, token) in enumerate(zip(self.running, values, strict=True)) if self._emit(row, seq, token, failed)]
        self._keep_rows(keep, self.tokens, self.logprobs)
        if not self.running or self.caches is None:
            return
        values = [values[i] for i in keep]
        proposals = self._drafts()
        drafts = [draft for draft, _ in proposals]
        inputs, longest = draft_inputs(values, drafts)
        caches: list[Any] = self.caches
        # Each row's next input's position: where the hidden states a drafter reads begin.
        starts = [len(seq.prompt) + len(seq.output) - 1 for seq in self.running]
        lost: dict[int, BaseException] = {}  # rows whose streamed experts could not be read
        with self._expert_failures(lost):
            logits, hidden = self._verify_pass(inputs, longest, caches)
        samplers = [seq.sampler for seq in self.running]
        emitted, failed = verify_rows(logits, drafts, samplers, [drawn for _, drawn in proposals])
        for row, error in lost.items():
            failed.setdefault(row, error)
        if longest:
            drop = [longest + 1 - len(tokens) for tokens in emitted]
            for cache in caches:
                cache.rollback(drop)
        if hidden is not None:
            final, layers = hidden
            for row, seq in enumerate(self.running):
                if isinstance(seq.drafter, ReadsHidden) and row not in failed:
                    states = drafter_hidden(seq.drafter, final[row], {i: h[row] for i, h in layers.items()})
                    seq.drafter.observe(starts[row], states[: len(emitted[row])], emitted[row])
        self._after_verify(logits, drafts, emitted, failed)

    def _verify_pass(
        self, inputs: mx.array, longest: int, caches: list[Any]
    ) -> tuple[mx.array, tuple[mx.array, dict[int, mx.array]] | None]:
        """The logits ``[B, longest + 1, vocab]`` of every row's pending token and draft, and
        where a row's drafter reads hidden states, the final ones they come from with the
        inputs of the layers the drafters read (:meth:`CausalLM.forward_hidden`; else None)."""
        lm = self.model.model
        wanted: set[int] = set()  # the layers whose inputs the drafters read
        reads = False
        for seq in self.running:
            if isinstance(seq.drafter, ReadsHidden):
                reads, wanted = isinstance(lm, CausalLM), wanted | set(seq.drafter.hidden_layers)
        if longest == 0 and not reads:
            return self.model.decode(inputs[:, 0], caches, batch_mask(caches))[:, None], None
        if longest == 0:
            mask = batch_mask(caches)
        else:
            index = attending_layer(caches)
            mask = caches[index].draft_mask(longest + 1) if index is not None else None
        recurrent = [cache for cache in caches if hasattr(cache, "keep_positions")] if longest else []
        for cache in recurrent:  # their layers keep each position's states (see rollback)
            cache.keeps_positions = True
        try:
            if reads:
                hidden, layers = lm.forward_hidden(inputs, caches, mask, sorted(wanted))
                return lm.lm_logits(hidden), (hidden, layers)
            logits: mx.array = lm(inputs, cache=caches, mask=mask)
        finally:
            for cache in recurrent:
                cache.keeps_positions = False
        return logits, None

    def _after_verify(
        self,
        logits: mx.array,
        drafts: list[list[int]],
        emitted: list[list[int]],
        failed: dict[int, BaseException],
    ) -> None:
        """Each row's accepted draft tokens to its request now, its last token pending (the next
        input, emitted by the next step as a plain step's is); counts and next draft lengths."""
        keep: list[int] = []
        pending: list[int] = []
        logprobs: list[tuple[StepLogprobs, int] | None] = []
        for row, (seq, draft, tokens) in enumerate(zip(self.running, drafts, emitted, strict=True)):
            pending.append(tokens[-1])
            step = None
            if seq.sampler.logprobs is not None and row not in failed:
                top = seq.sampler.logprobs
                step = StepLogprobs(logits[row, : len(tokens)], mx.array(tokens, dtype=mx.int32), [top] * len(tokens))
            logprobs.append(None if step is None else (step, len(tokens) - 1))
            if draft and row not in failed:
                accepted = len(tokens) - 1
                self.draft_stats.setdefault(seq.method, DraftStats()).add(len(draft), accepted)
                seq.drafted += len(draft)
                seq.accepted_drafts += accepted
                seq.draft_k = next_k(seq.draft_k, len(draft), accepted, self.speculation)
            if seq.handle.cancelled:
                seq.finish("cancelled")
                continue
            if row in failed:
                fail_sequence(seq, failed[row])
                continue
            if self._emit_drafted(seq, tokens[:-1], step):
                keep.append(row)
        self._keep_rows(keep, mx.array(pending, dtype=mx.int32), logprobs)

    @staticmethod
    def _emit_drafted(seq: Sequence, tokens: list[int], step: StepLogprobs | None) -> bool:
        """Emit ``seq``'s accepted draft tokens; False when the request ended on one of them."""
        for index, token in enumerate(tokens):
            logprob = None
            if step is not None:
                logprob = to_token_logprob(token, step.row(index, seq.sampler.logprobs or 0))
            if not seq.emit(token, logprob):
                return False
        return True

    def _sample(self, logits: mx.array, failed: dict[int, BaseException]) -> mx.array:
        """One token per row; a row whose sampler raises is recorded in ``failed`` and gets a
        placeholder token (it leaves the batch before the token is used)."""
        samplers = [seq.sampler for seq in self.running]
        if all(getattr(sampler, "plain_greedy", False) for sampler in samplers):
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        rows = []
        for i, sampler in enumerate(samplers):
            row = logits[i : i + 1]
            if i not in failed:
                try:
                    rows.append(sampler(row).astype(mx.int32))
                    continue
                except Exception as exc:
                    failed[i] = exc
            rows.append(mx.argmax(row, axis=-1).astype(mx.int32))
        return mx.concatenate(rows)

    def _logprobs(
        self, logits: mx.array, tokens: mx.array
    ) -> tuple[list[tuple[StepLogprobs, int] | None], StepLogprobs | None]:
        """For the rows that asked for logprobs, those of their sampled token: one set of (lazy)
        arrays for the whole batch (:class:`StepLogprobs`), and each row's index in it."""
        tops = [seq.sampler.logprobs for seq in self.running]
        if all(top is None for top in tops):
            return [None] * len(tops), None
        step = StepLogprobs(logits, tokens, tops)
        return [None if top is None else (step, row) for row, top in enumerate(tops)], step


class StepLogprobs:
    """One decode step's logprobs: every row's sampled token's (a handful of ops for the whole
    batch, not per row), and the best alternatives of the rows that ask for some (only theirs:
    the vocabulary is partitioned for those rows alone), read back from the device once, when the
    first row asks."""

    def __init__(self, logits: mx.array, tokens: mx.array, tops: list[int | None]):
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        wide = [row for row, top in enumerate(tops) if top]
        #: Row of the batch -> its row in the alternatives' arrays.
        self.wide = {row: i for i, row in enumerate(wide)}
        self.arrays: tuple[mx.array, ...] = (chosen,)
        if wide:
            best, values = top_logprobs(logprobs[mx.array(wide)], max(tops[row] or 0 for row in wide))
            self.arrays = (chosen, best, values)
        self._values: list[list[Any]] | None = None

    def row(self, index: int, top: int) -> list[Any]:
        """Row ``index``'s chosen logprob and its ``top`` best alternatives (ids, logprobs), as
        :func:`to_token_logprob` reads them."""
        if self._values is None:
            self._values = [array.tolist() for array in self.arrays]  # type: ignore[misc]
        values = self._values
        if top <= 0 or index not in self.wide:
            return [values[0][index]]
        i = self.wide[index]
        return [values[0][index], values[1][i][:top], values[2][i][:top]]


def fail_sequence(seq: Sequence, exc: BaseException) -> None:
    """End ``seq`` alone with ``exc`` (an :class:`MlxrError` as is, anything else as a generation
    failure naming the exception), logged with its traceback."""
    log.error("request %s failed", seq.handle.id, exc_info=exc)
    error = exc if isinstance(exc, MlxrError) else MlxrError(
        f"generation failed: {type(exc).__name__}: {exc}"
    )
    seq.handle._emit(Failed(error))


def _itemsize(model: LoadedModel) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[model.dtype]


def kv_bytes_per_token(model: LoadedModel, *, full_precision: bool = False) -> int:
    """Bytes of keys and values one position costs across the attention layers: packed under
    ``models[].kv_cache`` (unless ``full_precision``)."""
    shapes = model.arch.kernel_context(model.config)
    caches = model.make_cache()
    layers = sum(1 for cache in caches if cache.attends)
    heads, head_dim, itemsize = int(shapes["n_kv_heads"]), int(shapes["head_dim"]), _itemsize(model)
    if model.kv_cache is not None and not full_precision:
        return layers * model.kv_cache.bytes_per_position(heads, head_dim, itemsize)
    return position_bytes(caches, heads, head_dim, itemsize)


def sequence_bytes(model: LoadedModel, tokens: int, kv_per_token: int) -> int:
    """Bytes a sequence of ``tokens`` positions holds in ``model``'s caches: keys and values per
    position, plus the fixed state of its recurrent layers, plus the full-precision copy a
    quantized cache keeps of some positions (``start_after``'s first, ``window``'s last)."""
    held = reserve_bytes(model.make_cache(), tokens, kv_per_token, _itemsize(model))
    kept = model.kv_cache.full_precision_positions(tokens) if model.kv_cache is not None else 0
    if kept > 0:
        held += kept * kv_bytes_per_token(model, full_precision=True)
    return held
