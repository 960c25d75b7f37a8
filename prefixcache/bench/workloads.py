"""Benchmark workloads: deterministic generators (same seed, same requests) and a JSONL loader.

A workload is a list of sessions. A session is one user's sequence of turns; with `carry`, each turn's request
repeats the earlier turns and the assistant replies the server actually returned (a growing chat), otherwise
every turn is an independent request. Text is drawn from a small vocabulary of common words, which the
SmolLM2 tokenizer encodes at about 1.1 tokens per word (capitals and full stops included); `text(rng, n)` aims
at n tokens. The driver reports the token counts the server actually saw.
"""
import json
import os
import random
import re
from dataclasses import dataclass, field

from prefixcache.prompt import chat_messages, fields

WORDS = ("the of and to in is for that on with as it by be are this from or at an not which have was all can "
         "will one has more but their other about time some into these data system user may two only new use "
         "first also any way could work each such most well over after order number should then must account "
         "service customer policy report value price cost file page rule case issue step result change team "
         "support request update refund payment invoice contract product shipping delivery warranty billing "
         "ticket manager review access record process answer question problem reason source section table "
         "model memory cache token prompt server client network storage region plan limit level status error "
         "message group member owner budget project schedule meeting office travel expense approval audit").split()
TOKENS_PER_WORD = 1.1


@dataclass
class Turn:
    messages: list[dict]  # appended to the session's history for this request
    max_tokens: int
    arrival: float | None = None  # seconds from the start (JSONL workloads, traces); None: the driver decides
    prompt_ids: list[int] | None = None  # traces: these token ids to /v1/completions (ignore_eos), not messages


@dataclass
class Session:
    turns: list[Turn]
    tenant: str = "default"
    tools: list[dict] | None = None
    carry: bool = False  # multi-turn: each request includes the earlier turns and replies

    def logged(self) -> list[tuple[Turn, list[dict]]]:
        """Each turn with the messages a log of it holds: with carry, the earlier turns' messages before its own
        (the replies are the server's, not the log's)."""
        out, history = [], []
        for turn in self.turns:
            history = history + turn.messages if self.carry else turn.messages
            out.append((turn, history))
        return out


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    notes: str = ""
    tenants: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass
class Size:
    """Knobs shared by every generator; `quick` shrinks them for a smoke run."""

    requests: int = 8
    prefix_tokens: int = 1024  # the shared part: system prompt + tools + few-shot
    question_tokens: int = 32
    max_tokens: int = 16
    turns: int = 4
    tenants: int = 4

    @classmethod
    def quick(cls) -> "Size":
        return cls(requests=4, prefix_tokens=160, question_tokens=12, max_tokens=4, turns=2, tenants=2)


def text(rng: random.Random, n: int) -> str:
    """About n tokens of sentence-like filler."""
    words, out = [rng.choice(WORDS) for _ in range(max(round(n / TOKENS_PER_WORD), 1))], []
    for i in range(0, len(words), 12):
        chunk = words[i:i + 12]
        out.append(chunk[0].capitalize() + " " + " ".join(chunk[1:]) + ".")
    return " ".join(out)


def tools(rng: random.Random, n: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}_{rng.choice(WORDS)}", "description": text(rng, 24),
        "parameters": {"type": "object", "properties": {w: {"type": "string", "description": text(rng, 6)}
                                                        for w in rng.sample(WORDS, 3)}}}} for i in range(n)]


def system_prompt(rng: random.Random, n: int, who: str = "Example Corporation") -> str:
    """A system prompt of about n tokens: instructions, then few-shot examples."""
    shots = "\n".join(f"Example {i + 1}. Question: {text(rng, 20)} Answer: {text(rng, 28)}" for i in range(n // 160))
    return f"You are the assistant of {who}. {text(rng, n - (n // 160) * 56)}\n{shots}"


def question(rng: random.Random, n: int) -> dict:
    return {"role": "user", "content": f"Question: {text(rng, n)}?"}


def shared_system_prompt(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    n_tools = max(1, min(4, size.prefix_tokens // 384))
    tl = tools(rng, n_tools)
    system = {"role": "system", "content": system_prompt(rng, max(size.prefix_tokens - 125 * n_tools, 64))}
    sessions = [Session([Turn([system, question(rng, size.question_tokens)], size.max_tokens)], tools=tl)
                for _ in range(size.requests)]
    return Workload("shared-system-prompt", sessions, "same system prompt, tools and few-shot for every user; "
                    "a different question each")


def multi_turn(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    system = {"role": "system", "content": system_prompt(rng, size.prefix_tokens // 2)}
    sessions = []
    for _ in range(max(size.requests // size.turns, 1)):
        turns = [Turn([question(rng, size.question_tokens)], size.max_tokens) for _ in range(size.turns)]
        turns[0].messages.insert(0, system)
        sessions.append(Session(turns, carry=True))
    return Workload("multi-turn", sessions, f"conversations of {size.turns} turns; each request carries the earlier "
                    "turns and the replies the server returned")


def rag(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    docs = [f"Document {i}: {text(rng, size.prefix_tokens // 4)}" for i in range(4 * size.requests)]
    system = {"role": "system", "content": "Answer from the passages below only. Cite the document number."}
    sessions = []
    for _ in range(size.requests):
        passages = "\n\n".join(rng.sample(docs, 3))
        user = {"role": "user", "content": f"{passages}\n\n{question(rng, size.question_tokens)['content']}"}
        sessions.append(Session([Turn([system, user], size.max_tokens)]))
    return Workload("rag", sessions, "3 passages drawn per request from a rotating pool of documents: little reuse")


def volatile_prefix(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    stable = system_prompt(rng, size.prefix_tokens)
    sessions = []
    for i in range(size.requests):
        stamp = (f"Request id: {rng.getrandbits(64):016x}. "
                 f"Current time: 2026-03-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:07Z.")
        system = {"role": "system", "content": f"{stamp}\n{stable}"}
        sessions.append(Session([Turn([system, question(rng, size.question_tokens)], size.max_tokens)]))
    return Workload("volatile-prefix", sessions, "anti-pattern: a request id and timestamp at the top of an otherwise "
                    "stable system prompt, so nothing after them can be reused")


def multi_tenant(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    names = [f"tenant{i}" for i in range(size.tenants)]
    systems = {t: {"role": "system", "content": system_prompt(rng, size.prefix_tokens, f"{t} Inc")} for t in names}
    order = [names[i % len(names)] for i in range(size.requests)]
    rng.shuffle(order)
    sessions = [Session([Turn([systems[t], question(rng, size.question_tokens)], size.max_tokens)], tenant=t)
                for t in order]
    return Workload("multi-tenant", sessions, f"{size.tenants} tenants, each with its own system prompt and API key, "
                    "interleaved in random order", tenants=names)


# Workloads whose answers copy or repeat (speculative decoding's): outputs of 10x max_tokens, since copying takes
# a while to pay off
CODE_FILES = ("engine/scheduler.py", "cache/pool.py", "engine/grammar.py", "engine/llm.py")  # ours: real code
CITIES = ("Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Riga", "Seoul", "Hanoi", "Dakar", "Perth", "Turin")


def code_edit(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sessions = []
    for i in range(size.requests):
        with open(os.path.join(root, CODE_FILES[i % len(CODE_FILES)])) as f:
            source = f.read()
        name = rng.choice(re.findall(r"^def (\w+)|^    def (\w+)", source, re.M))
        name = name[0] or name[1]
        ask = (f"Rewrite this Python file with the function {name} renamed to {name}_v2. Output the whole file."
               f"\n\n```python\n{source}```")
        sessions.append(Session([Turn([{"role": "user", "content": ask}], 10 * size.max_tokens)]))
    return Workload("code-edit", sessions, "rewrite one of four 40-100-line files with a function renamed")


def rag_quote(seed: int, size: Size) -> Workload:
    rng = random.Random(seed)
    docs = [system_prompt(rng, size.prefix_tokens // 2, f"Site {i}") for i in range(2)]
    asks = ("Quote the first three sentences of the text above word for word.",
            "Quote the first example of the text above word for word.")
    sessions = [Session([Turn([{"role": "system", "content": docs[i % 2]},
                               {"role": "user", "content": asks[i // 2 % 2]}], 10 * size.max_tokens)])
                for i in range(size.requests)]
    return Workload("rag-quote", sessions, "questions whose answers quote one of two documents")


def agent_steps(seed: int, size: Size) -> Workload:
    def shot(city: str) -> list[dict]:
        call = {"tool": "get_weather", "arguments": {"city": city, "unit": "celsius", "days": 1}}
        return [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": json.dumps(call)}]
    rng = random.Random(seed)
    system = {"role": "system", "content": "You call tools. Reply with one JSON object only."}
    sessions = [Session([Turn([system, *shot("Rome"), *shot("Cairo"),
                               {"role": "user", "content": f"What is the weather in {rng.choice(CITIES)}?"}],
                              10 * size.max_tokens)], tenant="agent") for _ in range(size.requests)]
    return Workload("agent-steps", sessions, "one tenant's tool calls of the same JSON shape, after two examples",
                    tenants=["agent"])


GENERATORS = {"shared-system-prompt": shared_system_prompt, "multi-turn": multi_turn, "rag": rag,
              "volatile-prefix": volatile_prefix, "multi-tenant": multi_tenant, "code-edit": code_edit,
              "rag-quote": rag_quote, "agent-steps": agent_steps}
SPECULATIVE = ("code-edit", "rag-quote", "agent-steps")  # not in the default set: run them by name


def build(name: str, seed: int, size: Size) -> Workload:
    if name in GENERATORS:
        return GENERATORS[name](seed, size)
    return load_jsonl(name, size.max_tokens)


def load_jsonl(path: str, default_max_tokens: int) -> Workload:
    """One OpenAI chat or Anthropic messages request per line, with optional `tenant` and `arrival` (seconds).

    Anthropic requests (a top-level `system`, tools with `input_schema`) are sent as the plain chat messages our
    server renders them into (prefixcache/prompt.py: tools as text at the top of the system message), so every
    target is driven through the OpenAI API and ours sees the tokens its Anthropic route would; `cache_control`
    marks are dropped.
    """
    sessions = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            req = json.loads(line)
            if "messages" not in req:
                raise ValueError(f"{path}:{n}: not a chat request (no `messages`)")
            anthropic = "system" in req or any(t.get("input_schema") for t in req.get("tools", []))
            messages, tl = (chat_messages(fields(req)), None) if anthropic else (req["messages"], req.get("tools"))
            max_tokens = req.get("max_tokens") or req.get("max_completion_tokens") or default_max_tokens
            sessions.append(Session([Turn(messages, max_tokens, req.get("arrival"))],
                                    tenant=req.get("tenant", "default"), tools=tl))
    tenants = sorted({s.tenant for s in sessions} - {"default"})
    return Workload(path, sessions, f"user workload from {path}", tenants=tenants)
