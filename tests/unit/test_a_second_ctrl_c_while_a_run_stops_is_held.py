"""A run stopping for a signal (its step finishing, its checkpoint being saved, then metrics.json
written) holds a further Ctrl-C until it has ended, saying so once, instead of raising it where it
would cut the record short; real signals to this process, the callback the run installs. The end to
end run: tests/e2e/test_a_second_ctrl_c_keeps_the_runs_record.py."""

import os
import signal
from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from qlora_recipes import interrupts
from qlora_recipes.run.lifecycle import PreemptionCallback

STEP = SimpleNamespace(world_size=1, device="cpu"), SimpleNamespace(global_step=7)


@pytest.fixture
def default_handlers():
    """SIGINT and SIGTERM as a terminal's command has them (a suite in the background ignores SIGINT)."""
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in interrupts.STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _stopping_at_step_7(run: PreemptionCallback) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: the step finishes, then a checkpoint there
    control = run.on_step_end(*STEP, TrainerControl())
    assert control.should_save and control.should_training_stop and run.stop == "SIGINT"


def test_a_second_ctrl_c_while_saving_and_after_is_held_and_said_once(default_handlers, capfd):
    with interrupts.raising(*interrupts.STOP_SIGNALS):  # as training.train runs a run
        run = PreemptionCallback().install()
        _stopping_at_step_7(run)
        os.kill(os.getpid(), signal.SIGINT)  # while the checkpoint is saved
        run.uninstall()  # the trainer has ended: metrics.json is written next
        os.kill(os.getpid(), signal.SIGINT)  # where a KeyboardInterrupt used to skip metrics.json
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.stop == "SIGINT" and run.received == "SIGINT"  # the first signal names the stop
    assert capfd.readouterr().err.splitlines() == [
        "already stopping for SIGINT (Ctrl-C): saving the checkpoint at step 7, then the run ends (Ctrl-C again is "
        "ignored; kill -9 would abandon the save, the checkpoints already sealed stay sound)"
    ]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's end puts them back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_after_the_save_the_line_says_the_checkpoint_is_sealed(default_handlers, capfd):
    with interrupts.raising(*interrupts.STOP_SIGNALS):
        run = PreemptionCallback().install()
        _stopping_at_step_7(run)
        run.uninstall()
        os.kill(os.getpid(), signal.SIGINT)
    assert capfd.readouterr().err.startswith(
        "already stopping for SIGINT (Ctrl-C): the checkpoint at step 7 is sealed; writing metrics.json, then"
    )


def test_a_sigterm_repeated_by_a_launcher_is_held_without_a_line(default_handlers, capfd):
    with interrupts.raising(*interrupts.STOP_SIGNALS):
        run = PreemptionCallback().install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a sweep's controller passing the group's SIGTERM on
        run.on_step_end(*STEP, TrainerControl())
        run.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.stop == "SIGTERM"
    assert capfd.readouterr().err == ""


def test_a_run_that_did_not_stop_gives_ctrl_c_back_at_once(default_handlers):
    with interrupts.raising(*interrupts.STOP_SIGNALS):
        run = PreemptionCallback().install()
        run.on_step_end(*STEP, TrainerControl())
        run.uninstall()
        with pytest.raises(KeyboardInterrupt):  # e.g. in the final evaluation: the caller's one line
            os.kill(os.getpid(), signal.SIGINT)
