"""The engine: one owner of all mutable state (pool, cache, queues). Callers add requests and call step()."""
import dataclasses
import logging
import math
import os
import socket
import statistics
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable

import torch

from prefixcache.cache.policy import Breakpoint
from prefixcache.cache.pool import KVPool
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.zmq_events import open_events
from prefixcache.config import Config
from prefixcache.engine.admission import check
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.cache_admin import CacheAdmin
from prefixcache.engine.detokenizer import Detokenizer
from prefixcache.engine.drafter import Drafter
from prefixcache.engine.finish import append
from prefixcache.engine.grammar import Grammars
from prefixcache.engine.heap import give_back_freed_heap
from prefixcache.engine.pace import Pace
from prefixcache.engine.runner import ModelRunner, build_model
from prefixcache.engine.sampler import RowFault, Sampler
from prefixcache.engine.scheduler import Scheduler
from prefixcache.engine.sequence import Fault, Plan, SamplingParams, Sequence, Status, TokenLogprob, request_samples
from prefixcache.engine.speculation import Speculation
from prefixcache.engine.step_cost import StepCost, Work
from prefixcache.engine.tiering import open_tiers
from prefixcache.models import lora
from prefixcache.models.catalog import NAMES, model_path
from prefixcache.models.cpu import check_dtype
from prefixcache.models.loader import load

TTFT_WINDOW = 1024  # recent requests whose time to first token stats() summarizes

log = logging.getLogger("prefixcache.engine")


class StepFailed(Exception):
    """An engine step's forward raised; its sequences, listed here, were aborted. (A fault in one sequence's own
    work fails that sequence alone: Sequence.fault.)"""

    def __init__(self, seqs: list[Sequence]):
        super().__init__(f"engine step failed for {len(seqs)} sequences")
        self.seqs = seqs


class Engine:
    def __init__(self, config: Config):
        check_dtype(config.dtype)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        weights = load(model_path(config.model), getattr(torch, config.dtype), config.quantized_reads)
        self.tokenizer = weights.tokenizer
        self.model_config = weights.config
        self.model_name = config.model if config.model in NAMES else weights.name  # a shipped model by its name
        self.max_model_len = min(config.max_model_len or weights.config.max_position, weights.config.max_position)
        c = weights.config
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, config.block_size, config.kv_cache_bytes,
                           getattr(torch, config.kv_storage_dtype), run=config.attn_tile // config.block_size,
                           local_layers=c.local_layers, window=c.sliding_window)
        self.blocks = BlockManager(self.pool, config.enable_prefix_cache, config.min_cache_tokens,
                                    config.default_ttl, config.shared_prefixes, config.log_cross_scope_misses,
                                    max_chunk=config.max_batch_tokens + config.num_speculative_tokens)
        self.replica_id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"  # its name in KV events
        if config.disk_cache or config.redis_url:
            self.blocks.attach(open_tiers(config, c, self.replica_id))
        if config.kv_events_config and not config.enable_prefix_cache:
            raise ValueError("--kv-events-config: KV events need the prefix cache")
        self.events = None
        if config.kv_events_config:
            self.events = open_events(config.kv_events_config, config.block_size, self.blocks.owner,
                                      lambda node: lora.event_name(self.adapters.values(), self.blocks.adapter(node)))
            self.blocks.listen(self.events)
        self.cost = StepCost()
        pace = Pace(config.slo_ttft_ms and config.slo_ttft_ms / 1000, config.slo_tpot_ms and config.slo_tpot_ms / 1000,
                    self.cost) if config.slo_schedule and (config.slo_ttft_ms or config.slo_tpot_ms) else None
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_batch_tokens, config.fairness_steps,
                                   config.shared_chunk, pace, self.cost, config.tenant_slowdown or math.inf)
        model, self.fingerprint = build_model(config, weights, self.max_model_len)
        self.exactness = model.exact
        # after the probe: an adapter's weights are held as the ops that passed it hold them
        self.adapters = {name: lora.load(name, folder, c, model.ops.prepare, model.norm.dtype)
                         for name, folder in config.adapters.items()}
        self.runner = ModelRunner(model, self.pool, config.max_num_seqs,
                                  {a.fingerprint: a for a in self.adapters.values()})
        self.sampler = Sampler(self.model_config.eos_token_ids, model.ops)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.speculation = Speculation(Drafter(config.speculative, config.num_speculative_tokens), self.sampler,
                                       self.blocks, config.num_speculative_tokens, config.max_batch_tokens,
                                       self.max_model_len)
        self.cache = CacheAdmin(self.blocks, self.scheduler, self.speculation.drafter, self.grammars, self.scope)
        self.prompt_tokens_computed = 0  # prompt tokens prefilled (a cache hit skips them, n samples share them)
        self.step_tokens = {"prefill": 0, "decode": 0}  # tokens computed in steps: of prompts, of outputs and drafts
        self.ttfts: deque[float] = deque(maxlen=TTFT_WINDOW)
        self.lane_open = False  # a step is under way that lane steps may still run inside
        self.laned = False  # a lane step ran inside the step under way
        del weights  # the file's tensors as read, laid out for the kernels since
        give_back_freed_heap()
        self.grammars.info.add_done_callback(give_back_freed_heap)

    def add_request(self, prompt: list[int], params: SamplingParams, scope: CacheScope | None = None,
                    breakpoints: list[Breakpoint] = (), priority: int = 0, adapter: str = "") -> Sequence:
        """`adapter`: the name of a LoRA adapter (Config.lora_modules) to run the request with; "" for none."""
        if adapter and adapter not in self.adapters:
            raise ValueError(f"no LoRA adapter {adapter!r}; loaded: {', '.join(self.adapters) or 'none'}")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.config.max_tokens)
        drafts = self.config.num_speculative_tokens if self.speculation.drafter.enabled else 0
        check(prompt, params, breakpoints, self.model_config.vocab_size, self.max_model_len, self.blocks, drafts,
              self.config.max_num_seqs)
        scope = self.scope(scope, adapter)
        grammar = self.grammars.compile(scope, params.guide) if params.guide else None
        draft_len = self.config.num_speculative_tokens if self.speculation.applies(params) else 0
        seq = request_samples(prompt, params, scope, list(breakpoints), priority,
                              lambda: Detokenizer(self.tokenizer, params.skip_special_tokens), grammar, draft_len)[0]
        self.scheduler.add(seq)
        return seq

    def step(self, between: Callable[[], None] | None = None) -> list[Sequence]:
        """Run one batch; returns the sequences that received a token, finished or failed (Sequence.fault: that
        request alone failed; every other sequence goes on). If the forward fails, its sequences are aborted (their
        blocks freed) and StepFailed names them. `between`, called before each layer, may call lane_step()."""
        began = self.cost.starting()
        failed = [s for seq, e in self.grammars.hand(self.scheduler.waiting)
                  for s in self.fail(seq, Fault(str(e), internal=not isinstance(e, ValueError)))]
        plan = self.scheduler.schedule(time.monotonic())
        if not plan:  # nothing runnable: give lookups in the KV tiers and grammars a moment rather than spin
            self.blocks.wait_for_lookups(self.scheduler.waiting)
            wait([s.grammar for s in self.scheduler.waiting if s.grammar], 0.002, FIRST_COMPLETED)
            return failed
        self.lane_open, self.laned = True, False
        work, touched = self._run(plan, between)
        if not self.laned:  # else a lane step ran inside it: its time is not this plan's alone
            self.cost.ran(work, began, follows=self.has_unfinished())
        return failed + touched

    def lane_step(self) -> list[Sequence]:
        """Inside a step, before one of its layers: run the waiting requests that Scheduler.lane() lets through in a
        step of their own, so they need not wait for the step under way, and the next tokens of those it ran before,
        as they come due. Without objectives, at most one lane step admits requests inside a step: a stream of short
        requests takes at most about half of the time of the steps it interrupts (a forward's cost is mostly per step,
        not per token, on a CPU); with them, as many as Scheduler.lane lets through (within the slack the step leaves
        its decodes, or the step's own length)."""
        began = time.monotonic()
        plan = self.scheduler.lane(began, self.lane_open)
        if not plan:
            return []
        self.lane_open, self.laned = self.lane_open and self.scheduler.pace is not None, True
        work, touched = self._run(plan, None)
        self.cost.ran(work, began, follows=False)
        return touched

    def _run(self, plan: Plan, between: Callable[[], None] | None) -> tuple[Work, list[Sequence]]:
        drafts = self.speculation.drafts(plan)  # appended to their sequences' tokens for this forward only
        plan = [(seq, n + len(drafts.get(seq.id, ()))) for seq, n in plan]
        work = Work()
        for seq, n in plan:
            work += seq.work(n)
            prompt = max(0, min(seq.num_computed + n, seq.num_prompt) - seq.num_computed)
            self.step_tokens["prefill"] += prompt
            self.step_tokens["decode"] += n - prompt
        try:
            logits = self.runner.run(plan, set(drafts), between)
        except Exception as e:
            seqs = [seq for seq, _ in plan]
            for seq in seqs:
                self.abort(seq)
            raise StepFailed(seqs) from e
        self.scheduler.usage.charge(plan)
        touched = []
        for seq, n in plan:
            draft = drafts.get(seq.id, [])
            if draft:  # unverified: the cache must never publish them
                del seq.tokens[-len(draft):]
            if seq.status is Status.FINISHED:  # another sample of its request failed in this step
                continue
            touched += self._isolated(seq, lambda: self._postprocess(seq, n - len(draft), logits.get(seq.id), draft))
        return work, touched

    def _postprocess(self, seq: Sequence, n: int, logits: torch.Tensor | None, draft: list[int]) -> list[Sequence]:
        """Account the sequence's n computed tokens, then give it (and its prompt's other samples) their next tokens."""
        self.prompt_tokens_computed += max(0, min(seq.num_computed + n, seq.num_prompt) - seq.num_computed)
        seq.num_computed += n
        self.blocks.publish(seq)
        if draft:
            self.speculation.verify(seq, logits, draft, self._append)
            return [seq]
        if logits is None:
            return []
        touched = []
        for s in [seq, *self._fork(seq)]:  # the samples of a request share its prompt's last logits
            touched += self._isolated(s, lambda: self._next_token(s, logits[-1]))
        return touched

    def _next_token(self, seq: Sequence, logits: torch.Tensor) -> list[Sequence]:
        if seq.status is Status.FINISHED:  # another sample of its request failed in this step
            return []
        if seq.matcher:  # structured output: only tokens the grammar allows next (a copy: forks share the row)
            logits = logits.clone()
            seq.matcher.mask(logits)
        token, logprob = self.sampler.sample(logits, seq)
        if seq.matcher:
            seq.matcher.accept(token)
        self._append(seq, token, logprob)
        return [seq]

    def _isolated(self, seq: Sequence, work: Callable[[], list[Sequence]]) -> list[Sequence]:
        """Run one sequence's own work; if it raises, that request fails alone (all its samples) and the step goes
        on. Returns what the work touched, or the failed request's samples."""
        try:
            return work()
        except RowFault as e:
            return self.fail(seq, e.fault)
        except Exception:
            log.exception("a sequence failed in its own work; its request fails alone")
            return self.fail(seq, Fault("internal engine error", internal=True))

    def fail(self, seq: Sequence, fault: Fault) -> list[Sequence]:
        """Abort every sample of seq's request with this fault; returns them."""
        for s in seq.samples:
            if s.status is not Status.FINISHED:
                s.fault = fault
                self.abort(s)
        return list(seq.samples)

    def abort(self, seq: Sequence) -> None:
        if seq.status is Status.FINISHED:
            return
        seq.finish_reason = "abort"
        first = seq.samples[0]
        if seq in first.forks:  # never started
            first.forks.remove(seq)
            seq.status = Status.FINISHED
        else:
            self.scheduler.abort(seq)
        for fork in seq.forks:  # samples that were to start from this prompt compute it themselves
            self.scheduler.add(fork)
        seq.forks = []

    def scope(self, scope: CacheScope | None = None, adapter: str = "") -> CacheScope:
        """The request scope with this engine's fingerprint (weights and arithmetic) and the adapter's filled in."""
        return dataclasses.replace(scope or CacheScope(), fingerprint=self.fingerprint,
                                   adapter=self.adapters[adapter].fingerprint if adapter else "")

    def close(self) -> None:
        """Finish the tiers' queued writes and the KV events, and stop their threads and the grammar trial's process."""
        self.blocks.close()
        self.grammars.close()
        if self.events:
            self.events.close()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self) -> dict:
        s, ttfts = self.blocks.stats(), self.ttfts  # the last TTFT_WINDOW requests'
        return {**s, "saved_prefill_tokens": s["hit_tokens"], "ttft_p50": statistics.median(ttfts) if ttfts else None,
                "ttft_mean": statistics.fmean(ttfts) if ttfts else None, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "preemptions": self.scheduler.num_preemptions,
                "prompt_tokens_computed": self.prompt_tokens_computed, "step_tokens": dict(self.step_tokens),
                **{f"spec_{k}": v for k, v in self.speculation.counts.items()}}

    def health(self) -> dict:
        """For /health: read without the engine thread (lengths and the tiers' breakers), so it never waits."""
        return {"replica_id": self.replica_id, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "tiers": self.blocks.tiers_health(),
                "kv_bytes_per_token": self.pool.bytes_per_token,
                "exactness": self.exactness.summary()}

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Start the samples waiting on this sequence's prompt from its blocks; returns them. One that does not fit
        in memory now waits and prefills on its own (from the cache, if on)."""
        started, forks, seq.forks = [], seq.forks, []
        for fork in forks:
            if self.blocks.fork(seq, fork):
                self.scheduler.adopt(fork)
                started.append(fork)
            else:
                self.scheduler.add(fork)
        return started

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob) -> None:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.ttfts.append(now - seq.arrival)
        if append(seq, token, logprob, self.model_config.eos_token_ids, self.max_model_len):
            seq.finish_time = now
            self.scheduler.finish(seq)
            self.speculation.drafter.record(seq.scope, seq.tokens, len(seq.output_ids))
