"""A test-only hold in vLLM's scheduler: a request parked at a step boundary until released.

A vLLM plugin of its own distribution (``pyproject.toml`` beside this file), which
``scripts/setup.sh`` installs for the test suite only; routereplay's wheel and images do not
contain it.

Tests that need a request in flight across ``/pause``, a weight reload or a version change would
otherwise start a generation long enough to outlast them (tens of seconds on a CPU host), and a
test that must leave during prefill would race the engine to the prompt's end. With
``RR_TEST_HOLD_DIR`` set in the engine's environment, a request whose id starts with
``held-`` is left out of the scheduler's batch once it has :data:`HOLD_AFTER` output tokens; one
whose id starts with ``held-prefill-`` is left out after its first chunk of prompt, before any
output. It stays in the running set with its KV cache, and it runs on from the next step after a
file named by its id (the ``X-Request-Id``, up to its first ``.``) exists in that directory.

Unset, nothing is patched. :func:`maybe_install` runs in each vLLM process as a plugin; only the
engine core's scheduler ever holds anything.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV", "HOLD_AFTER", "PREFILL_PREFIX", "PREFIX", "maybe_install"]

log = logging.getLogger("routereplay.tests")

ENV = "RR_TEST_HOLD_DIR"  # not a ROUTEREPLAY_* setting: no deployment knows this name
PREFIX = "held-"
PREFILL_PREFIX = PREFIX + "prefill-"  # parked mid-prefill (a prompt longer than one chunk)
HOLD_AFTER = 4  # output tokens streamed before the hold: enough for a test to see it started
_IDLE_S = 0.005  # a step that schedules nothing but held requests sleeps this long, not spins


def _held(request: Any, release_dir: Path) -> bool:
    rid: str = request.request_id
    if rid.startswith(PREFILL_PREFIX):
        parked = 0 < request.num_computed_tokens < request.num_prompt_tokens
    else:
        parked = rid.startswith(PREFIX) and request.num_output_tokens >= HOLD_AFTER
    return parked and not (release_dir / rid.split(".", 1)[0]).exists()


def maybe_install() -> None:
    """Wrap ``Scheduler.schedule`` to park held requests, when :data:`ENV` is set."""
    value = os.environ.get(ENV)
    if not value:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_routereplay_hold", False):
        return
    release_dir = Path(value)
    schedule = Scheduler.schedule

    def held_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = [r for r in self.running if _held(r, release_dir)]
        if not held:
            return schedule(self, *args, **kwargs)
        # Out of the running list for this one step only: never scheduled, never preempted.
        parked = {id(r) for r in held}
        self.running[:] = [r for r in self.running if id(r) not in parked]
        try:
            out = schedule(self, *args, **kwargs)
        finally:
            self.running.extend(held)
        if out.total_num_scheduled_tokens == 0:
            time.sleep(_IDLE_S)
        return out

    held_schedule._routereplay_hold = True  # type: ignore[attr-defined]
    Scheduler.schedule = held_schedule  # type: ignore[method-assign]
    log.warning(
        "%s is set: requests named %s* park after %d tokens (%s*: in prefill) until %s/<id> "
        "exists (tests only)",
        ENV, PREFIX, HOLD_AFTER, PREFILL_PREFIX, release_dir,
    )  # fmt: skip
