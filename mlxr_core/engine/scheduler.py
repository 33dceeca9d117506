"""The engine thread's loop: admit queued requests, step every model's batch, repeat.

Requests whose decoder runs inside continuous batching (``decoder.batched``) join their model's
:class:`BatchRunner`; any other decoder runs its request alone, pausing the batches while it does
(logged once per decoder). The KV budget (``engine.max_kv_bytes``) is enforced here: a request whose
prompt plus ``max_tokens`` cannot fit waits until running requests free enough.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mlxr_core.config.schema import SpeculationConfig
from mlxr_core.engine.adapters import make_resident
from mlxr_core.engine.batch import BatchRunner, Sequence
from mlxr_core.engine.jobs import EngineJob, run_jobs
from mlxr_core.engine.prefix_cache import PrefixCache
from mlxr_core.engine.prefix_disk import DiskPrefixStore, model_identity
from mlxr_core.engine.request import (
    Arrivals,
    Failed,
    Finished,
    Outbox,
    RequestHandle,
    Usage,
)
from mlxr_core.engine.speculation import PREDICTION_METHOD, DraftingDecoder
from mlxr_core.errors import EngineStopped, MlxrError

if TYPE_CHECKING:
    from mlxr_core.config.schema import EngineConfig
    from mlxr_core.engine.lifecycle import Loader, ModelLifecycle
    from mlxr_core.engine.lockstep import Lockstep
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.plugins import Registries

log = logging.getLogger(__name__)

#: The most gaps of ``engine.burst_gap_ms`` an idle engine waits for a burst's requests in all.
BURST_LIMIT = 16
#: How often an idle engine waiting for requests the server is still getting through looks again.
ARRIVAL_POLL_S = 0.001


class Scheduler:
    """Runs on the engine thread only."""

    def __init__(
        self,
        config: EngineConfig,
        models: dict[str, LoadedModel],
        registries: Registries,
        requests: queue.Queue[RequestHandle | None],
        stop: threading.Event,
        abort: threading.Event,
        jobs: queue.Queue[EngineJob] | None = None,
        lifecycle: tuple[ModelLifecycle, Loader] | None = None,
        lockstep: Lockstep | None = None,
        arrivals: Arrivals | None = None,
    ):
        self.config = config
        self.models = models
        self.registries = registries
        self.requests = requests
        self.stop = stop
        self.abort = abort
        #: Non-generation work (embeddings) run between steps; see :mod:`mlxr_core.engine.jobs`.
        self.jobs: queue.Queue[EngineJob] = jobs if jobs is not None else queue.Queue()
        #: Under ``distributed:``, the exchange keeping every rank's loop taking the same inputs:
        #: requests, cancellations and shutdown come from it (see :mod:`mlxr_core.engine.lockstep`).
        self.lockstep = lockstep
        #: The engine thread's async consumers' events, a step's handed over together; the batch
        #: runners hand a decode step's tokens over once the next step is queued.
        self.outbox = Outbox()
        if lockstep is not None:
            lockstep.outbox = self.outbox
        #: Requests the server has received and not yet submitted (not under ``distributed:``).
        self.arrivals = arrivals if lockstep is None else None
        if lockstep is not None:
            self.requests, self.stop, self.abort = lockstep.requests, lockstep.stop, lockstep.abort
            self.jobs = lockstep.jobs
        #: Jobs started and not yet ended, a part of each run per loop.
        self.running_jobs: list[EngineJob] = []
        #: Batch steps run and the seconds they took, events handed over included (/metrics).
        self.steps = 0
        self.step_seconds = 0.0
        #: Seconds the loop spent between a step and the next while a batch kept running (taking
        #: requests in, jobs, and any wait for the GIL there): with step_seconds, a busy engine's
        #: whole time.
        self.between_steps_seconds = 0.0
        self._last_step_end: float | None = None  # None: the last step left no batch running
        #: Requests prefilled together with others by the runners of unloaded models (/metrics).
        self._retired_together = 0
        self.waiting: deque[RequestHandle] = deque()
        #: Jobs whose model is not loaded yet (see :mod:`mlxr_core.engine.lifecycle`).
        self.held_jobs: list[EngineJob] = []
        #: Which models are loaded, and the engine that loads them; None: all of ``models``, always.
        self.lifecycle = lifecycle
        self.runners: dict[str, BatchRunner] = {}
        for model in models.values():
            self._add_runner(model)
        self._warned: set[tuple[str, str]] = set()
        #: The first in line waits for its adapter's file to be read.
        self._reading = False
        #: (decoder, model) pairs whose ``prepare`` ran; see :meth:`prepare_decoders`.
        self._prepared: dict[tuple[str, str], Any] = {}
        self._plugin_config: Mapping[str, Any] = {}

    def _add_runner(self, model: LoadedModel) -> None:
        budget = self.config.prefix_cache.max_bytes if self.config.prefix_cache.enabled else 0
        prefix = PrefixCache(budget, open_disk_tier(self.config, model)) if budget > 0 else None
        self.runners[model.name] = BatchRunner(model, self.config, self.registries.samplers, prefix, self.outbox)
        model.prefix_cache = prefix
        if model.adapters is not None:  # adapters are read off this thread, which a read's end wakes
            model.adapters.on_read = lambda: self.requests.put(None)
            model.adapters.background = self.lockstep is None

    # -- models loaded and unloaded while serving (engine thread) ----------------------------

    def add_model(self, model: LoadedModel) -> None:
        """Serve ``model`` (already in :attr:`models`): its batch runner and decoder."""
        self._add_runner(model)
        try:
            self._prepare_model(model)
        except BaseException:
            self.remove_model(model.name)
            raise

    def remove_model(self, name: str) -> None:
        """Stop serving the idle model ``name``: its prefix cache goes to its disk tier, its
        decoders drop their arrays, and nothing here refers to it any more."""
        runner = self.runners.pop(name, None)
        if runner is not None:
            self._retired_together += runner.prompts_together
        if runner is not None and runner.prefix_cache is not None:
            try:
                runner.prefix_cache.close()
            except Exception:
                log.exception("prefix cache of %s: could not be written to disk", name)
        for key in [key for key in self._prepared if key[1] == name]:
            release = getattr(self._prepared.pop(key), "release", None)
            if callable(release):
                release(name)
        self.models.pop(name, None)

    def model_busy(self, name: str) -> bool:
        """Whether ``name`` has running requests or jobs (it cannot be unloaded now)."""
        runner = self.runners.get(name)
        return (runner is not None and runner.busy) or any(job.model == name for job in self.running_jobs)

    def model_wanted(self, name: str) -> bool:
        """Whether requests or jobs for ``name`` wait in line (queued included)."""
        queued = [item for item in list(self.requests.queue) if item is not None]
        return (
            any(handle.request.model == name for handle in [*self.waiting, *queued])
            or any(job.model == name for job in [*self.held_jobs, *list(self.jobs.queue)])
        )

    def fail_waiting(self, name: str, error: MlxrError) -> None:
        """End the waiting requests and held jobs for ``name`` (its load failed)."""
        kept: deque[RequestHandle] = deque()
        for handle in self.waiting:
            if handle.request.model == name:
                handle._emit(Failed(error))
            else:
                kept.append(handle)
        self.waiting = kept
        for job in [job for job in self.held_jobs if job.model == name]:
            job.refuse(error)
            self.held_jobs.remove(job)

    # -- figures other threads read (plain ints; approximate while the loop runs) ---------------

    @property
    def running(self) -> int:
        return sum(runner.size for runner in list(self.runners.values()))

    @property
    def kv_bytes(self) -> int:
        return sum(runner.kv_bytes for runner in list(self.runners.values()))

    @property
    def prompts_prefilled_together(self) -> int:
        """Requests whose prompts were prefilled in one forward pass with others'."""
        return self._retired_together + sum(runner.prompts_together for runner in list(self.runners.values()))

    @property
    def reserved_kv_bytes(self) -> int:
        return sum(runner.reserved_bytes for runner in list(self.runners.values()))

    def decoder_stats(self) -> dict[str, dict[str, Any]]:
        """``{model: {decoder: {drafted, accepted, steps, acceptance_rate}}}`` of drafting decoders."""
        stats: dict[str, dict[str, Any]] = {}
        for (name, model), decoder in list(self._prepared.items()):
            figures = getattr(decoder, "draft_stats", {}).get(model)
            if figures is not None:
                stats.setdefault(model, {})[name] = figures.as_dict()
        for model, runner in list(self.runners.items()):  # drafting inside the batch, per method
            for method, figures in list(runner.draft_stats.items()):
                stats.setdefault(model, {})[method] = figures.as_dict()
        return stats

    def prefix_stats(self) -> dict[str, Any]:
        return {
            name: runner.prefix_cache.stats
            for name, runner in list(self.runners.items())
            if runner.prefix_cache is not None
        }

    # -- decoders that need a setup step -----------------------------------------------------

    def prepare_decoders(self, plugin_config: Mapping[str, Any]) -> None:
        """Run ``prepare`` of every served model's configured decoder (see
        :class:`~mlxr_core.engine.decoding.Decoder`); its error propagates, so the engine does not
        start. ``plugin_config`` is the raw ``plugins.config`` mapping."""
        self._plugin_config = plugin_config
        for model in self.models.values():
            self._prepare_model(model)

    def _prepare_model(self, model: LoadedModel) -> None:
        """Prepare ``model``'s decoder and its drafter (``models[].speculative.method``), so a
        drafter that cannot serve it (an MTP head the checkpoint lacks) stops it from serving."""
        self._prepare(model.decoder, self.registries.decoders.get(model.decoder), model)
        method = model.speculative.method if model.speculative is not None else "none"
        if method != "none" and method != model.decoder and method in self.registries.decoders:
            self._prepare(method, self.registries.decoders.get(method), model)

    def _prepare(self, name: str, decoder: Any, model: LoadedModel) -> None:
        key = (name, model.name)
        if key in self._prepared:
            return
        prepare = getattr(decoder, "prepare", None)
        if callable(prepare):
            from mlxr_core.config.loader import structure_strict

            plugin = self.registries.decoders.entry(name).plugin
            schema = self.registries.config_sections.get(plugin)
            where = ("plugins", "config", plugin)
            section = (
                structure_strict(self._plugin_config.get(plugin, {}), schema, where=where)
                if schema is not None
                else None
            )
            prepare(model, self.registries, section)
        self._prepared[key] = decoder

    def release_decoders(self) -> None:
        """At shutdown, on the engine thread: let prepared decoders drop their MLX arrays."""
        for (_, model), decoder in self._prepared.items():
            release = getattr(decoder, "release", None)
            if callable(release):
                release(model)
        self._prepared.clear()

    # -- the loop ---------------------------------------------------------------------------

    def close_prefix_caches(self) -> None:
        """At shutdown, on the engine thread: the disk tiers take what the memory tiers hold."""
        for runner in self.runners.values():
            if runner.prefix_cache is not None:
                try:
                    runner.prefix_cache.close()
                except Exception:  # the entries are lost, the shutdown goes on
                    log.exception("prefix cache of %s: could not be written to disk", runner.model.name)

    def run(self) -> None:
        with self.outbox.installed():
            self._run()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.outbox.release()
            self.close_prefix_caches()
            if self.lockstep is not None:
                self.lockstep.close()

    def _loop(self) -> None:
        while True:
            busy = any(runner.busy for runner in self.runners.values())
            idle = not busy and self.jobs.empty() and all(job.waiting for job in self.running_jobs)
            if self.lockstep is not None or not (busy and self._straight_to_step()):
                # Held only from one decode step to the next; not across the ranks' exchange, which
                # a watchdog may end on its own thread, and which NCCL queues behind the step.
                self.outbox.release()
            if self.lockstep is not None:
                self.lockstep.exchange(block=idle and not self.waiting)
            if self.abort.is_set():
                for runner in self.runners.values():
                    runner.fail_all(EngineStopped("the server shut down before this request finished"))
                self._end_jobs()
                return
            if self.stop.is_set() and not busy:
                self._end_jobs()
                return
            if not self.stop.is_set():
                self._admit(block=idle and self.lockstep is None)
            if self.lifecycle is not None:
                lifecycle, loader = self.lifecycle
                lifecycle.tick(loader)
                self._hold_jobs()  # after the tick: a job let through finds its model loaded
            run_jobs(self.jobs, self.models, self.running_jobs)
            self._step_all()

    def _straight_to_step(self) -> bool:
        """Nothing but the next step to do (no job to run, no model to load): the events the
        last step held can wait for it."""
        if self.running_jobs or not self.jobs.empty():
            return False
        return self.lifecycle is None or not self.lifecycle[0].has_work()

    def _step_all(self) -> None:
        # A method of its own: a runner left in the loop's locals would keep an unloaded model alive.
        for name, runner in list(self.runners.items()):
            if runner.busy:
                self._step(name, runner)

    def _end_jobs(self) -> None:
        for job in [*self.running_jobs, *self.held_jobs]:
            job.refuse(EngineStopped("the server is shutting down"))
        self.running_jobs.clear()
        self.held_jobs.clear()

    def _hold_jobs(self) -> None:
        """Hold back queued jobs whose model is not loaded (asking for it); release those whose is."""
        assert self.lifecycle is not None
        while True:
            try:
                self.held_jobs.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for job in list(self.held_jobs):
            if job.model is None or job.model in self.models:
                self.held_jobs.remove(job)
                self.jobs.put(job)
            elif job.cancelled:
                self.held_jobs.remove(job)
                job.refuse(MlxrError(f"{job.what} was cancelled"))
            else:
                self.lifecycle[0].want(job.model)

    def _gather_burst(self) -> None:
        """An idle engine's first request may be the first of a burst (clients started together,
        a batch job): take the requests the server has received and is still getting through
        (:class:`Arrivals`, for at most ``engine.arrivals_wait_ms``), and those that follow within
        ``engine.burst_gap_ms`` of each other (for at most :data:`BURST_LIMIT` gaps), so that they
        start in one step."""
        gap = self.config.burst_gap_ms / 1000
        wait = self.config.arrivals_wait_ms / 1000 if self.arrivals is not None else 0.0
        if gap <= 0 and wait <= 0:
            return
        start = last = time.perf_counter()
        while True:
            now = time.perf_counter()
            coming = wait > 0 and self.arrivals is not None and self.arrivals.pending > 0 and now - start < wait
            in_gap = gap > 0 and now - last < gap and now - start < BURST_LIMIT * gap
            if not (coming or in_gap):
                break
            try:
                handle = self.requests.get(timeout=ARRIVAL_POLL_S if coming else gap - (now - last))
            except queue.Empty:
                continue
            if handle is None:  # a wake-up (the engine stopping): the loop sees to it
                return
            self.waiting.append(handle)
            last = time.perf_counter()
        while True:  # a request queued as the count fell to zero
            try:
                handle = self.requests.get_nowait()
            except queue.Empty:
                return
            if handle is None:
                return
            self.waiting.append(handle)

    def _admit(self, *, block: bool) -> None:
        """Move queued requests into the waiting line, then as many as fit into their runners."""
        idle = block and not self.waiting
        try:
            while True:
                # The first in line waiting for its adapter's read leaves nothing to do until the
                # read's end wakes the loop (or a request comes).
                handle = self.requests.get(block=block and (not self.waiting or self._reading), timeout=0.05)
                block = False
                if handle is not None:
                    self.waiting.append(handle)
        except queue.Empty:
            pass
        if idle and self.waiting:
            self._gather_burst()
        self._reading = False
        while self.waiting:
            handle = self.waiting[0]
            if handle.cancelled:
                self.waiting.popleft()
                usage = Usage(prompt_tokens=len(handle.request.prompt_ids), completion_tokens=0)
                handle._emit(Finished(reason="cancelled", usage=usage))
                continue
            runner = self.runners.get(handle.request.model)
            if runner is None:  # an unloaded model: loaded when it can be, meanwhile the line waits
                if self.lifecycle is not None:
                    self.lifecycle[0].want(handle.request.model)
                return
            name = handle.request.decoder or runner.model.decoder
            decoder = self.registries.decoders.get(name)
            seq: Sequence | None = None
            if not getattr(decoder, "batched", False):
                seq = Sequence(handle, runner.model, self.registries.samplers, 0)
                fallback = plain_fallback_reason(seq)
                if fallback is None:
                    self.waiting.popleft()
                    try:
                        self._prepare(name, decoder, runner.model)
                    except Exception as exc:  # its preconditions do not hold for this model
                        log.error("decoder %s cannot serve model %s: %s", name, runner.model.name, exc)
                        handle._emit(Failed(exc if isinstance(exc, MlxrError) else MlxrError(str(exc))))
                        continue
                    self._run_alone(seq, name, decoder)
                    continue
                if (name, fallback) not in self._warned:
                    self._warned.add((name, fallback))
                    log.info("decoder %s: a request %s, so it runs with plain decoding", name, fallback)
                seq.kv_bytes = runner.reserve_bytes(handle)
            if runner.size >= self.config.max_batch_size or not self._fits(runner, handle):
                return  # first come, first served: later requests wait behind this one
            if handle.request.adapter is not None:
                ready = self._adapter_resident(runner, handle)
                if ready is None:
                    continue  # it could not be loaded: the request has its error
                if not ready:
                    return  # every adapter slot is in use by running requests: it waits
            self.waiting.popleft()
            if seq is None:
                seq = Sequence(handle, runner.model, self.registries.samplers, runner.reserve_bytes(handle))
            self._attach_drafter(seq, runner.model, name, decoder)
            runner.add(handle, seq)

    def _attach_drafter(self, seq: Sequence, model: LoadedModel, name: str, decoder: Any) -> None:
        """Give ``seq`` the drafter it drafts with inside the batch, if any: its ``prediction``'s,
        else its decoder's (a drafting decoder named by the request or ``models[].decoder``), else
        ``models[].speculative.method``'s; none when the request opted out. A drafter that
        cannot serve the model is logged once and left out: the request decodes plainly."""
        request = seq.handle.request
        if not request.speculative:
            return
        methods = [PREDICTION_METHOD] if request.prediction else []
        if isinstance(decoder, DraftingDecoder):
            methods.append(name)
        elif model.speculative is not None and model.speculative.method != "none" and request.decoder is None:
            methods.append(model.speculative.method)
        for method in methods:
            if method not in self.registries.decoders:
                continue
            drafting = self.registries.decoders.get(method)
            try:
                self._prepare(method, drafting, model)
                drafter = drafting.row_drafter(model, request)
            except Exception as exc:
                if (method, model.name) not in self._warned:
                    self._warned.add((method, model.name))
                    log.error("drafter %s cannot serve model %s: its requests draft nothing (%s)", method, model.name, exc)
                continue
            if drafter is not None:
                seq.drafter, seq.method = drafter, method
                seq.draft_k = (model.speculative or SpeculationConfig()).k
                return

    def _adapter_resident(self, runner: BatchRunner, handle: RequestHandle) -> bool | None:
        """Whether the LoRA adapter of ``handle`` (first in line) is resident: False while its
        file is read off this thread or every slot is in use (the running streams step on
        meanwhile; :func:`~mlxr_core.engine.adapters.make_resident`); None when it cannot be
        loaded: the request leaves the line with the error."""
        model = runner.model
        try:
            if model.adapters is None:
                raise MlxrError(f"model {model.name} serves no adapters")
            slot = make_resident(model, str(handle.request.adapter))
            self._reading = slot is None and str(handle.request.adapter) in model.adapters.reading
        except MlxrError as exc:
            log.error("model %s: adapter %s could not be loaded: %s", model.name, handle.request.adapter, exc)
            self.waiting.popleft()
            handle._emit(Failed(exc))
            return None
        return slot is not None

    def _fits(self, runner: BatchRunner, handle: RequestHandle) -> bool:
        budget = self.config.max_kv_bytes
        if budget <= 0:
            return True
        return self.reserved_kv_bytes + runner.reserve_bytes(handle) <= budget

    def _step(self, name: str, runner: BatchRunner) -> None:
        started = time.perf_counter()
        if self._last_step_end is not None:
            self.between_steps_seconds += started - self._last_step_end
        # The step's events reach each consumer loop in one hand-over; a decode step's tokens are
        # held until the next step's graph is queued (the runner hands them over there), so that
        # the consumers take them while this thread waits for the device.
        self.outbox.hold()
        try:
            self._step_once(name, runner)
        finally:
            if runner.tokens is None:  # no decode step follows to hand them over at
                self.outbox.release()
        ended = time.perf_counter()
        self.step_seconds += ended - started
        self.steps += 1
        self._last_step_end = ended if any(r.busy for r in self.runners.values()) else None

    def _step_once(self, name: str, runner: BatchRunner) -> None:
        try:
            runner.step()
        except Exception as exc:  # a bug or an MLX error: fail this batch, keep serving
            if self.lockstep is not None:
                self.lockstep.probe(exc)  # a lost rank ends the process here, its requests told why
            log.exception("model %s: a batch step failed; failing its %d request(s)", name, runner.size)
            error = exc if isinstance(exc, MlxrError) else MlxrError(
                f"generation failed: {type(exc).__name__}: {exc}"
            )
            runner.fail_all(error)

    def _run_alone(self, seq: Sequence, name: str, decoder: Any) -> None:
        """A decoder that cannot batch gets the engine to itself for this request."""
        self.outbox.release()  # the batch's held tokens do not wait for this whole request
        if (name, "") not in self._warned:
            self._warned.add((name, ""))
            log.info("decoder %s does not run in continuous batching: its requests run alone", name)
        handle, model = seq.handle, seq.model
        cache = model.make_cache()
        tokens = decoder.generate(
            model, cache, seq.prompt, seq.sampler, prefill_chunk=self.config.prefill_chunk
        )
        try:
            reason = "length" if seq.max_tokens == 0 else None
            while reason is None:
                if handle.cancelled or self.abort.is_set():
                    reason = "cancelled"
                    break
                reason = seq.accept(next(tokens))
            seq.finish(reason)
        except MlxrError as exc:
            handle._emit(Failed(exc))
        except Exception as exc:
            log.exception("request %s failed", handle.id)
            handle._emit(Failed(MlxrError(f"generation failed: {type(exc).__name__}: {exc}")))
        finally:
            tokens.close()

    def refuse_waiting(self) -> None:
        """At shutdown: end every request that never started."""
        error = EngineStopped("the server is shutting down")
        while self.waiting:
            self.waiting.popleft()._emit(Failed(error))
        while True:
            try:
                handle = self.requests.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                handle._emit(Failed(error))



def plain_fallback_reason(seq: Sequence) -> str | None:
    """Why a request cannot use a non-batched decoder (which draws tokens several at a time from
    stateless samplers), or None when it can."""
    if seq.handle.request.images:
        return "has images (merged in by the batch's prefill)"
    if seq.handle.request.adapter is not None:
        return "runs with a LoRA adapter (gathered per row of the batch)"
    if seq.handle.request.params.logprobs is not None:
        return "asks for logprobs"
    if seq.sampler.stateful:
        return "uses stateful logits processors (penalties or structured output)"
    return None


def open_disk_tier(config: EngineConfig, model: LoadedModel) -> DiskPrefixStore | None:
    """The prefix cache's disk tier for ``model`` (``engine.prefix_cache.disk``), or None where it
    is unset or cannot be opened (logged: the memory tier serves alone)."""
    disk = config.prefix_cache.disk
    if disk is None:
        return None
    try:
        return DiskPrefixStore(disk.path, disk.max_bytes, model_identity(model))
    except Exception as exc:
        log.error("engine.prefix_cache.disk.path %s cannot hold the prefix cache of %s (%s); "
                  "keeping it in memory only", disk.path, model.name, exc)
        return None
