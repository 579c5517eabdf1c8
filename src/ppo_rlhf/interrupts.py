"""Ctrl-C (SIGINT) and SIGTERM stop a run at its next safe point, never in the middle of a step
or of a checkpoint write (docs/design.md, "Resume and divergence").

    with stop_on_signals():          # cli.main, around the whole command
        ...
        for step in ...:             # a trainer's loop, once per step
            ...
            stop = stop_requested()  # after the step's work, before its checkpoint
            if due or stop: save(...)
            if stop: raise RunInterrupted(done, "step", resume_from=done)

The handler only sets a flag; the loop looks at it between steps, saves its state (a stage that
checkpoints) and raises :class:`RunInterrupted`, which ``cli.main`` turns into one line with the
``--resume`` command that continues, and exit code 130 (SIGINT) or 143 (SIGTERM).  A stop asked
during the last step stops nothing: the work is done, and the stage saves its results as a straight
run does (:func:`stop_after`).  A second signal aborts at once (``KeyboardInterrupt``): what is on
disk is still whole, since every checkpoint is written atomically, and the line then names the
last checkpoint this run wrote or resumed from (:func:`note_checkpoint`), or says there is none.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from contextlib import contextmanager

# The shell's convention: 128 + the signal's number.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

_received: list[int] = []  # the signals caught since the handlers were installed
# The run's checkpoint on disk, whole: (unit, step) of the last one written or resumed from; None: none.
_checkpoint: list[tuple[str, int] | None] = [None]


class RunInterrupted(Exception):
    """A run stopped at a safe point after a signal.  ``resume_from``: the step a resume continues
    after (the checkpoint on disk), or None when the run has none to continue from."""

    def __init__(self, done: int, unit: str, resume_from: int | None):
        self.done, self.unit, self.resume_from = done, unit, resume_from
        self.signal = _received[0] if _received else signal.SIGINT
        super().__init__(f"interrupted after {unit} {done}")

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal, 130)


def _handler(signum, frame) -> None:
    if _received:  # the second signal: the user does not want to wait for the step to end
        raise KeyboardInterrupt
    _received.append(signum)
    print(f"\n{signal.Signals(signum).name}: stopping after this step (again to abort at once)", file=sys.stderr,
          flush=True)


@contextmanager
def stop_on_signals():
    """Catch SIGINT and SIGTERM meanwhile (main thread only: Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _handler) for signum in EXIT_CODES}
    _received.clear()
    note_checkpoint(None)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received.clear()


def stop_requested() -> bool:
    """Whether a stop was asked, in any process.  Several processes: a signal may reach one
    before another, so they agree (one flag from each, the same answer in all) and stop at the
    same step; none then waits forever in a collective the others left."""
    from ppo_rlhf.distributed import gather_objects, is_distributed

    if not is_distributed():
        return bool(_received)
    return any(gather_objects([bool(_received)]))


def stop_after(done: int, total: int, unit: str = "step") -> bool:
    """Whether the run stops after ``unit`` ``done`` of ``total`` (:func:`stop_requested`, called once
    per step in every process alike).  Not after the last: the work is finished, and the stage saves
    its results as a straight run does, which is quicker than a resume and leaves nothing to redo;
    said once, on the main process."""
    if not stop_requested():
        return False
    if done < total:
        return True
    from ppo_rlhf.distributed import is_main_process

    if is_main_process():
        name = signal.Signals(_received[0]).name if _received else "the stop"
        print(f"{name} came during the last {unit} ({done} of {total}): the run is finished, and saves its results "
              f"before it ends", file=sys.stderr, flush=True)
    return False


def note_checkpoint(step: int | None, unit: str = "step") -> None:
    """The run's whole checkpoint on disk is now the one after ``unit`` ``step`` (None: it has none):
    called once one is written, or read to resume from (trainers/resume.py)."""
    _checkpoint[0] = None if step is None else (unit, step)


def aborted_message(command: str, can_resume: bool) -> str:
    """The line printed for a run aborted at once (a second signal): what is on disk to go on from,
    as this run left it -- never a checkpoint it did not write or resume from."""
    line = f"ppo-rlhf {command}: interrupted"
    if not can_resume:
        return line
    if _checkpoint[0] is None:
        return f"{line} before it wrote a checkpoint: run it again with --overwrite to start over"
    unit, step = _checkpoint[0]
    return f"{line}; its last checkpoint, after {unit} {step}, is whole: continue with: {resume_command()}"


def resume_command(argv: list[str] | None = None) -> str:
    """The user's command with ``--resume`` (and without ``--overwrite``, which contradicts it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept = [arg for arg in argv if arg not in ("--overwrite", "--resume", "--no-resume", "--no-overwrite")]
    return shlex.join(["ppo-rlhf", *kept, "--resume"])


def failure_resume_hint(error: BaseException, can_resume: bool) -> str:
    """After a run stopped on a failure of the user's code (an environment, a reward): how to go on
    once it is fixed, where the command resumes and the run said where it could (``resume_from``,
    set by the training loop: the step of its last checkpoint, None for none); else nothing."""
    if not can_resume or not hasattr(error, "resume_from"):
        return ""
    unit = getattr(error, "resume_unit", "step")
    if error.resume_from is None:
        return "; the run had written no checkpoint: once that is fixed, run it again with --overwrite"
    return f"; once that is fixed, continue from its checkpoint after {unit} {error.resume_from} with: {resume_command()}"


def interrupted_message(error: RunInterrupted, command: str, can_resume: bool) -> str:
    """The one line printed for an interrupted run: where it stopped and what continues it."""
    line = f"ppo-rlhf {command}: {error}"
    if not can_resume:
        return f"{line}; this command cannot resume: run it again (with --overwrite) to start over"
    if not error.resume_from:  # save_every 0, or stopped before the first checkpoint
        return f"{line}; it had written no checkpoint to resume from: run it again with --overwrite to start over"
    if error.resume_from != error.done:
        line += f" (its last checkpoint is after {error.unit} {error.resume_from}: a resume continues from there)"
    from ppo_rlhf.distributed import world_size

    launched = f" (launched as before, with {world_size()} processes)" if world_size() > 1 else ""
    return f"{line}; continue with: {resume_command()}{launched}"
