"""The engine: one owner of all mutable state (pool, cache, queues). Callers add requests and call step()."""
import dataclasses
import logging
import os
import socket
import statistics
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable

import torch
import xxhash

from prefixcache import kernels
from prefixcache.cache.policy import Breakpoint
from prefixcache.cache.pool import KVPool
from prefixcache.cache.scope import CacheScope
from prefixcache.cache.zmq_events import open_events
from prefixcache.config import Config
from prefixcache.engine.blocks import BlockManager
from prefixcache.engine.detokenizer import Detokenizer
from prefixcache.engine.drafter import Drafter
from prefixcache.engine.grammar import Grammars
from prefixcache.engine.runner import ModelRunner
from prefixcache.engine.sampler import RowFault, Sampler, logprobs
from prefixcache.engine.scheduler import Scheduler
from prefixcache.engine.sequence import Fault, RequestOutput, SamplingParams, Sequence, Status, TokenLogprob
from prefixcache.engine.speculation import Speculation
from prefixcache.engine.tiering import open_tiers
from prefixcache.models.exactness import probe
from prefixcache.models.llama import Llama
from prefixcache.models.loader import load
from prefixcache.models.rowwise import KernelOps, TorchOps

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
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        weights = load(config.model, getattr(torch, config.dtype))
        self.tokenizer = weights.tokenizer
        self.model_config = weights.config
        self.model_name = weights.name
        self.max_model_len = min(config.max_model_len or weights.config.max_position, weights.config.max_position)
        c = weights.config
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, config.block_size, config.kv_cache_bytes,
                           getattr(torch, config.kv_dtype), run=config.attn_tile // config.block_size)
        self.blocks = BlockManager(self.pool, config.enable_prefix_cache, config.min_cache_tokens,
                                    config.default_ttl, config.shared_prefixes, config.log_cross_scope_misses)
        self.replica_id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"  # its name in KV events
        if config.disk_cache or config.redis_url:
            self.blocks.attach(open_tiers(config, c, self.replica_id))
        if config.kv_events_config and not config.enable_prefix_cache:
            raise ValueError("--kv-events-config: KV events need the prefix cache")
        self.events = open_events(config.kv_events_config, config.block_size, self.blocks.owner) if config.kv_events_config else None
        if self.events:
            self.blocks.listen(self.events)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_batch_tokens, config.fairness_steps,
                                   config.shared_chunk)
        ops, status = _ops(config, c.head_dim)
        model = Llama(weights, config.attn_tile, ops)
        self.exactness = model.exact = probe(model, config.exactness, config.max_batch_tokens, config.max_num_seqs,
                                             status)
        # cached KV is reused only by the same weights under the same arithmetic (a disk or Redis tier may hold KV
        # of other replicas: on the torch path, or on kernels built from other sources, its bits are not ours)
        arithmetic = model.ops.arithmetic(self.exactness.cpu)
        self.fingerprint = xxhash.xxh3_128_hexdigest(f"{weights.fingerprint} {arithmetic}".encode())
        self.runner = ModelRunner(model, self.pool, config.max_num_seqs)
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.speculation = Speculation(Drafter(config.speculative, config.num_speculative_tokens), self.sampler,
                                       self.blocks, config.num_speculative_tokens, config.max_batch_tokens,
                                       self.max_model_len)
        self.prompt_tokens_computed = 0  # prompt tokens prefilled (a cache hit skips them, n samples share them)
        self.ttfts: deque[float] = deque(maxlen=TTFT_WINDOW)
        self.lane_open = False  # a step is under way and no lane step has run inside it

    def add_request(self, prompt: list[int], params: SamplingParams, scope: CacheScope | None = None,
                    breakpoints: list[Breakpoint] = (), priority: int = 0) -> Sequence:
        if not prompt:
            raise ValueError("prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the context window is {self.max_model_len}")
        if any(t < 0 or t >= self.model_config.vocab_size for t in prompt):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.model_config.vocab_size})")
        for b in breakpoints:
            if not 0 < b.position <= len(prompt):
                raise ValueError(f"breakpoint at {b.position} is outside the prompt (1..{len(prompt)})")
        # alone in the pool it must still fit, prompt and output (and a draft): else it would be preempted and
        # restarted forever, its steps starving everyone else's
        drafts = self.config.num_speculative_tokens if self.speculation.drafter.enabled else 0
        longest = min(len(prompt) + params.max_tokens, self.max_model_len) + drafts  # output stops at the window
        if not self.blocks.fits(longest):
            raise ValueError(f"the prompt ({len(prompt)} tokens) and max_tokens ({params.max_tokens}) need "
                             f"{self.blocks.blocks_for(longest)} KV blocks; the cache holds {self.blocks.room()} "
                             "(pinned entries excluded)")
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words", [t for word in params.bad_words for t in word])):
            if any(t < 0 or t >= vocab for t in ids):
                raise ValueError(f"{name}: token ids must be in the vocabulary [0, {vocab})")
        if params.num_samples > self.config.max_num_seqs:
            raise ValueError(f"n and best_of must be at most {self.config.max_num_seqs} (max_num_seqs)")
        samples = [Sequence(prompt, params.sample(i), self.scope(scope), list(breakpoints), priority)
                   for i in range(params.num_samples)]
        grammar = self.grammars.compile(samples[0].scope, params.guide) if params.guide else None
        for i, seq in enumerate(samples):
            seq.index, seq.samples, seq.grammar = i, samples, grammar
            seq.detok = Detokenizer(self.tokenizer, params.skip_special_tokens)
            seq.draft_len = self.config.num_speculative_tokens if self.speculation.applies(seq) else 0
        seq = samples[0]
        seq.forks = samples[1:]  # they start from its blocks once its prompt is computed
        self.scheduler.add(seq)
        return seq

    def step(self, between: Callable[[], None] | None = None) -> list[Sequence]:
        """Run one batch; returns the sequences that received a token, finished or failed (Sequence.fault: that
        request alone failed; every other sequence goes on). If the forward fails, its sequences are aborted (their
        blocks freed) and StepFailed names them. `between` is called before each layer of the forward; it may call
        lane_step()."""
        failed = self._compiled()
        plan = self.scheduler.schedule()
        if not plan:  # nothing runnable: give lookups in the KV tiers and grammars a moment rather than spin
            self.blocks.wait_for_lookups(self.scheduler.waiting)
            wait([s.grammar for s in self.scheduler.waiting if s.grammar], 0.002, FIRST_COMPLETED)
            return failed
        self.lane_open = True
        return failed + self._guarded(plan, between)

    def lane_step(self) -> list[Sequence]:
        """Inside a step, before one of its layers: run the waiting requests that Scheduler.lane() lets through
        (at most `shared_chunk` tokens) in a step of their own, so they need not wait for the step under way. At
        most one lane step runs inside a step: a stream of short requests takes at most about half of the time
        of the steps it interrupts (a forward's cost is mostly per step, not per token, on a CPU)."""
        plan = self.scheduler.lane(self.config.shared_chunk) if self.lane_open else []
        if not plan:
            return []
        self.lane_open = False
        return self._guarded(plan, None)

    def _guarded(self, plan: list[tuple[Sequence, int]], between: Callable[[], None] | None) -> list[Sequence]:
        drafts = self.speculation.drafts(plan)  # appended to their sequences' tokens for this forward only
        plan = [(seq, n + len(drafts.get(seq.id, ()))) for seq, n in plan]
        try:
            logits, prompt_hidden = self.runner.run(plan, set(drafts), between)
        except Exception as e:
            seqs = [seq for seq, _ in plan]
            for seq in seqs:
                self.abort(seq)
            raise StepFailed(seqs) from e
        self.scheduler.charge(plan)
        touched = []
        for seq, n in plan:
            draft = drafts.get(seq.id, [])
            if draft:  # unverified: the cache must never publish them
                del seq.tokens[-len(draft):]
            if seq.status is Status.FINISHED:  # another sample of its request failed in this step
                continue
            touched += self._isolated(seq, lambda: self._advance(seq, n - len(draft), logits.get(seq.id), draft,
                                                                 prompt_hidden.get(seq.id)))
        return touched

    def _advance(self, seq: Sequence, n: int, logits: torch.Tensor | None, draft: list[int],
                 prompt_hidden: tuple[int, torch.Tensor] | None) -> list[Sequence]:
        """After the forward: account the sequence's n computed tokens, then give it (and the samples that start
        from its prompt) its next tokens. Returns the sequences touched."""
        self.prompt_tokens_computed += max(0, min(seq.num_computed + n, seq.num_prompt) - seq.num_computed)
        if prompt_hidden:
            self._prompt_logprobs(seq, *prompt_hidden)
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

    def _compiled(self) -> list[Sequence]:
        """Hand the waiting requests whose grammar has compiled their matchers; fail those whose guide does not
        compile (a 400). Returns the failed ones."""
        failed = []
        for seq in list(self.scheduler.waiting):
            if not (seq.grammar and seq.grammar.done()):
                continue
            if seq.grammar.exception():
                e = seq.grammar.exception()
                failed += self.fail(seq, Fault(str(e), internal=not isinstance(e, ValueError)))
                continue
            grammar = seq.grammar.result()
            for s in [seq, *seq.forks]:
                s.matcher, s.grammar = self.grammars.matcher(grammar), None
        return failed

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

    def scope(self, scope: CacheScope | None = None) -> CacheScope:
        """The request scope with this engine's fingerprint (weights and arithmetic) filled in."""
        return dataclasses.replace(scope or CacheScope(), fingerprint=self.fingerprint)

    def purge(self, scope: CacheScope) -> int:
        """Drop a scope's unreferenced cache entries; returns blocks freed."""
        return self.blocks.cache.purge(self.scope(scope).key)

    def purge_tenant(self, tenant: str, labels: tuple[str, ...] = ()) -> int:
        """Drop the unreferenced entries of a tenant and label set under every salt; returns blocks freed."""
        self.speculation.drafter.purge_tenant(tenant, labels)
        self.grammars.purge_tenant(tenant, labels)
        return self.blocks.purge_tenant(tenant, labels)

    def pin(self, prompt: list[int], scope: CacheScope | None = None, pinned: bool = True) -> int:
        """Pin (or unpin) the cached full blocks of a prompt so eviction never takes them; returns tokens pinned."""
        seq = Sequence(prompt, SamplingParams(), self.scope(scope))
        self.blocks.prepare(seq)
        nodes = self.blocks.match(seq, limit=len(prompt)).nodes
        self.blocks.pin(nodes, pinned)
        return len(nodes) * self.config.block_size

    def prefix_keys(self, prompt: list[int], scope: CacheScope | None = None) -> list[str]:
        """The cache keys (hex) of a prompt's full blocks under a scope, as its request would look them up (for a
        router). It reads no mutable state, so any thread may call it."""
        seq = Sequence(prompt, SamplingParams(), self.scope(scope))
        self.blocks.prepare(seq)
        return [k.hex() for k in seq.cache.keys]

    def set_cache_shares(self, shares: dict[str, float]) -> None:
        """Guaranteed fractions of the KV pool by tenant (summing to at most 1): eviction takes from the tenant
        furthest over its share first; tenants without one split the rest equally."""
        self.blocks.cache.set_shares(shares, group=lambda owner: owner[0])  # owners are (tenant, labels)

    def usage(self, top: int = 10) -> dict:
        """For the operator: each tenant's cached blocks and recent engine use (tokens computed, fading over
        USAGE_HALF_LIFE), and the cached prefixes that saved the most prefill (no token text: key, size, reuse)."""
        held, recent = self.blocks.cache.blocks_by_owner(), self.scheduler.usage
        tenants = sorted({t for t, _ in held} | set(recent))
        return {"tenants": [{"tenant": t, "blocks": sum(n for (owner, _), n in held.items() if owner == t),
                             "recent_tokens": round(recent.get(t, 0.0), 1)} for t in tenants],
                "prefixes": [{"tenant": owner[0], "labels": list(owner[1]), "key": node.key.hex()[:16],
                              "tokens": tokens, "hits": node.hits, "saved_tokens": node.hits * tokens}
                             for owner, node, tokens in self.blocks.cache.top(top)]}

    def clear_cache(self) -> int:
        self.speculation.drafter.tables.clear()
        self.grammars.clear()
        return self.blocks.clear()

    def close(self) -> None:
        """Finish the tiers' queued writes and the KV events, and stop their threads."""
        if self.blocks.tiering:
            self.blocks.tiering.tiers.close()
        if self.events:
            self.events.close()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def output(self, seq: Sequence) -> RequestOutput:
        end, c = seq.finish_time, seq.cache
        return RequestOutput(
            request_id=seq.id, prompt_token_ids=seq.tokens[:seq.num_prompt], token_ids=seq.output_ids, text=seq.text,
            finish_reason=seq.finish_reason, cached_tokens=c.num_cached or 0, cache_write_tokens=dict(c.write),
            scope_kind=c.scope_kind, miss_cause=c.miss_cause,
            ttft=seq.first_token_time - seq.arrival if seq.first_token_time else None,
            latency=end - seq.arrival if end else None, index=seq.index, cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs and list(seq.logprobs),
            prompt_logprobs=seq.prompt_logprobs and list(seq.prompt_logprobs),
            accepted_draft_tokens=seq.accepted_draft_tokens, cached_by_tier=c.by_tier(),
            error=seq.fault.message if seq.fault else None,
        )

    def stats(self) -> dict:
        s = self.blocks.stats()
        s["saved_prefill_tokens"] = s["hit_tokens"]
        s["ttft_p50"] = statistics.median(self.ttfts) if self.ttfts else None  # over the last TTFT_WINDOW
        s["ttft_mean"] = statistics.fmean(self.ttfts) if self.ttfts else None
        s["running"] = len(self.scheduler.running)
        s["waiting"] = len(self.scheduler.waiting)
        s["preemptions"] = self.scheduler.num_preemptions
        s["prompt_tokens_computed"] = self.prompt_tokens_computed
        s.update({f"spec_{k}": v for k, v in self.speculation.counts.items()})
        s["tiers"] = self.blocks.tiering.tiers.stats() if self.blocks.tiering else None
        return s

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

    def _prompt_logprobs(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after positions start.. (whose hidden states these are). The LM head runs on
        at most max_num_seqs rows per call: the row counts the exactness probe verified for it."""
        rows = self.config.max_num_seqs
        for i in range(0, len(hidden), rows):
            raw = torch.log_softmax(self.runner.model.logits(hidden[i:i + rows]).float(), dim=-1)
            p = start + i + 1
            targets = seq.tokens[p:p + len(raw)]
            seq.prompt_logprobs[p:p + len(raw)] = logprobs(raw, targets, [seq.params.prompt_logprobs] * len(raw),
                                                           ranks=True)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob) -> None:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.ttfts.append(now - seq.arrival)
        seq.tokens.append(token)
        seq.cumulative_logprob += logprob.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        # a stop token's text is not part of the output (unless asked); the sampler masks them until min_tokens
        eos = token in self.model_config.eos_token_ids
        # a finished grammar accepted its stop token: nothing may follow it, ignore_eos or not
        stop_token = token in p.stop_token_ids or (eos and not p.ignore_eos) or bool(seq.matcher and seq.matcher.done)
        new = "" if stop_token and not p.include_stop_str_in_output else seq.detok.add(token)
        text = seq.detok.text
        stops = p.stop if len(seq.output_ids) >= p.min_tokens else []
        since = len(text) - len(new) - max(map(len, stops), default=0) + 1  # only new text can complete a stop
        # the earliest stop string in the text, the longest of those that start there
        stop_at, stop = min(((i, s) for s in stops if (i := text.find(s, max(since, 0))) >= 0),
                            key=lambda f: (f[0], -len(f[1])), default=(-1, ""))
        keep = len(stop) if p.include_stop_str_in_output else 0
        seq.text = text[:stop_at + keep] if stop_at >= 0 else text
        if stop_token or stop_at >= 0:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return
        if stop_at < 0:
            seq.text += seq.detok.flush()
        seq.finish_time = now
        self.scheduler.finish(seq)
        self.speculation.drafter.record(seq.scope, seq.tokens, len(seq.output_ids))


def _ops(config: Config, head_dim: int) -> tuple[KernelOps | TorchOps, str]:
    """Our kernels where they can run, else torch's; and what runs, or why the kernels do not."""
    unfit = [why for why, bad in (("float32 only", config.dtype != "float32" or config.kv_dtype != "float32"),
                                  (f"exactness={config.exactness!r} forces the torch path", config.exactness != "auto"),
                                  ("block size and head size must be multiples of 16",
                                   config.block_size % 16 or head_dim % 16)) if bad]
    if config.kernels == "off" or unfit:
        return TorchOps(), f"off: {'; '.join(unfit) or 'kernels=off'}"
    choice = kernels.choose(config.kernels)
    return (KernelOps(choice.isa) if choice.isa else TorchOps()), choice.status
