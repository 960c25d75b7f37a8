"""The engine's options: every default, and their validation. The ground floor: it imports nothing of prefixcache
and reads nothing when a Config is built; what depends on the machine (the model's path, bfloat16 support) is
resolved where it is used (models/catalog.py, models/cpu.py)."""
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16")
MODES = ("auto", "pad", "fixed", "rows")  # exactness; the probe may also choose "kernel", when our kernels run
ISAS = ("avx512", "avx2")  # our kernel builds, best first (prefixcache/kernels); the ops' isa argument indexes this
KERNELS = ("auto", *ISAS, "off")


@dataclass
class Config:
    """Every engine default lives here."""

    model: str = ""  # GGUF file, HF safetensors folder, or a shipped model's name (models/catalog.py: smollm2-135m,
    # gemma3-270m); "" means the default, smollm2-135m
    dtype: str = "float32"  # weights and activations; bfloat16 needs a CPU with avx512_bf16 or AMX (models/cpu.py)
    kv_dtype: str = "auto"  # KV storage; "auto": the activation dtype. bfloat16 halves it but is lossy (opt-in)
    exactness: str = "auto"  # how rows stay batch-invariant (models/exactness.py): auto | pad | fixed | rows;
    # auto runs our kernels where they can run (float32, a block size and head size that are multiples of 16),
    # the others force the torch path
    kernels: str = "auto"  # the kernel build (prefixcache/kernels): auto | avx512 | avx2 | off (the torch path)
    quantized_reads: bool = True  # on our kernels, a model's weights stay as shipped (a GGUF's blocks of any common
    # type, 16-bit matrices as 16 bits) and every call reads them: the bits of their fp32 values (models/quant.py);
    # off, they are dequantized to fp32 at load (the reference, at 4-8x the memory)
    block_size: int = 16  # tokens per KV block
    attn_tile: int = 512  # keys per attention tile; fixed so a token's math never depends on its batch
    kv_cache_bytes: int = 2 << 30  # one budget for live and cached KV
    max_num_seqs: int = 16  # sequences in flight
    max_batch_tokens: int = 512  # tokens per engine step (decode rows + prefill chunks)
    max_model_len: int = 0  # 0: the model's context length
    max_tokens: int = 256  # output tokens of a request that sets none (SamplingParams.max_tokens None)
    enable_prefix_cache: bool = True  # reuse the KV of earlier requests' prefixes (off: every prompt is computed)
    min_cache_tokens: int = 0  # prefixes shorter than this are never written to the cache
    default_ttl: float | None = None  # seconds; None keeps automatic entries until evicted
    shared_prefixes: list[list[int]] = field(default_factory=list)  # token prefixes shared by all tenants
    log_cross_scope_misses: bool = False  # operator log: flag misses whose next block another scope holds
    shared_chunk: int = 0  # while several tenants have work, each one's prefill tokens per step, but for the one
    # with the least engine time lately (0: off); and a request needing at most this many tokens runs inside the
    # step under way (Engine.lane_step). Small values keep other tenants' first tokens fast, at the cost of the
    # long prompts' throughput
    tenant_slowdown: float = 1.4  # while tenants decode in one step, the most it may take over what it would with
    # each one's decode rows alone, unless an equal part of the rows each takes longer; the prompt chunks of tenants
    # with more engine time lately are cut to it too (engine/slowdown.py); 0: off. Below the 1.5x we promise: the
    # bound is on predicted steps, and the steps seen came out some 5% over it
    fairness_steps: int = 32  # a waiting request is admitted first once it has been passed over this often
    slo_ttft_ms: float | None = None  # a time-to-first-token objective: /metrics counts the requests that met and
    # missed it, and (slo_schedule) a waiting request is admitted before it would miss it
    slo_tpot_ms: float | None = None  # a time-per-output-token objective (after the first, as vLLM's benchmark
    # computes it), counted the same way, and (slo_schedule) a step takes the prefill its decodes' slack allows,
    # and lasts no longer than the objective while answers decode
    slo_schedule: bool = True  # given objectives, size each step against them (engine/pace.py); off, they are only
    # counted and steps are sized by max_batch_tokens alone, as without objectives
    speculative: str = "off"  # draft tokens from: off | prompt (lookup in the request) | answers (the scope's
    # recent outputs) | both; every draft is verified, so greedy output is bit-identical (engine/drafter.py)
    num_speculative_tokens: int = 8  # the longest draft, up to 16; each request's shrinks with its acceptance
    num_threads: int = 0  # 0: torch's default
    lora_modules: str = ""  # LoRA adapters (PEFT folders) a request may name as its model: NAME=PATH[,NAME=PATH...]
    # KV tiers below host memory (cache/tiers.py), each off unless set:
    disk_cache: str = ""  # L2: a folder for blocks evicted from memory, this user's alone (made 0700; refused if not)
    disk_cache_gb: float = 10.0  # L2's byte budget (GiB), least recently used out first
    redis_url: str = ""  # L3, shared by replicas, and the KV event stream: redis://HOST:PORT/DB
    redis_kv: bool = True  # keep KV blocks in Redis (L3); off: Redis carries only the KV events (for routers)
    redis_ttl: float = 3600.0  # seconds an L3 entry without a TTL of its own lives (pinned ones: for ever)
    redis_owner_blocks: int = 0  # L3 blocks one owner (tenant and labels) may keep, its soonest to expire out first
    # (0: no cap; Redis's volatile-lru is over everyone: set it so that the owners' caps fit Redis's maxmemory)
    # secrets come from files or the environment, never from a value here (cache/credentials.py):
    redis_password_file: str = ""  # "": $PREFIXCACHE_REDIS_PASSWORD, if set
    tier_secret_file: str = ""  # the key of L2/L3 records' MACs; "": $PREFIXCACHE_TIER_SECRET, else one of this
    # replica's own (kept in the disk cache's folder, else in memory: then no other replica can read its L3 blocks)
    replica_id: str = ""  # this replica's name in KV events; "" -> hostname-pid
    kv_events_config: str = ""  # vLLM's KV events over ZMQ, as vLLM's JSON (cache/zmq_events.py); "": none

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if self.attn_tile % self.block_size:
            raise ValueError(f"attn_tile={self.attn_tile} must be a multiple of block_size={self.block_size}")
        for name, choices in (("dtype", DTYPES), ("kv_dtype", ("auto", *DTYPES)), ("exactness", MODES),
                              ("kernels", KERNELS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            ms = getattr(self, name)
            if ms is not None and not 0 < ms < float("inf"):
                raise ValueError(f"{name}={ms} (--{name.replace('_', '-')}): milliseconds must be a positive number")
        if self.tenant_slowdown and not self.tenant_slowdown >= 1:
            raise ValueError(f"tenant_slowdown={self.tenant_slowdown} (--tenant-slowdown): a factor of at least 1, "
                             "or 0 for none")
        self.adapters  # a malformed lora_modules is refused here
        if (self.disk_cache or self.redis_url) and not self.enable_prefix_cache:
            raise ValueError("disk_cache and redis_url are tiers of the prefix cache: enable it")

    @property
    def adapters(self) -> dict[str, str]:
        """lora_modules as {name: folder}."""
        pairs = [p.partition("=") for p in self.lora_modules.split(",") if p.strip()]
        if any(not name.strip() or not eq or not path.strip() for name, eq, path in pairs):
            raise ValueError(f"lora_modules={self.lora_modules!r} (--lora-modules): NAME=PATH pairs, comma-separated")
        adapters = {name.strip(): path.strip() for name, _, path in pairs}
        if len(adapters) < len(pairs):
            raise ValueError(f"lora_modules={self.lora_modules!r} (--lora-modules): a name given twice")
        return adapters

    @property
    def kv_storage_dtype(self) -> str:
        """The dtype the KV is stored in: kv_dtype, or for "auto" the activation dtype."""
        return self.dtype if self.kv_dtype == "auto" else self.kv_dtype
