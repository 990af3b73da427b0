"""When a cost-aware policy declines to pay for draft-model forwards, and when it asks again.

A tree whose drafting ran a model and whose best expected rate falls short of plain one-token
steps starts an idle spell: the next iterations draft with the drafter's model-free part only, or
verify the root alone. The iteration after a spell is a probe: it asks the model again. A probe is
judged once what it taught is learnt: if its tree would now pay in expectation, drafting resumes;
else a probe that beat plain steps in measured tokens per second halves the next spell (acceptance
is coming back faster than the calibration shows) and one that did not doubles it, up to
`backoff_max`. Pure: it is told what happened, it reads no clock and calls no model.
"""

from __future__ import annotations

DRAFT, IDLE, PROBE = "draft", "idle", "probe"  # what an iteration does (`DraftGate.begin`)


class DraftGate:
    """The idle/probe state of one run (`start_run`, called by `DynaTreePolicy.prepare`; not named
    `reset`: the layout test refuses policies calling a drafter's method names)."""

    def __init__(self, backoff_max: int):
        self.backoff_max = backoff_max  # longest spell of iterations without drafting between two probes
        self.start_run()

    def start_run(self) -> None:
        self.idle = 0  # iterations left to run without the draft model
        self.backoff = 0  # the spell after the next probe if it does not pay either (0: drafting pays)
        self.idle_iterations = 0  # iterations of this run that declined the draft model

    def begin(self) -> str:
        """What the next iteration does: IDLE (counted), PROBE (the first after a spell) or DRAFT."""
        if self.idle > 0:
            self.idle -= 1
            self.idle_iterations += 1
            return IDLE
        return PROBE if self.backoff > 0 else DRAFT

    def drafted(self, paid: bool) -> None:
        """After a tree that is not a probe and whose drafting ran the model: an idle iteration next
        unless it paid (`paid`: its best expected rate reached plain steps')."""
        self.backoff = self.idle = 0 if paid else 1

    def probed(self, pays_now: bool, beat_plain: bool) -> None:
        """After a probe whose drafting ran the model, judged with what it taught: `pays_now`, its tree
        would pay in expectation now; `beat_plain`, its own iteration beat plain steps' rate."""
        if pays_now:
            self.backoff = 0
        else:
            self.backoff = self.backoff // 2 if beat_plain else min(2 * self.backoff, self.backoff_max)
        self.idle = self.backoff
