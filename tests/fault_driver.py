"""Run `trn-accum` with a fault injected through a seam: the test's code, not the trainer's.

    python tests/fault_driver.py KIND=STEP [KIND=STEP ...] -- train --config ... --run-dir ...

KIND:
- sigterm_after_step: the process sends itself SIGTERM right after step STEP is logged (the
  real preemption path: the handler sets the flag, the loop saves that step and exits 75);
- sigkill_after_save_start: SIGKILL once the background save of step STEP has started and
  made its temporary directory, before it commits (a save killed half-way);
- sigkill_after_step: SIGKILL right after step STEP is logged (a trainer killed outright: it
  leaves its run-dir claim behind);
- truncate_after_step: right after step STEP is logged, the file named by $FAULT_TRUNCATE is
  cut to a third of its size (a data file rewritten under a running trainer).

The trainer is unchanged: the driver wraps `MetricsLogger.log_train` and `Checkpointer.save`.
"""

import os
import signal
import sys
import time

from trn_accum import cli
from trn_accum.checkpoint.checkpointer import Checkpointer
from trn_accum.train.metrics import MetricsLogger


def _install(kind: str, at: int) -> None:
    if kind in ("sigterm_after_step", "sigkill_after_step"):
        log_train = MetricsLogger.log_train
        sig = signal.SIGTERM if kind == "sigterm_after_step" else signal.SIGKILL

        def logged(self, step, metrics):
            log_train(self, step, metrics)
            if step == at:
                os.kill(os.getpid(), sig)

        MetricsLogger.log_train = logged
    elif kind == "truncate_after_step":
        log_train = MetricsLogger.log_train
        path = os.environ["FAULT_TRUNCATE"]

        def truncating(self, step, metrics):
            log_train(self, step, metrics)
            if step == at:
                os.truncate(path, os.path.getsize(path) // 3)

        MetricsLogger.log_train = truncating
    elif kind == "sigkill_after_save_start":
        save = Checkpointer.save

        def saving(self, step, state, **kwargs):
            started = save(self, step, state, **kwargs)
            if started and int(step) == at:
                # half-way: once the background save has made its temporary directory (on a
                # loaded machine that can come after save() returns)
                tmp = f"{int(step)}.orbax-checkpoint-tmp"
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                    n.startswith(tmp) for n in os.listdir(self.directory)
                ):
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            return started

        Checkpointer.save = saving
    else:
        raise SystemExit(f"fault_driver: unknown fault {kind!r}")


def main(argv: list[str]) -> int:
    split = argv.index("--")
    for item in argv[:split]:
        kind, _, step = item.partition("=")
        _install(kind, int(step))
    return cli.main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
