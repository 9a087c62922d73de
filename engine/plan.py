"""Deprecated name of `engine.memory_plan` (`plan` read like the scheduler's `StepPlan`); it goes in the
next release."""

import sys

from engine.memory_plan import run

if __name__ == "__main__":
    print("python -m engine.plan is deprecated: use python -m engine.memory_plan", file=sys.stderr)
    run()
