"""A request's speculation state: how long its next draft may be, and when it drafts at all.

A draft the model accepts in full lets the next one be as long as the engine allows; a partial one, one token
longer than what was accepted. Drafts that keep failing cost each step a little (the verification's extra rows), so
after DRAFT_MISSES in a row with nothing accepted the request pauses drafting for a while: one decode step, then
twice as long each time it happens again, up to MAX_PAUSE, and back to one after any acceptance. It never stops for
good: text that copies (an answer quoting its prompt, or repeating itself) often starts after text that does not,
and a request that stopped drafting there lost every copy after it (prompt lookup on a code edit: 1.05 output
tokens a step, against 1.9 when it drafts on).
"""
from dataclasses import dataclass

DRAFT_MISSES = 3  # failed drafts in a row before a pause
MAX_PAUSE = 64  # decode steps


@dataclass
class Drafting:
    length: int  # the next draft's longest; 0: this request never drafts
    misses: int = 0  # drafts in a row with nothing accepted
    pause: int = 0  # decode steps left without a draft
    backoff: int = 1  # the next pause's steps

    def ready(self) -> bool:
        """Whether to draft at this decode step (a paused request counts the step instead)."""
        if self.pause:
            self.pause -= 1
            return False
        return self.length > 0

    def verified(self, drafted: int, accepted: int, longest: int) -> None:
        """After a draft of `drafted` tokens of which the model accepted `accepted`; `longest`: the engine's limit."""
        self.length = longest if accepted == drafted else accepted + 1
        if accepted:
            self.misses, self.backoff = 0, 1
            return
        self.misses += 1
        if self.misses == DRAFT_MISSES:
            self.misses, self.pause, self.backoff = 0, self.backoff, min(2 * self.backoff, MAX_PAUSE)
