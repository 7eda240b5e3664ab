"""`CostGate`: draft only while drafting steps yield more tokens per second than plain steps
(the speculative strategy keeps one per kind of sequence, greedy and sampling, and one per stream
count for whole steps; strategy.py)."""

from __future__ import annotations

from typing import Any, Hashable, Optional


TOLERANCE = 0.03  # how far behind plain drafting may fall before it stops (CostGate's default)


class CostGate:
    """Draft only while drafting steps yield more tokens per second than plain steps.

    A step is timed from one `propose` of a sequence to its next (drafting, the target's forward,
    verification, bookkeeping: everything the step cost, on whatever runtime and kernel set serves
    it) and credited with the tokens it emitted (accepted + 1). Steps that asked the drafters and
    steps that did not keep separate EMAs of tokens per second and of seconds, per sequence and
    for the whole instance (what a new sequence starts from).

    A drafting step whose drafters proposed nothing (`proposed`) and took under `tolerance` of the
    step to say so is timed as a plain step: a bursty drafter is judged by the steps it drafts.
    A sequence's first `setup_steps` drafting steps are not timed (its drafters' one-time work,
    such as a draft model reading the prompt, is no drafting step's cost). A plain step is forced after a
    sequence's first `first_steps` timed drafting steps and then every `plain_every` drafting
    steps, so its plain rate is measured and kept current (at most 1/`plain_every` of the gain).
    When a sequence's drafting rate falls below its plain rate (less `tolerance`, so noise does
    not stop a drafter that is level) it decodes plain, then drafts `probe_steps` steps to
    measure again. The wait is long enough that the probes cost at most
    `overhead` of the plain steps around them, counted as the tokens a probe step loses against
    plain (a drafter whose steps cost 9x a plain one and never gain waits about probe_steps x 8 /
    overhead steps; one that is nearly level probes again soon), and at least `backoff` steps (doubled by each lost
    probe up to `max_backoff`: by default not, since the cost bound already holds, and a cheap
    drafter such as the n-gram index, whose gains come in bursts, must not miss the next burst).
    Several sequences share a step: the time other sequences spent in their drafters during a
    sequence's step is taken off that step's time. While
    drafting loses, sequences that start meanwhile start plain and probe on the instance's
    schedule (plain steps counted across sequences), so short requests do not each pay a probe.
    The verdict never depends on the gate: output stays the target's at any temperature.
    """

    def __init__(self, plain_every: int = 32, probe_steps: int = 3, backoff: int = 8, max_backoff: int = 8,
                 max_wait: int = 4096, overhead: float = 0.015, alpha: float = 0.15, first_steps: int = 4,
                 tolerance: float = TOLERANCE, setup_steps: int = 1, clock: Optional[list] = None) -> None:
        self.plain_every = plain_every
        self.probe_steps = probe_steps
        self.first_backoff = backoff
        self.max_backoff = max_backoff
        self.max_wait = max_wait
        # [seconds every sequence spent in its drafters so far], shared by the gates of one strategy
        self._clock = clock if clock is not None else [0.0]
        self.overhead = overhead
        self.alpha = alpha
        self.first_steps = first_steps
        self.tolerance = tolerance
        self.setup_steps = setup_steps
        self._state: dict[Hashable, dict] = {}
        # The instance: EMAs over every sequence's steps, and whether drafting loses now.
        self.shared: dict[str, Any] = {"draft": None, "plain": None, "draft_s": None, "plain_s": None,
                                       "losing": False, "wait": 0, "plain_since_probe": 0,
                                       "backoff": backoff, "known": False, "explorer": None, "ask": None}

    def _ema(self, table: dict, name: str, value: float) -> None:
        old = table[name]
        table[name] = value if old is None else (1 - self.alpha) * old + self.alpha * value

    def begin(self, key: Hashable, now: float, timed: bool = True) -> bool:
        """Close the sequence's last step (timed up to `now`) and say whether this step drafts.
        `timed` False: this step's time is not the sequence's (it also feeds other prompts): not learned."""
        state = self._state.get(key)
        if state is None:
            state = self._state[key] = self._new_state()
            state["key"] = key
        last = state["last"]
        if last is not None:
            # Other sequences' drafting in the same steps is theirs, not this step's cost: a plain step
            # beside a drafting one would otherwise look slow, and that drafting look cheap.
            self._learn(state, (now - last[0]) - (self._clock[0] - last[3] - last[4]))
        drafting = self._decide(state)
        # began, drafting, tokens, clock, own drafting, drafts proposed (None: not told), a peek
        state["last"] = [now, drafting, 0, self._clock[0], 0.0, None, False]
        if drafting and state["setup"] > 0:
            # A sequence's first drafting step carries its drafters' one-time work (a draft model
            # feeds it the whole prompt: ten plain steps' time at 135M), not what a drafting step
            # costs. Timed, it sank the first EMA sample, which the verdict after `first_steps` rests on.
            state["setup"] -= 1
            state["last"] = None
        if not timed:
            state["last"] = None
        if not drafting:
            state["since_plain"] = 0  # a plain step of any cause refreshes the plain rate
            self.shared["plain_since_probe"] += 1
        return drafting

    def _learn(self, state: dict, seconds: float) -> None:
        """Credit the step that began at `state`'s last `begin`, which took `seconds`, to its kind."""
        last = state["last"]
        if seconds > 0 and last[2] > 0 and not last[6]:  # a peek is neither kind's step (its tokens are a draft's)
            # A drafting step whose drafters proposed nothing verified nothing: a plain step, plus
            # the asking. Where the asking was cheap (an n-gram lookup: under `tolerance` of the
            # step) it is timed as plain, or a drafter whose gains come in bursts is judged by the
            # steps between them, each a plain step's cost and a token, and lost by the asking's
            # noise (tools/bench_gate.py on Gemma 3 270M: gated n-gram decoding at 1.16-1.73x plain
            # where ungated gave 2.01-2.23x). Costly asking (a draft model that proposed nothing)
            # stays drafting.
            asked_cheaply = last[5] == 0 and last[4] < self.tolerance * seconds
            kind = "draft" if last[1] and not asked_cheaply else "plain"
            for table in (state, self.shared):
                self._ema(table, kind, last[2] / seconds)
                self._ema(table, kind + "_s", seconds)
            state[kind + "_n"] += 1
            if last[1]:  # what asking the drafters costs of a step, for `peek`
                for table in (state, self.shared):
                    self._ema(table, "ask", last[4] / seconds)

    def _new_state(self) -> dict:
        state = {"draft": None, "draft_n": 0, "plain": None, "plain_n": 0, "draft_s": None, "plain_s": None,
                 "since_plain": 0, "wait": 0, "probing": 0, "backoff": self.shared["backoff"], "last": None,
                 "probed": False, "setup": self.setup_steps, "ask": None, "peek_skip": False}
        shared = self.shared
        if shared["losing"]:  # start plain, probing when the instance's wait is over
            state["plain"], state["plain_s"], state["plain_n"] = shared["plain"], shared["plain_s"], 1
            state["wait"] = max(1, shared["wait"] - shared["plain_since_probe"])
        return state

    def _wait(self, state: dict) -> int:
        """Plain steps before the next probe: probes cost at most `overhead`, and at least the backoff.

        A probe step of `draft_s` seconds yields draft x draft_s tokens where plain steps would have
        yielded plain x draft_s: it loses (1 - draft / plain) x draft_s / plain_s plain steps' worth.
        A drafter that never helps (one token a step) loses draft_s / plain_s - 1 of them, a drafter
        nearly level with plain almost nothing, so it probes again soon: its gains may be near."""
        wait = state["backoff"]
        if state["draft_s"] and state["plain_s"] and state["draft"] and state["plain"]:
            loss = max(0.0, 1.0 - state["draft"] / state["plain"]) * state["draft_s"] / state["plain_s"]
            wait = max(wait, int(self.probe_steps * loss / self.overhead))
        return min(wait, self.max_wait)

    def _start_probe(self, state: dict) -> None:
        """Draft the next `probe_steps` steps, judged afresh."""
        state["draft"], state["draft_n"], state["probing"] = None, 0, self.probe_steps
        state["probed"] = True

    def _decide(self, state: dict) -> bool:
        if state["wait"] > 0:  # backing off: plain, then a probe
            state["wait"] -= 1
            shared = self.shared
            if state["wait"] == 0 and shared["losing"] and shared["plain_since_probe"] < shared["wait"]:
                # Another sequence probed meanwhile: one probe per wait for the whole instance, not
                # one per sequence (8 streams probing at once cost more than the gate saves).
                state["wait"] = shared["wait"] - shared["plain_since_probe"]
            elif state["wait"] == 0:
                self._start_probe(state)
                shared["plain_since_probe"] = 0
            return False
        if state["probing"] > 0:
            state["probing"] -= 1
            state["since_plain"] += 1
            return True
        shared = self.shared
        if not shared["known"]:
            # Before the instance's first verdict one sequence explores and the others decode plain:
            # 8 streams each paying their first drafting steps cost more than a verdict saves.
            if shared["explorer"] not in self._state:
                shared["explorer"] = state["key"]
            if shared["explorer"] != state["key"]:
                return False
        if not state["probed"] and state["draft_n"] < self.first_steps and shared["losing"] and shared["wait"] > 1:
            # Still in its first steps when another sequence found drafting losing (several
            # started together): take the instance's verdict instead of paying for its own.
            if state["plain"] is None:
                state["plain"], state["plain_s"], state["plain_n"] = shared["plain"], shared["plain_s"], 1
            state["wait"] = max(1, shared["wait"] - shared["plain_since_probe"])
            return self._decide(state)
        if state["draft_n"] >= self.first_steps and (state["plain_n"] == 0 or state["since_plain"] >= self.plain_every):
            return False  # measure plain
        # A sequence's first steps say little (no n-gram match yet, a cold draft), so it drafts
        # `first_steps` before the first verdict; a probe decides after `probe_steps`.
        evidence = self.probe_steps if state["probed"] else self.first_steps
        if state["draft"] is not None and state["plain"] is not None and state["draft_n"] >= evidence:
            if state["draft"] < state["plain"] * (1.0 - self.tolerance):
                wait = self._wait(state)
                if state["draft_n"] <= self.probe_steps:  # lost right after a probe: wait longer next time
                    state["backoff"] = min(self.max_backoff, state["backoff"] * 2)
                state["wait"] = wait - 1  # this step is the first plain one
                self.shared.update(losing=True, wait=wait, plain_since_probe=0, backoff=state["backoff"], known=True)
                return False
            if state["draft"] > state["plain"] * (1.0 + self.tolerance):  # a clear win: tell the instance
                state["backoff"] = self.first_backoff
                self.shared.update(losing=False, backoff=self.first_backoff)
            self.shared["known"] = True
        state["since_plain"] += 1
        return True

    def end(self, key: Hashable, now: float) -> None:
        """Close the key's step at `now` (a step-level key: the next step may have another key)."""
        state = self._state.get(key)
        if state is not None and state["last"] is not None:
            self._learn(state, now - state["last"][0])
            state["last"] = None

    def forget_step(self, key: Hashable) -> None:
        """The step that began at the key's last `begin` is not one to learn from."""
        state = self._state.get(key)
        if state is not None:
            state["last"] = None

    def spent(self, key: Hashable, seconds: float) -> None:
        """The sequence's drafters took `seconds` in the step that began at its last `begin`."""
        self._clock[0] += seconds
        state = self._state.get(key)
        if state is not None and state["last"] is not None:
            state["last"][4] += seconds

    def proposed(self, key: Hashable, nodes: int) -> None:
        """The sequence's drafters proposed `nodes` draft tokens in the step that began at its last `begin`."""
        state = self._state.get(key)
        if state is not None and state["last"] is not None:
            state["last"][5] = nodes

    def peek(self, key: Hashable) -> bool:
        """Whether the sequence, decoding plain while drafting loses, may verify one draft token this
        step (call after `begin` said plain): only while it waits, and only where asking its drafters
        costs under `tolerance` of a step (an n-gram lookup, not a draft model's forward), and on
        every other such step. The strategy peeks only where one draft row costs the step at most
        2 x `tolerance`, so peeking stays within the gate's bound. A peek that is accepted ends the
        wait (`tokens`): the n-gram drafter's gains come in bursts (the output starts copying its
        input), and a wait that outlasts the request missed them (Gemma 3 270M: requests decoded
        wholly plain where ungated drafting took 31-33 steps for 48 tokens)."""
        state = self._state.get(key)
        if state is None or state["last"] is None or state["last"][1] or state["wait"] <= 0:
            return False
        ask = state["ask"] if state["ask"] is not None else self.shared["ask"]  # a new sequence: the instance's
        if ask is None or ask >= self.tolerance:
            return False
        state["peek_skip"] = not state["peek_skip"]  # every other waiting step at most
        if not state["peek_skip"]:
            return False
        state["last"][6] = True
        return True

    def tokens(self, key: Hashable, emitted: int) -> None:
        """The step that began at the sequence's last `begin` emitted `emitted` tokens."""
        state = self._state.get(key)
        if state is not None and state["last"] is not None:
            state["last"][2] += emitted
            if state["last"][6] and emitted > 1 and state["wait"] > 0:  # a peek was accepted: probe now
                state["wait"] = 0
                self._start_probe(state)

    def release(self, key: Hashable) -> None:
        """Forget a sequence (the instance keeps what it learned)."""
        self._state.pop(key, None)
        if self.shared["explorer"] == key:
            self.shared["explorer"] = None
